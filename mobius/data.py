"""Training data: a byte-level tokenizer, the corpus, and deterministic batches.

Batches depend only on ``(seed, step)``: every backend, every worker and a resumed run draw the
same sequences for the same step, with no loader state to carry around.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mobius.errors import InputError

# The default corpus is capped so start-up stays quick; it is still megabytes of real text.
DEFAULT_CORPUS_BYTES = 16 * 2**20


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, no unknowns, no download."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


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
            raise InputError(f"{path}: not a readable tokenizer.json ({str(err).splitlines()[0][:120]})") from None
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens])


def tokenizer_for(model: str) -> ByteTokenizer | HFTokenizer:
    """The model directory's tokenizer when it has ``tokenizer.json``, else bytes."""
    path = Path(model) / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else ByteTokenizer()


def _read_text(f: Path) -> bytes:
    """A file's text; a ``.jsonl`` file contributes the ``text`` field of each line."""
    try:
        raw = f.read_bytes()
    except OSError as err:
        raise InputError(f"--data: cannot read {f}: {err.strerror}") from None
    if f.suffix != ".jsonl":
        return raw
    texts = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"--data {f}: line {n} is not a JSON object with a 'text' field") from None
        if not isinstance(text, str):
            raise InputError(f"--data {f}: line {n}: 'text' must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n\n".join(texts).encode("utf-8")


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    raise InputError(f"--data {path}: no such file or directory")


def stdlib_corpus_files() -> list[Path]:
    """The running Python's standard-library ``.py`` files: real text on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def load_corpus(data: str | os.PathLike | None, max_bytes: int | None = None,
                tokenizer: ByteTokenizer | HFTokenizer | None = None) -> np.ndarray:
    """Token ids of ``data`` (or of the standard library when None): uint8 bytes by default,
    int32 ids with a model's tokenizer."""
    tokenizer = tokenizer or ByteTokenizer()
    if data is None:
        files = stdlib_corpus_files()
        # Subword tokenizing is ~100x slower than taking bytes: a smaller default sample.
        max_bytes = max_bytes or (DEFAULT_CORPUS_BYTES if isinstance(tokenizer, ByteTokenizer) else 2 * 2**20)
        source = "the standard library"
    else:
        files = _text_files(Path(data))
        source = str(data)
    chunks, total = [], 0
    for f in files:
        raw = _read_text(f)
        chunks.append(raw)
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    if corpus.size == 0:
        raise InputError(f"--data {source}: no text found (empty)")
    if not isinstance(tokenizer, ByteTokenizer):
        corpus = tokenizer.encode(corpus.tobytes().decode("utf-8", errors="replace"))
    return corpus


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64: tokens shifted by one


class BatchSource:
    """Random windows of the corpus; step ``k``'s batch is a pure function of ``(seed, k)``."""

    def __init__(self, corpus: np.ndarray, seq_len: int, micro_batch_size: int, micro_batches: int, seed: int):
        if corpus.size < seq_len + 2:
            raise InputError(f"the data has {corpus.size} tokens, fewer than --seq-len {seq_len} + 2")
        self.corpus = torch.from_numpy(corpus.astype(np.int64))
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.seed = seed

    def step(self, step: int) -> list[Batch]:
        """The ``micro_batches`` micro-batches of optimizer step ``step``."""
        rng = np.random.default_rng([self.seed, step])
        n = self.micro_batch_size * self.micro_batches
        starts = torch.from_numpy(rng.integers(0, self.corpus.numel() - self.seq_len - 1, size=n))
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        windows = self.corpus[idx]
        b = self.micro_batch_size
        return [
            Batch(windows[i : i + b, :-1].contiguous(), windows[i : i + b, 1:].contiguous())
            for i in range(0, n, b)
        ]
