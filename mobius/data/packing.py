"""Examples into fixed-length sequences, and the batches of each optimizer step.

An example of ``L`` tokens is ``L - 1`` (input, target) pairs: the target of position ``i`` is
token ``i + 1``, trained when that token is part of an answer.  The last token of an example
never predicts the first of the next one.

* ``packing`` on: examples (in a seeded order) fill ``--seq-len`` sequences end to end, the rest of
  a sequence is padding; positions restart at 0 for each example and each sees only itself
  (:class:`~mobius.models.layout.TokenLayout`).
* ``packing`` off: one example per sequence, padded.  Padding comes after the example, so plain
  causal attention is already exact.

Padding and prompts have target :data:`~mobius.models.layout.IGNORE`.  Step ``k`` takes the next
``M x B`` sequences of a seeded order that is reshuffled every epoch: a pure function of
``(seed, k)``, like the text windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mobius.boundary.errors import InputError
from mobius.data.corpus import Batch, smallest_ids
from mobius.data.examples import Example
from mobius.models.layout import IGNORE, TokenLayout


@dataclass
class Packed:
    tokens: np.ndarray  # (N, T)
    targets: np.ndarray  # (N, T)
    positions: np.ndarray  # (N, T)
    segments: np.ndarray  # (N, T): example index within its sequence, -1 for padding
    examples: int
    truncated: int  # examples cut to fit --seq-len
    lost_answers: int = 0  # of those, examples whose every trained token was cut away

    ARRAYS = ("tokens", "targets", "positions", "segments")

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, a).nbytes for a in self.ARRAYS)


def pack(examples: list[Example], seq_len: int, packing: bool, seed: int, truncate: bool = True,
         pad_id: int = 0) -> Packed:
    order = np.random.default_rng([seed, 0x9ac]).permutation(len(examples)) if packing else range(len(examples))
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len  # tokens in the current row (start with "full": the first example opens a row)
    truncated = lost_answers = 0
    for i in order:
        ex = examples[i]
        if ex.ids.size < 2:
            continue  # nothing to predict
        inputs = ex.ids[:-1]
        targets = np.where(ex.trained[1:], ex.ids[1:], IGNORE)
        if inputs.size > seq_len:
            if not truncate:
                raise InputError(f"example {i} has {ex.ids.size} tokens, more than --seq-len {seq_len} + 1 "
                                 "(--no-truncate); raise --seq-len or drop --no-truncate to cut it")
            lost_answers += bool((targets >= 0).any()) and not bool((targets[:seq_len] >= 0).any())
            inputs, targets = inputs[:seq_len], targets[:seq_len]
            truncated += 1
        if not packing or used + inputs.size > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((inputs, targets))
        used += inputs.size
    if not rows:
        raise InputError("the data has no example of at least 2 tokens")
    return packed_rows(rows, seq_len, sum(len(r) for r in rows), truncated, lost_answers, pad_id)


def packed_rows(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, examples: int, truncated: int,
                lost_answers: int = 0, pad_id: int = 0) -> Packed:
    """``rows`` of (inputs, targets) examples laid end to end in ``seq_len`` sequences, each example
    a segment of its row with positions from 0; padding after them."""
    n = len(rows)
    out = Packed(np.full((n, seq_len), pad_id, dtype=np.int64), np.full((n, seq_len), IGNORE, dtype=np.int64),
                 np.zeros((n, seq_len), dtype=np.int64), np.full((n, seq_len), -1, dtype=np.int64),
                 examples, truncated, lost_answers)
    for r, row in enumerate(rows):
        at = 0
        for e, (inputs, targets) in enumerate(row):
            span = slice(at, at + inputs.size)
            out.tokens[r, span], out.targets[r, span] = inputs, targets
            out.positions[r, span], out.segments[r, span] = np.arange(inputs.size), e
            at += inputs.size
    for a in Packed.ARRAYS:  # each process holds them: the smallest type each needs, not int64
        setattr(out, a, smallest_ids(getattr(out, a)))
    return out


def _longest(segments: np.ndarray) -> int:
    """The columns up to the last that holds a token in any of these rows (at least one)."""
    used = (segments >= 0).any(axis=0).nonzero()[0]
    return int(used[-1]) + 1 if used.size else 1


def _columns(array: np.ndarray, rows: np.ndarray, width: int) -> torch.Tensor:
    """``array``'s ``rows``, their first ``width`` columns: a copy, never the mapping."""
    return torch.from_numpy(array[rows, :width].astype(np.int64))


class ExampleBatches:
    """The batches of a run on examples (instruction, chat, prompt/completion, or documents).

    The packed arrays stay NumPy arrays (memory-mapped in the workers, :mod:`mobius.data.shared`);
    only a step's rows become int64 tensors."""

    def __init__(self, packed: Packed, micro_batch_size: int, micro_batches: int, seed: int, packing: bool,
                 describe: str):
        self.packed = packed
        self.seq_len = packed.tokens.shape[1]
        self.micro_batch_size, self.micro_batches, self.seed = micro_batch_size, micro_batches, seed
        self.packing = packing
        self.balance_micro_batches = micro_batches  # a mean over micro-batches (the load-balancing loss) over these
        self._describe = describe
        self._epoch_order: tuple[int, np.ndarray | None] = (-1, None)

    def host_bytes(self) -> int:
        """What this source holds in memory (each process that trains holds its own)."""
        return self.packed.nbytes

    @property
    def sequences(self) -> int:
        return self.packed.tokens.shape[0]

    def step_sequences(self, step: int) -> np.ndarray:
        """Indices of the sequences step ``step`` trains on: the next M x B of an order reshuffled per epoch."""
        per_step, n = self.micro_batch_size * self.micro_batches, self.sequences
        first = step * per_step
        return np.asarray([self._order(at // n)[at % n] for at in range(first, first + per_step)])

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch, 0xe90c]).permutation(self.sequences))
        return self._epoch_order[1]

    def step_tokens(self, step: int) -> int:
        """The tokens of examples step ``step`` computes, its padding left out (tokens/s counts these,
        as TRL's num_tokens counts the attention mask's)."""
        return int((self.packed.segments[self.step_sequences(step)] >= 0).sum())

    def step(self, step: int) -> list[Batch]:
        idx = self.step_sequences(step)
        return self._micro_batches(idx, int((self.packed.targets[idx] != IGNORE).sum()))

    def _micro_batches(self, idx: np.ndarray, loss_tokens: int) -> list[Batch]:
        """Sequences ``idx`` as micro-batches; index -1 is an empty sequence (all padding).  Without
        packing each micro-batch is as wide as its longest example, as Hugging Face's collators pad:
        the columns of padding every sequence ends with are left out (exact: padding comes last, and
        no token attends to it or trains on it).  Packed rows keep ``--seq-len``: they are nearly
        full, and every micro-batch of a run then has one shape."""
        p, b, out = self.packed, self.micro_batch_size, []
        for a in range(0, idx.size, b):
            rows, blank = np.maximum(idx[a:a + b], 0), torch.from_numpy(idx[a:a + b] < 0)[:, None]
            width = p.tokens.shape[1] if self.packing else _longest(p.segments[rows][~blank.numpy()[:, 0]])
            segments = _columns(p.segments, rows, width)
            real = (segments >= 0) & ~blank
            layout = TokenLayout(targets=_columns(p.targets, rows, width).masked_fill(blank, IGNORE),
                                 loss_tokens=max(1, loss_tokens), real=None if bool(real.all()) else real,
                                 balance_share=1 / self.balance_micro_batches)
            if self.packing:
                layout.positions = _columns(p.positions, rows, width)
                layout.segments = segments
            out.append(Batch(_columns(p.tokens, rows, width), layout))
        return out

    def epochs(self, steps: int) -> float:
        return steps * self.micro_batch_size * self.micro_batches / self.sequences

    def describe(self) -> str:
        return self._describe


class EvalBatches(ExampleBatches):
    """Held-out examples in order, in passes of M micro-batches of B sequences (the last pass filled
    with empty sequences); each micro-batch's loss is its share of the mean over every held-out
    trained token, so a worker's passes add up to the evaluation loss."""

    def __init__(self, packed: Packed, micro_batch_size: int, micro_batches: int, packing: bool, describe: str):
        super().__init__(packed, micro_batch_size, micro_batches, 0, packing, describe)
        self.trained = int((packed.targets != IGNORE).sum())
        self.balance_micro_batches = -(-self.sequences // micro_batch_size)  # every pass's that hold examples
        per_pass = micro_batch_size * micro_batches
        self.passes = -(-self.sequences // per_pass)
        order = np.arange(self.passes * per_pass)
        self._order_of_pass = np.where(order < self.sequences, order, -1).reshape(self.passes, per_pass)

    def pass_batches(self, k: int) -> list[Batch]:
        return self._micro_batches(self._order_of_pass[k], self.trained)
