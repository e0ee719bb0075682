"""Training data: a byte-level tokenizer, the corpus, and deterministic batches.

Batches depend only on ``(seed, step)``: every backend, every worker and a resumed run draw the
same sequences for the same step, with no loader state to carry around.
"""

from __future__ import annotations

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


def load_corpus(data: str | os.PathLike | None, max_bytes: int | None = None) -> np.ndarray:
    """Token ids (uint8 bytes) of ``data``, or of the standard library when ``data`` is None."""
    if data is None:
        files = stdlib_corpus_files()
        max_bytes = max_bytes or DEFAULT_CORPUS_BYTES
        source = "the standard library"
    else:
        files = _text_files(Path(data))
        source = str(data)
    chunks, total = [], 0
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as err:
            raise InputError(f"--data: cannot read {f}: {err.strerror}") from None
        chunks.append(raw)
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    if corpus.size == 0:
        raise InputError(f"--data {source}: no text found (empty)")
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
