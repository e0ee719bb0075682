"""Text as one corpus cut into random windows (continued pre-training, and the default run on the
standard library's sources), and the :class:`Batch` every backend consumes.

Batches depend only on ``(seed, step)``: every backend, every worker and a resumed run draw the
same sequences for the same step, with no loader state to carry around.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mobius.boundary.errors import InputError
from mobius.data.records import read_examples
from mobius.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer
from mobius.models.layout import TokenLayout

Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer

# The default corpus is capped so start-up stays quick; it is still megabytes of real text.
DEFAULT_CORPUS_BYTES = 16 * 2**20


@functools.cache
def stdlib_corpus_files() -> tuple[Path, ...]:
    """The running Python's standard-library ``.py`` files: real text on every machine (found
    once per process: the walk of the tree costs more than reading what the run needs)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        # Pruned, not filtered: the installed packages are most of the tree (walking them cost
        # 0.4 s of every default run's start).
        subfolders[:] = [s for s in subfolders if s != "site-packages"]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return tuple(sorted(files))


def _stdlib_text(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for f in stdlib_corpus_files():
        raw = f.read_bytes()
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


# The default corpus of the last tokenizer, by its identity: a process that builds several runs' data
# (a run and the reference it is checked against, a replan's next plan) tokenizes it once, which
# through a subword tokenizer takes seconds.
_DEFAULT_CORPORA: dict[tuple, np.ndarray] = {}


def load_corpus(data: str | os.PathLike | None, max_bytes: int | None = None,
                tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids of the documents of ``data`` (the standard library's sources when None), joined
    by the tokenizer's EOS (blank lines for bytes), in the smallest integer type that holds them."""
    tokenizer = tokenizer or ByteTokenizer()
    if data is None:
        # Subword tokenizing is ~100x slower than taking bytes: a smaller default sample.
        max_bytes = max_bytes or (DEFAULT_CORPUS_BYTES if isinstance(tokenizer, ByteTokenizer) else 2 * 2**20)
        key = (tokenizer.identity, max_bytes)
        if key not in _DEFAULT_CORPORA:
            corpus = corpus_of([_stdlib_text(max_bytes).decode("utf-8", errors="replace")], tokenizer,
                               "the standard library")
            corpus.flags.writeable = False  # shared by every run of this process that reads it
            _DEFAULT_CORPORA.clear()  # one kept: a process switches tokenizers rarely
            _DEFAULT_CORPORA[key] = corpus
        return _DEFAULT_CORPORA[key]
    records, fmt = read_examples(data)
    if fmt != "text":
        raise InputError(f"--data {data}: {fmt} records are examples, not a text corpus")
    corpus = corpus_of([r.prompt for r in records], tokenizer, str(data))
    return corpus[:max_bytes] if max_bytes is not None else corpus


def smallest_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` in the smallest integer type that holds them (bytes: 1 byte a token; a 50k or 65k
    vocabulary: 2; larger: 4; signed where they go below 0): every worker holds the corpus, an
    eighth of it as int64."""
    low, top = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    for dtype in ((np.uint8, np.uint16, np.uint32, np.uint64) if low >= 0 else (np.int8, np.int16, np.int32)):
        if np.iinfo(dtype).min <= low and top <= np.iinfo(dtype).max:
            return ids.astype(dtype, copy=False)
    return ids.astype(np.int64, copy=False)


def corpus_of(texts: list[str], tokenizer: Tokenizer, source: str) -> np.ndarray:
    """Documents as one token stream, joined by the tokenizer's EOS (blank lines for bytes)."""
    if isinstance(tokenizer, ByteTokenizer) or tokenizer.eos_id is None:
        corpus = tokenizer.encode("\n\n".join(texts))
    else:
        corpus = np.concatenate([np.append(tokenizer.encode(t), tokenizer.eos_id) for t in texts])
    if corpus.size == 0:
        raise InputError(f"--data {source}: no text found (empty)")
    return smallest_ids(corpus)


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) int64
    layout: TokenLayout  # targets (next tokens, IGNORE where untrained), positions and examples

    @property
    def targets(self) -> torch.Tensor:
        return self.layout.targets


class BatchSource:
    """Random windows of the corpus; step ``k``'s batch is a pure function of ``(seed, k)``."""

    def __init__(self, corpus: np.ndarray, seq_len: int, micro_batch_size: int, micro_batches: int, seed: int,
                 tokenizer_name: str = "bytes"):
        if corpus.size < seq_len + 2:
            raise InputError(f"the data has {corpus.size} tokens, fewer than --seq-len {seq_len} + 2")
        self.corpus = corpus  # its smallest type; a step's windows become int64
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.seed = seed
        self.tokenizer_name = tokenizer_name

    def step_tokens(self, step: int) -> int:
        """The tokens step ``step`` computes (windows hold no padding: every one)."""
        return self.micro_batches * self.micro_batch_size * self.seq_len

    def step(self, step: int) -> list[Batch]:
        """The ``micro_batches`` micro-batches of optimizer step ``step``."""
        rng = np.random.default_rng([self.seed, step])
        n = self.micro_batch_size * self.micro_batches
        starts = rng.integers(0, self.corpus.size - self.seq_len - 1, size=n)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        windows = torch.from_numpy(self.corpus[idx].astype(np.int64))
        b = self.micro_batch_size
        return [Batch(windows[i : i + b, :-1].contiguous(),
                      TokenLayout(targets=windows[i : i + b, 1:].contiguous(), loss_tokens=n * self.seq_len,
                                  every_target_trained=True, balance_share=1 / self.micro_batches))
                for i in range(0, n, b)]

    def host_bytes(self) -> int:
        """What this source holds in memory (each process that trains holds its own)."""
        return self.corpus.nbytes

    def epochs(self, steps: int) -> float:
        return steps * self.micro_batch_size * self.micro_batches * self.seq_len / self.corpus.size

    def describe(self) -> str:
        return f"{self.corpus.size:,} tokens of text in random windows; tokenizer {self.tokenizer_name}"
