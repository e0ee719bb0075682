"""Tokenizers: bytes for our presets, a Hugging Face model directory's own tokenizer otherwise.

A model directory is tokenized by its ``tokenizer.json`` (the ``tokenizers`` library), or, with only
a SentencePiece ``tokenizer.model``, by ``transformers``.  A Hugging Face model is never trained on
raw bytes without a word: a directory with no tokenizer says so in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mobius.boundary.checks import read_json_object
from mobius.boundary.errors import InputError, first_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, no unknowns, no download, no EOS."""

    vocab_size = 256
    eos_id: int | None = None
    name = "bytes"
    identity: tuple = ("bytes",)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# Subword tokenizers are handed text in pieces of at most this many characters: their memory grows
# with the text of one call (a 100 MiB single line made `tokenizers` allocate 5 GB and abort).
ENCODE_CHARS = 2**20


def pieces(text: str, most: int | None = None) -> list[str]:
    """``text`` cut into pieces of at most ``most`` characters, each cut before the last whitespace
    of its piece where there is one (tokenizers split words at whitespace anyway, so only a piece
    with no whitespace at all can change how its edge is tokenized)."""
    most = most or ENCODE_CHARS
    out, start = [], 0
    while len(text) - start > most:
        end = start + most
        cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
        end = cut if cut > start else end
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def _encode_in_pieces(encode_one, text: str) -> np.ndarray:
    if len(text) <= ENCODE_CHARS:
        return np.asarray(encode_one(text), dtype=np.int32)
    return np.concatenate([np.asarray(encode_one(piece), dtype=np.int32) for piece in pieces(text)])


def file_identity(path: Path) -> tuple:
    """What tells one tokenizer file from another, or from itself rewritten (as Python's bytecode
    cache tells sources): its path, size and modification time."""
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


class HFTokenizer:
    """A model directory's ``tokenizer.json``, through the ``tokenizers`` library (optional extra)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError(f"{path} needs the 'tokenizers' package: pip install 'mobius-train[hf]'") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise InputError(f"{path}: not a readable tokenizer.json ({first_line(err, 120)})") from None
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.name = f"{path.name} of {path.parent.name}"
        self.identity = file_identity(path)
        self.eos_id = _eos_id(path.parent, self.tokenizer.token_to_id, self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        if len(text) <= ENCODE_CHARS:
            return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        # As many pieces at a time as there are cores: `tokenizers` encodes a batch on all of them,
        # and memory stays bounded by the pieces of one batch.
        cut, at_once = pieces(text), max(1, os.cpu_count() or 1)
        return np.concatenate([np.asarray(e.ids, dtype=np.int32) for k in range(0, len(cut), at_once)
                               for e in self.tokenizer.encode_batch(cut[k:k + at_once], add_special_tokens=False)])

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens])


class SentencePieceTokenizer:
    """A directory with only ``tokenizer.model``: read by ``transformers`` (optional extra)."""

    def __init__(self, directory: Path):
        self.tokenizer = auto_tokenizer(directory, "its SentencePiece tokenizer.model")
        self.vocab_size = len(self.tokenizer)
        self.name = f"tokenizer.model of {directory.name}"
        self.identity = file_identity(directory / "tokenizer.model")
        self.eos_id = self.tokenizer.eos_token_id

    def encode(self, text: str) -> np.ndarray:
        return _encode_in_pieces(lambda piece: self.tokenizer(piece, add_special_tokens=False)["input_ids"], text)

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens])


def auto_tokenizer(directory: Path, what: str):
    """``transformers``' tokenizer of a local model directory (never the network)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError(f"{directory}: reading {what} needs 'transformers': pip install 'mobius-train[hf]'") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types for a directory it cannot read
        raise InputError(f"{directory}: transformers cannot read {what} ({first_line(err, 160)})") from None


def _eos_id(directory: Path, token_to_id, vocab_size: int) -> int | None:
    """The EOS of ``tokenizer_config.json`` (or ``generation_config.json``) as an id of this
    tokenizer's vocabulary, if it names one."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("generation_config.json", "eos_token_id")):
        f = directory / name
        if not f.is_file():
            continue
        value = read_json_object(f).get(key)
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, str):
            value = token_to_id(value)
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return None


def tokenizer_for(model: str) -> ByteTokenizer | HFTokenizer | SentencePieceTokenizer:
    """Bytes for a preset; a model directory's own tokenizer, or one line saying it has none."""
    directory = Path(model)
    if not directory.is_dir():
        return ByteTokenizer()
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory / "tokenizer.json")
    if (directory / "tokenizer.model").is_file():
        return SentencePieceTokenizer(directory)
    raise InputError(f"--model {model}: no tokenizer (tokenizer.json or tokenizer.model) in the directory; "
                     "copy the model's tokenizer files beside its config.json")
