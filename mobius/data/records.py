"""Reading the data a user names: files of records (``.jsonl``, ``.json``, ``.parquet``, a directory
written by ``datasets.Dataset.save_to_disk``) or plain text, and the shape of each record.

Shapes, detected from a record's fields (or forced with ``--data-format``):

========== ============================================ ==========================
format     fields                                       loss on
========== ============================================ ==========================
text       ``text``                                     every token
alpaca     ``instruction``, optional ``input``,          ``output``
           optional ``system``, ``output``
chat       ``messages``: [{role, content}] (OpenAI)     assistant turns
sharegpt   ``conversations``: [{from, value}]            ``gpt`` turns
completion ``prompt``, ``completion`` (TRL; strings or  ``completion``
           lists of messages)
preference ``chosen``, ``rejected``, optional ``prompt``   ``chosen`` over
           (TRL; strings or lists of messages)          ``rejected`` (DPO)
========== ============================================ ==========================

Every record becomes a :class:`Record`: a list of chat messages, or a prompt and an answer of
plain text; a preference record a :class:`Pair`.  Plain text files are documents (format ``text``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from mobius.boundary.checks import parse_json
from mobius.boundary.errors import InputError, first_line

FORMATS = ("text", "alpaca", "chat", "sharegpt", "completion", "preference")
SHAPES = ("text; instruction[/input]/output (alpaca); messages (chat); conversations (ShareGPT); "
          "prompt/completion; [prompt/]chosen/rejected (preference)")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant", "observation": "tool"}
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
DATASETS_MARKERS = ("dataset_info.json", "dataset_dict.json")


@dataclass
class Record:
    """One example: ``messages`` to render with a chat template, or ``prompt`` + ``answer`` text
    (``answer`` None: a document, trained on every token)."""

    messages: list[dict] | None = None
    prompt: str = ""
    answer: str | None = None
    where: str = ""  # the file and line (or record, or row) it came from, for what is said of it


@dataclass
class Pair:
    """One preference: an answer ``chosen`` over ``rejected`` after ``prompt``; all three text, or
    all lists of chat messages (``conversational``: the prompt's turns, then each answer's)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    conversational: bool
    where: str = ""


def detect_format(fields: dict) -> str | None:
    if "chosen" in fields and "rejected" in fields:
        return "preference"
    if "messages" in fields:
        return "chat"
    if "conversations" in fields:
        return "sharegpt"
    if "instruction" in fields and "output" in fields:
        return "alpaca"
    if "prompt" in fields and "completion" in fields:
        return "completion"
    if "text" in fields:
        return "text"
    return None


def _str(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON can spell one (\\ud800); no text holds one
        raise InputError(f"{where}: {key!r} holds {ascii(value[err.start])}, a lone surrogate, which is not "
                         "Unicode text") from None
    return value


def _messages(value, where: str, key: str, role_key: str, content_key: str, roles: dict | None) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: {key!r} must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or role_key not in msg or content_key not in msg:
            raise InputError(f"{where}: {key}[{i}] must be an object with {role_key!r} and {content_key!r}")
        role = _str(msg[role_key], where, f"{key}[{i}].{role_key}")
        if roles is not None:
            if role not in roles:
                raise InputError(f"{where}: {key}[{i}].{role_key} {role!r} is none of {', '.join(roles)}")
            role = roles[role]
        out.append({"role": role, "content": _str(msg[content_key], where, f"{key}[{i}].{content_key}")})
    return out


def _conversation(messages: list[dict], where: str, key: str) -> list[dict]:
    """A conversation that teaches something: system messages first, then the user first, and at
    least one assistant turn (a record without one would teach the end of text right after the
    user's turn)."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise InputError(f"{where}: {key!r} has no assistant turn (roles {roles[:6]}); there is no answer to "
                         "learn from it")
    first = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
    if "system" in roles[first:]:
        raise InputError(f"{where}: {key!r} has a system message after the conversation began (roles {roles[:6]})")
    if roles[first] != "user":
        raise InputError(f"{where}: {key!r} begins with {roles[first]!r}; the user speaks first (roles {roles[:6]})")
    empty = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m["content"].strip()), None)
    if empty is not None:
        raise InputError(f"{where}: {key}[{empty}] is an empty assistant turn: nothing to train on (an empty answer "
                         "would teach the end of the turn right after the prompt)")
    return messages


def to_record(fields, fmt: str | None, where: str) -> tuple[Record | Pair, str]:
    """The :class:`Record` (or :class:`Pair`) of one raw record and its format (``fmt`` forces one)."""
    if not isinstance(fields, dict):
        raise InputError(f"{where}: a record must be a JSON object, got {type(fields).__name__}")
    found = fmt or detect_format(fields)
    if found is None:
        raise InputError(f"{where}: a record with fields {sorted(fields)[:8]} is of no known shape; "
                         f"accepted: {SHAPES}")
    need = {"text": ("text",), "alpaca": ("instruction", "output"), "chat": ("messages",),
            "sharegpt": ("conversations",), "completion": ("prompt", "completion"),
            "preference": ("chosen", "rejected")}[found]
    missing = [k for k in need if k not in fields]
    if missing:
        raise InputError(f"{where}: --data-format {found} needs {', '.join(need)}; the record has {sorted(fields)[:8]}")
    if found == "text":
        return Record(answer=None, prompt=_str(fields["text"], where, "text")), found
    if found == "preference":
        return _pair(fields, where), found
    if found == "alpaca":
        user = _str(fields["instruction"], where, "instruction")
        if fields.get("input"):
            user += "\n\n" + _str(fields["input"], where, "input")
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": _str(fields["output"], where, "output")}]
        if fields.get("system"):
            messages.insert(0, {"role": "system", "content": _str(fields["system"], where, "system")})
        return Record(messages=messages), found
    if found == "chat":
        return Record(messages=_conversation(_messages(fields["messages"], where, "messages", "role", "content", None),
                                             where, "messages")), found
    if found == "sharegpt":
        return Record(messages=_conversation(_messages(fields["conversations"], where, "conversations", "from",
                                                       "value", SHAREGPT_ROLES), where, "conversations")), found
    prompt, completion = fields["prompt"], fields["completion"]
    if isinstance(prompt, list):  # TRL's conversational prompt-completion
        return Record(messages=_conversation(_messages(prompt, where, "prompt", "role", "content", None)
                                             + _messages(completion, where, "completion", "role", "content", None),
                                             where, "prompt + completion")), found
    return Record(prompt=_str(prompt, where, "prompt"), answer=_str(completion, where, "completion")), found


def _pair(fields: dict, where: str) -> Pair:
    """A preference record as TRL reads one: with no ``prompt``, the turns (or the text) the two
    answers share are the prompt (TRL's ``extract_prompt``).  Refused: answers of two kinds, an
    empty answer, the same answer twice."""
    chosen, rejected, prompt = fields["chosen"], fields["rejected"], fields.get("prompt")
    conversational = isinstance(chosen, list)
    if isinstance(rejected, list) != conversational or (prompt is not None and isinstance(prompt, list)
                                                         != conversational):
        raise InputError(f"{where}: 'chosen', 'rejected' (and 'prompt') must all be text or all lists of messages")
    if conversational:
        chosen = _messages(chosen, where, "chosen", "role", "content", None)
        rejected = _messages(rejected, where, "rejected", "role", "content", None)
        if prompt is None:
            shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen),
                                                                                               len(rejected)))
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        else:
            prompt = _messages(prompt, where, "prompt", "role", "content", None)
        for key, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer or any(m["role"] != "assistant" for m in answer):
                raise InputError(f"{where}: {key!r} must end the conversation with the assistant's answer")
            _conversation(prompt + answer, where, f"prompt + {key}")
    else:
        chosen, rejected = _str(chosen, where, "chosen"), _str(rejected, where, "rejected")
        if prompt is None:  # the shared start, short of a space before where they part (TRL's rule)
            shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen),
                                                                                               len(rejected)))
            if 0 < shared < len(chosen) and chosen[shared - 1] == " ":
                shared -= 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        else:
            prompt = _str(prompt, where, "prompt")
        for key, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer.strip():
                raise InputError(f"{where}: {key!r} is an empty answer")
    if chosen == rejected:
        raise InputError(f"{where}: 'chosen' and 'rejected' are the same answer: nothing to prefer")
    return Pair(prompt, chosen, rejected, conversational)


def _is_binary(raw: bytes) -> bool:
    return b"\x00" in raw[:8192]


def _read_bytes(f: Path, option: str) -> bytes:
    if not f.is_file():
        raise InputError(f"{option} {f}: not a regular file")
    try:
        return f.read_bytes()
    except OSError as err:
        raise InputError(f"{option} {f}: cannot read it ({err.strerror})") from None


def _decode(raw: bytes, f: Path, option: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark is not part of the text
    except UnicodeDecodeError as err:
        raise InputError(f"{option} {f}: not UTF-8 text (byte {err.start})") from None


def _raw_records(f: Path, option: str) -> list[tuple[str, object]]:
    """(where, the record) of each record of ``f``: a JSONL line still as text (it is parsed as
    a record, so that a line that is no JSON is one bad record)."""
    if f.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(f"{option} {f}: reading Parquet needs pyarrow: pip install 'mobius-train[data]'") from None
        try:
            return [(f"row {n}", row) for n, row in enumerate(pq.read_table(str(f)).to_pylist(), 1)]
        except Exception as err:  # pyarrow raises its own types for a damaged file
            raise InputError(f"{option} {f}: not a readable Parquet file ({first_line(err, 120)})") from None
    text = _decode(_read_bytes(f, option), f, option)
    if f.suffix == ".json":
        data = parse_json(text, f"{option} {f}")
        if not isinstance(data, list):
            raise InputError(f"{option} {f}: a .json data file must hold a list of records")
        return [(f"record {n}", record) for n, record in enumerate(data, 1)]
    # Records end at "\n" alone: a JSON string may hold U+2028 or a form feed, which splitlines() would cut at.
    return [(f"line {n}", JsonLine(line)) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


@dataclass(frozen=True)
class JsonLine:
    """A JSONL line not yet parsed."""

    text: str


def _check_confined(d: Path, option: str) -> None:
    """Every data file a ``datasets`` directory's ``state.json`` names lies inside it: a state file
    naming ``../elsewhere.arrow`` would have us train on a file the user never named."""
    root = d.resolve()
    for state in d.rglob("state.json"):
        try:
            files = json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])
            names = [f["filename"] for f in files]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue  # datasets itself says what is wrong with it
        for name in names:
            target = (state.parent / str(name)).resolve()
            if root not in target.parents:
                raise InputError(f"{option} {d}: {state} names {str(name)[:80]!r}, outside the directory; "
                                 "refusing to read it")


def _datasets_records(d: Path, option: str) -> list:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{option} {d}: a datasets directory needs the 'datasets' package: "
                         "pip install 'mobius-train[data]'") from None
    _check_confined(d, option)
    try:
        loaded = datasets.load_from_disk(str(d))
    except Exception as err:  # datasets raises many types for a directory it cannot read
        raise InputError(f"{option} {d}: not a readable datasets directory ({first_line(err, 120)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise InputError(f"{option} {d}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded.to_list()


def _files(path: Path, option: str) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
    if path.exists():
        raise InputError(f"{option} {path}: not a regular file or directory")
    raise InputError(f"{option} {path}: no such file or directory")


def read_examples(path: str | Path, fmt: str | None = None, option: str = "--data",
                  skipped: list[str] | None = None) -> tuple[list[Record | Pair], str]:
    """Every record under ``path`` and their one format; plain text files are ``text`` documents.
    A bad record is refused naming its file, line (record, row) and what is wrong with it; with
    ``skipped`` (``--skip-bad-records``) it is left out and said there instead."""
    path = Path(path)
    if path.is_dir() and any((path / m).is_file() for m in DATASETS_MARKERS):
        sources = [(path, [(f"row {n}", row) for n, row in enumerate(_datasets_records(path, option), 1)])]
    else:
        sources = []
        for f in _files(path, option):
            if f.suffix == ".arrow":
                raise InputError(f"{option} {f}: an Arrow file; give the directory datasets.save_to_disk wrote")
            if f.suffix in RECORD_SUFFIXES:
                sources.append((f, _raw_records(f, option)))
                continue
            raw = _read_bytes(f, option)
            if _is_binary(raw):
                raise InputError(f"{option} {f}: a binary file, not text or records")
            sources.append((f, [("", {"text": _decode(raw, f, option)})]))
    records, formats = [], set()
    for f, raw in sources:
        for label, fields in raw:
            where = f"{option} {f}" + (f" {label}" if label else "")
            try:
                if isinstance(fields, JsonLine):
                    fields = parse_json(fields.text, where)
                record, found = to_record(fields, fmt, where)
            except InputError as err:
                if skipped is None:
                    raise
                skipped.append(str(err))
                continue
            formats.add(found)
            records.append(replace(record, where=where))
    if not records:
        raise InputError(f"{option} {path}: " + (f"every one of its {len(skipped)} records is bad (the first: "
                                                 f"{skipped[0]})" if skipped else "no records or text found (empty)"))
    if len(formats) > 1:
        raise InputError(f"{option} {path}: records of several formats ({', '.join(sorted(formats))}); "
                         "give one format per run")
    return records, formats.pop()
