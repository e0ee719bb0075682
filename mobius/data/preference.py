"""Preference pairs into packed rows, and the batches of a DPO run.

A pair is tokenized as TRL's ``DPOTrainer`` tokenizes it: the prompt alone (with the generation
prompt, for a conversation), the prompt followed by each answer (plain text gets the tokenizer's
EOS after the answer, as TRL adds it), and each answer is what follows the longest start the
prompt shares with both (TRL's ``common_prefix_length``).  The answer's tokens are trained; the
prompt's are not.

Both sides of a pair go into one row, as two examples (segments ``2k`` and ``2k + 1`` of the
row's ``k``-th pair), each attending only to itself: a micro-batch always holds whole pairs, and
the head that computes the loss has both sides (:mod:`mobius.models.preference`).  With packing
on, pairs fill ``--seq-len`` rows end to end; off, a row holds one pair.  Each side keeps its
first ``--seq-len / 2`` positions (TRL's ``max_length`` of ``--seq-len / 2 + 1`` tokens, its
``keep_start``); a pair whose answer that cuts away entirely is left out and counted (TRL drops
it), and with ``--no-truncate`` any cut is refused.

The reference model's log-probabilities of each row's pairs are a table beside the rows
(:meth:`PreferenceBatches.set_reference`), computed once, before training, in passes over every
row (:meth:`PreferenceBatches.reference_passes`), and kept by every checkpoint with the digest of
the rows it is of: a resume reads it (:func:`use_kept_references`) instead of computing it again.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import numpy as np
import torch

from mobius.boundary.errors import InputError
from mobius.data.corpus import Batch
from mobius.data.examples import ByteRenderer, ChatRenderer, Example, _common_prefix
from mobius.data.packing import ExampleBatches, Packed, packed_rows
from mobius.data.records import Pair
from mobius.metrics import Evaluation
from mobius.models.layout import IGNORE
from mobius.models.preference import PairLayout, PreferenceObjective, metric_sums, step_metrics


class PairRenderer:
    """Renders :class:`Pair` s as TRL does, with a model directory's tokenizer and chat template
    (or bytes, for our presets: plain text only, no EOS)."""

    def __init__(self, renderer: ChatRenderer | ByteRenderer):
        self.renderer = renderer
        self.template_source = renderer.template_source

    def _ids(self, text: str) -> list[int]:
        r = self.renderer
        if isinstance(r, ByteRenderer):
            return r.tok.encode(text).astype(np.int64).tolist()
        return list(r.tokenizer(text)["input_ids"])  # with the tokenizer's own special tokens, as TRL

    def _chat_ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        r = self.renderer
        if isinstance(r, ByteRenderer) or not r.has_template:
            raise InputError("conversational preference data needs a Hugging Face model with a chat template "
                             "(--model DIR, or --chat-template FILE)")
        return r._encode(r._render(messages, generation_prompt))[0]

    def render(self, pair: Pair) -> tuple[Example, Example]:
        if pair.conversational:
            prompt = self._chat_ids(pair.prompt, generation_prompt=True) if pair.prompt else []
            sides = [self._chat_ids(pair.prompt + answer) for answer in (pair.chosen, pair.rejected)]
        else:
            eos = getattr(getattr(self.renderer, "tokenizer", None), "eos_token", None) or ""
            prompt = self._ids(pair.prompt) if pair.prompt else []
            sides = [self._ids(pair.prompt + answer + ("" if answer.endswith(eos) else eos))
                     for answer in (pair.chosen, pair.rejected)]
        start = min(_common_prefix(prompt, s) for s in sides)
        out = []
        for ids in sides:
            if len(ids) <= start:
                raise InputError(f"{pair.where}: an answer adds no token to the prompt")
            trained = np.arange(len(ids)) >= start
            out.append(Example(np.asarray(ids, dtype=np.int64), trained))
        return out[0], out[1]


def pack_pairs(pairs: list[tuple[Example, Example]], seq_len: int, packing: bool, seed: int,
               truncate: bool = True, pad_id: int = 0) -> Packed:
    """Rows of whole pairs (see the module's docstring); ``lost_answers`` counts the pairs left out
    because truncation cut an answer away."""
    side_len = seq_len // 2
    order = np.random.default_rng([seed, 0x9a1]).permutation(len(pairs)) if packing else range(len(pairs))
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len
    truncated = lost = 0
    for i in order:
        sides = []
        for ex in pairs[i]:
            inputs, targets = ex.ids[:-1], np.where(ex.trained[1:], ex.ids[1:], IGNORE)
            if inputs.size > side_len:
                if not truncate:
                    raise InputError(f"pair {i} has an answer of {ex.ids.size} tokens with its prompt, more than "
                                     f"--seq-len {seq_len} / 2 + 1 (--no-truncate); raise --seq-len or drop "
                                     "--no-truncate to cut it")
                inputs, targets = inputs[:side_len], targets[:side_len]
            sides.append((inputs, targets))
        if any(not (t >= 0).any() for _, t in sides):
            lost += 1
            continue
        truncated += any(a.size < ex.ids.size - 1 for (a, _), ex in zip(sides, pairs[i]))
        size = sum(a.size for a, _ in sides)
        if not packing or used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].extend(sides)
        used += size
    if not rows:
        raise InputError(f"every one of the {len(pairs)} pairs lost its answers to truncation at --seq-len "
                         f"{seq_len} (half of it a side); raise --seq-len")
    return packed_rows(rows, seq_len, sum(len(r) // 2 for r in rows), truncated, lost, pad_id)


class PreferenceBatches(ExampleBatches):
    """The batches of a run on preference pairs: rows of whole pairs (see the module's docstring),
    each micro-batch's layout carrying its pairs (:class:`~mobius.models.preference.PairLayout`)
    and, once they are known, the reference's log-probabilities of them."""

    def __init__(self, packed: Packed, micro_batch_size: int, micro_batches: int, seed: int,
                 objective: PreferenceObjective, describe: str):
        super().__init__(packed, micro_batch_size, micro_batches, seed, True, describe)
        self.objective = objective
        segments = np.asarray(packed.segments, dtype=np.int64)
        self.row_pairs = (segments.max(axis=1) + 1) // 2  # pairs in each row
        self.pairs = int(self.row_pairs.sum())
        self.reference: np.ndarray | None = None  # (rows, most pairs in a row, 2) once computed

    def step(self, step: int) -> list[Batch]:
        idx = self.step_sequences(step)
        return self._micro_batches(idx, int(self.row_pairs[idx].sum()))

    def _micro_batches(self, idx: np.ndarray, step_pairs: int, reference: bool = True) -> list[Batch]:
        out, b = super()._micro_batches(idx, 1), self.micro_batch_size
        for k, mb in enumerate(out):
            rows = idx[k * b:(k + 1) * b]
            counts = [int(self.row_pairs[r]) if r >= 0 else 0 for r in rows]
            first = torch.tensor(np.cumsum([0] + counts[:-1]), dtype=torch.int64)[:, None]
            seg = mb.layout.segments
            sides = torch.where(seg >= 0, 2 * (first + seg // 2) + seg % 2, torch.full_like(seg, -1))
            table = None
            if reference and self.reference is not None:
                table = torch.from_numpy(np.concatenate(
                    [self.reference[r, :c] for r, c in zip(rows, counts)] or [np.zeros((0, 2), np.float32)]))
            mb.layout.pairs = PairLayout(sides, sum(counts), max(1, step_pairs), self.objective, table)
            mb.layout.loss_tokens = None
        return out

    def _pass_rows(self) -> list[np.ndarray]:
        """Every row in order, in passes of M micro-batches of B rows (the last filled with empty rows)."""
        per_pass = self.micro_batch_size * self.micro_batches
        order = np.arange(-(-self.sequences // per_pass) * per_pass)
        order = np.where(order < self.sequences, order, -1)
        return [order[a:a + per_pass] for a in range(0, order.size, per_pass)]

    def reference_passes(self) -> list[tuple[np.ndarray, list[Batch]]]:
        """Every row's pass (:meth:`_pass_rows`) with the rows it holds: what the reference pass
        computes (forward only, no reference)."""
        return [(rows, self._micro_batches(rows, self.pairs, reference=False)) for rows in self._pass_rows()]

    def compute_reference(self, forward: Callable[[list[Batch]], object],
                          all_reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        """The reference pass: ``forward`` runs each pass's micro-batches forward only with the
        initial weights; the rows whose heads ran in this process fill its table, and
        ``all_reduce`` (where several processes share the heads) sums the processes' tables."""
        if self.reference is not None:  # kept by the checkpoint this run resumes (use_kept_references)
            return
        logps = {}
        for rows, micro in self.reference_passes():
            forward(micro)
            logps.update(self.rows_of(rows, micro))
        table = torch.from_numpy(self.table_of(logps))
        if all_reduce is not None:
            all_reduce(table)
        self.set_reference(table.numpy())

    @functools.cached_property
    def _data_digest(self) -> bytes:
        digest = hashlib.sha256()  # the rows never change: hashed once, not at every checkpoint
        for a in (self.packed.tokens, self.packed.targets, self.packed.segments):
            digest.update(np.ascontiguousarray(a).tobytes())
        return digest.digest()

    def data_key(self) -> torch.Tensor:
        """The SHA-256 of the rows (tokens, targets, segments): which data a kept reference table is of."""
        return torch.frombuffer(bytearray(self._data_digest), dtype=torch.uint8)

    def rows_of(self, rows: np.ndarray, micro: list[Batch]) -> dict[int, np.ndarray]:
        """Each of ``rows``' pairs' log-probabilities, from its pass's micro-batches whose heads ran
        here (each (pairs, 2), in row order: ``layout.pairs.found``)."""
        out, b = {}, self.micro_batch_size
        for k, mb in enumerate(micro):
            if (values := mb.layout.pairs.found.get("logps")) is None:
                continue  # its head ran in another process
            values, at = values.float().cpu().numpy(), 0
            for r in rows[k * b:(k + 1) * b]:
                if r >= 0:
                    n = int(self.row_pairs[r])
                    out[int(r)] = np.asarray(values[at:at + n], dtype=np.float32)
                    at += n
        return out

    def table_of(self, logps: dict[int, np.ndarray]) -> np.ndarray:
        """The reference table with the rows of ``logps`` filled (each row's pairs' (pairs, 2)),
        zeros elsewhere: the processes of a run each fill the rows whose heads they ran, and their
        tables add up to the whole one."""
        table = np.zeros((self.sequences, max(1, int(self.row_pairs.max())), 2), dtype=np.float32)
        for r, values in logps.items():
            table[r, :values.shape[0]] = values
        return table

    def missing(self, table: np.ndarray) -> int:
        """How many pairs ``table`` (:meth:`table_of`'s shape) holds no log-probabilities of: a sum of
        log-probabilities is below zero, so a zero (or anything else) is a pair no pass reached."""
        if table.shape != (self.sequences, max(1, int(self.row_pairs.max())), 2):
            return self.pairs
        filled = np.arange(table.shape[1])[None, :] < self.row_pairs[:, None]
        return int((~(table[filled] < 0)).any(-1).sum())

    def set_reference(self, table: np.ndarray) -> None:
        """The reference's log-probabilities of every row's pairs (:meth:`table_of`)."""
        if missing := self.missing(table):
            raise RuntimeError(f"the reference pass left {missing} pairs without log-probabilities")
        self.reference = np.asarray(table, dtype=np.float32)



class PreferenceEvalBatches(PreferenceBatches):
    """Held-out pairs in order, in passes of M micro-batches of B rows; each micro-batch's loss
    is its share of the mean over every held-out pair, so the passes add up to the evaluation's
    loss.  The micro-batches handed out since :meth:`take_sums` last ran are kept, for the sums of
    the metrics their heads found here."""

    def __init__(self, packed: Packed, micro_batch_size: int, micro_batches: int, objective: PreferenceObjective,
                 describe: str):
        super().__init__(packed, micro_batch_size, micro_batches, 0, objective, describe)
        self.passes = len(self._pass_rows())
        self._handed: list[Batch] = []

    def pass_batches(self, k: int) -> list[Batch]:
        micro = self._micro_batches(self._pass_rows()[k], self.pairs)
        self._handed += micro
        return micro

    def take_sums(self) -> torch.Tensor:
        """The metrics' sums over the held-out micro-batches whose heads ran here since the last call."""
        sums, self._handed = metric_sums(self._handed), []
        return sums


REFERENCE_FILE = "reference.safetensors"  # a preference run's checkpoint file of its reference tables


def reference_files(train, held_out) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's file of a preference run's reference tables and the data each is of (nothing
    for other runs): a resume reads them instead of computing them again."""
    out = {}
    for name, source in (("train", train), ("held_out", held_out)):
        if isinstance(source, PreferenceBatches) and source.reference is not None:
            out[f"reference/{name}"] = torch.from_numpy(source.reference)
            out[f"reference/{name}.data"] = source.data_key()
    return {REFERENCE_FILE: out} if out else {}


def use_kept_references(train, held_out, checkpoint) -> list[str]:
    """The reference tables ``checkpoint`` (a resumed one, or None) kept, where they are of this
    run's rows: their reference pass is not run again.  Every process reads the same checkpoint, so
    every one skips the same passes.  Returns which were kept ("train", "held_out")."""
    kept = []
    for name, source in (("train", train), ("held_out", held_out)):
        if checkpoint is None or not isinstance(source, PreferenceBatches) or \
                f"reference/{name}" not in checkpoint.names():
            continue
        if source.reference is not None:  # already read from it (the launcher's call, in its process)
            kept.append(name)
            continue
        table = checkpoint.get(f"reference/{name}").float().numpy()
        if torch.equal(checkpoint.get(f"reference/{name}.data"), source.data_key()) and not source.missing(table):
            source.set_reference(table)  # else (other rows, or a table that is not one) computed again
            kept.append(name)
    return kept


def compute_references(train, held_out, forward: Callable[[list[Batch]], object],
                       all_reduce: Callable[[torch.Tensor], object] | None = None) -> bool:
    """A preference run's reference pass (:meth:`PreferenceBatches.compute_reference`) over its
    training and held-out pairs (those a resumed checkpoint did not keep); whether the run has
    pairs (no other run has)."""
    sources = [s for s in (train, held_out) if isinstance(s, PreferenceBatches)]
    for source in sources:
        source.compute_reference(forward, all_reduce)
    return bool(sources)


def prepare_references(train, held_out, checkpoint, forward: Callable[[list[Batch]], object],
                       all_reduce: Callable[[torch.Tensor], object] | None = None) -> bool:
    """A preference run's reference tables in a backend's workers, before ``checkpoint`` (a resumed
    one, or None) is restored: those it kept (:func:`use_kept_references`), the others computed by
    ``forward`` with the initial weights (:func:`compute_references`); whether the run has pairs."""
    use_kept_references(train, held_out, checkpoint)
    return compute_references(train, held_out, forward, all_reduce)


def held_out_sums(held_out) -> list[float]:
    """What a backend's evaluation reduces beside its loss: the held-out pairs' metric sums found
    here (none for held-out examples)."""
    return held_out.take_sums().tolist() if isinstance(held_out, PreferenceEvalBatches) else []


def evaluation_of(values: list[float], held_out) -> Evaluation:
    """The :class:`~mobius.metrics.Evaluation` of the reduced ``[loss, *held_out_sums]``."""
    pairs = isinstance(held_out, PreferenceEvalBatches)
    return Evaluation(float(values[0]), step_metrics(values[1:], held_out.pairs) if pairs else None)
