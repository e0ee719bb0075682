"""Records become token ids with a mask of the tokens that carry loss.

Chat messages are rendered by the model's own chat template through ``transformers``'
``apply_chat_template`` (never a template engine of ours).  Which tokens are the answer is found
the way the template itself draws the line: for each assistant turn, the conversation up to it
rendered with the generation prompt ends where the answer starts, and the conversation including
it ends where the answer (with whatever the template closes a turn with) stops.  Tokens whose text
starts inside those spans are trained; the rest is prompt.  That is what TRL's assistant-only loss
trains with its generation-tagged templates: the template's own end of turn teaches the model where
an answer ends, so no EOS is added to a conversation (an EOS after ChatML's ``<|im_end|>\n`` would
teach a token that is never generated).  Plain prompt/completion text and documents end with the
tokenizer's EOS, trained, as TRL adds it to non-conversational data.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mobius.boundary.checks import read_json_object
from mobius.boundary.errors import InputError, first_line
from mobius.data.records import Record
from mobius.data.tokenizers import ByteTokenizer, auto_tokenizer

# A template renders one conversation in milliseconds; one that loops for seconds or writes
# megabytes is refused, not waited for.
RENDER_LIMIT_S = 5.0
RENDER_LIMIT_CHARS = 1 << 24


class RenderTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`RenderTimeout` in this block after ``seconds`` (the main thread only, where a
    timer signal can interrupt Python code; elsewhere there is no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise RenderTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Example:
    ids: np.ndarray  # (L,) token ids
    trained: np.ndarray  # (L,) bool: token i is part of an answer (predicting it carries loss)


def template_file(model: str) -> str | None:
    """The chat template a model directory carries, if any (``chat_template.jinja`` or the
    ``chat_template`` of ``tokenizer_config.json``)."""
    d = Path(model)
    if not d.is_dir():
        return None
    if (d / "chat_template.jinja").is_file():
        return str(d / "chat_template.jinja")
    if (d / "tokenizer_config.json").is_file():
        if read_json_object(d / "tokenizer_config.json").get("chat_template"):
            return str(d / "tokenizer_config.json")
    return None


class ChatRenderer:
    """Renders :class:`Record` s with a model directory's tokenizer and chat template."""

    def __init__(self, model: str, chat_template: str | None, train_on_prompt: bool):
        self.model = model
        self.train_on_prompt = train_on_prompt
        self.tokenizer = auto_tokenizer(Path(model), "its tokenizer") if Path(model).is_dir() else None
        self.template: str | None = None
        self.template_source = "none"
        if chat_template is not None:
            try:
                self.template = Path(chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise InputError(f"--chat-template {chat_template}: cannot read it ({err})") from None
            self.template_source = chat_template
        elif self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            self.template_source = template_file(model) or "the tokenizer's"
        self.eos_id = None if self.tokenizer is None else self.tokenizer.eos_token_id

    @property
    def has_template(self) -> bool:
        return self.template is not None or self.template_source != "none"

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            with time_limit(RENDER_LIMIT_S):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                          add_generation_prompt=generation_prompt)
        except RenderTimeout:
            raise InputError(f"the chat template ({self.template_source}) took more than {RENDER_LIMIT_S:g} s to "
                             "render one conversation; refusing it") from None
        except Exception as err:  # jinja2 errors and the template's own raise_exception
            raise InputError(f"the chat template ({self.template_source}) refuses a conversation: "
                             f"{first_line(err, 160)}") from None
        if len(text) > RENDER_LIMIT_CHARS:
            raise InputError(f"the chat template ({self.template_source}) rendered one conversation into "
                             f"{len(text):,} characters (at most {RENDER_LIMIT_CHARS:,}); refusing it")
        return text

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), list(enc["offset_mapping"])

    def chat(self, messages: list[dict]) -> Example:
        if not self.has_template:
            raise InputError(f"chat and instruction data need a chat template: --model {self.model} has none; "
                             "give one with --chat-template FILE")
        full = self._render(messages)
        ids, offsets = self._encode(full)
        spans = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], generation_prompt=True) if i else ""
            # The answer ends where the conversation that stops after it parts from the whole one, token
            # by token: a template that closes the conversation (Phi-3's EOS) closes only the last turn.
            upto = self._encode(self._render(messages[: i + 1]))[0]
            same = _common_prefix(ids, upto)
            end = offsets[same - 1][1] if same else 0
            if not full.startswith(prompt) or end <= len(prompt):
                raise InputError(f"the chat template ({self.template_source}) renders a conversation differently "
                                 "from its beginning, so the answer tokens cannot be told apart")
            spans.append((len(prompt), end))
        trained = [self.train_on_prompt or any(a <= s < b for a, b in spans) for s, _ in offsets]
        return Example(np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool))

    def text(self, prompt: str, answer: str | None) -> Example:
        """Plain prompt + answer (TRL's standard prompt-completion), or a document (answer None)."""
        if answer is None:
            ids, _ = self._encode(prompt)
            return self._finish(ids, [True] * len(ids))
        ids, offsets = self._encode(prompt + answer)
        cut = len(prompt)
        return self._finish(ids, [self.train_on_prompt or s >= cut for s, _ in offsets])

    def _finish(self, ids: list[int], trained: list[bool]) -> Example:
        """Text ends with EOS, trained: what the model must learn to emit when the text is done."""
        if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids, trained = ids + [self.eos_id], trained + [True]
        elif ids:
            trained[-1] = True
        return Example(np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool))

    def render(self, record: Record) -> Example:
        return self.chat(record.messages) if record.messages is not None else self.text(record.prompt, record.answer)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ByteRenderer:
    """Our presets read bytes: prompt/completion text and documents only (no template, no EOS)."""

    template_source = "none"
    eos_id = None

    def __init__(self, train_on_prompt: bool):
        self.train_on_prompt = train_on_prompt
        self.tok = ByteTokenizer()

    def render(self, record: Record) -> Example:
        if record.messages is not None:
            raise InputError("chat and instruction data need a Hugging Face model with a tokenizer and a chat "
                             "template (--model DIR); the presets read bytes")
        prompt = self.tok.encode(record.prompt).astype(np.int64)
        answer = self.tok.encode(record.answer or "").astype(np.int64)
        trained = np.concatenate([np.full(prompt.size, self.train_on_prompt or record.answer is None),
                                  np.ones(answer.size, dtype=bool)])
        return Example(np.concatenate([prompt, answer]), trained)


def renderer_for(model: str, chat_template: str | None, train_on_prompt: bool):
    if Path(model).is_dir():
        return ChatRenderer(model, chat_template, train_on_prompt)
    if chat_template:
        raise InputError("--chat-template needs a Hugging Face model directory (--model DIR) with a tokenizer")
    return ByteRenderer(train_on_prompt)
