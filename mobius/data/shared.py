"""A run's tokenized data, made once and mapped by every worker.

The launching process reads, renders, tokenizes and packs the data once (it has to, to check it
before any worker starts) and writes the resulting arrays as ``.npy`` files into the run's scratch
directory.  Each worker maps them read-only (``np.load(mmap_mode="r")``) instead of reading and
tokenizing the data again: start-up does not repeat the tokenizer's work per worker, and the pages
are the operating system's to share, so a large corpus is held once per host, not once per process.
A step's rows are copied out of the mapping as int64 tensors; the mapping itself is never written.
"""

from __future__ import annotations

from dataclasses import asdict

from pathlib import Path

import numpy as np

from mobius.data.corpus import BatchSource
from mobius.data.packing import EvalBatches, ExampleBatches, Packed
from mobius.data.preference import PreferenceBatches, PreferenceEvalBatches
from mobius.models.preference import PreferenceObjective

Source = BatchSource | ExampleBatches | EvalBatches


def share(train: BatchSource | ExampleBatches, held_out: EvalBatches | None, directory: str | Path) -> dict:
    """Write the arrays of ``train`` and ``held_out`` under ``directory``; returns what
    :func:`open_shared` needs (plain data, for a worker's payload)."""
    directory = Path(directory)
    return {"train": _write(train, directory / "train"),
            "held_out": None if held_out is None else _write(held_out, directory / "held_out")}


def open_shared(shared: dict) -> tuple[BatchSource | ExampleBatches, EvalBatches | None]:
    """The training batches and held-out examples :func:`share` wrote, memory-mapped."""
    return _read(shared["train"]), None if shared["held_out"] is None else _read(shared["held_out"])


def _write(source: Source, prefix: Path) -> dict:
    if isinstance(source, BatchSource):
        np.save(f"{prefix}-corpus.npy", source.corpus)
        return {"kind": "windows", "prefix": str(prefix), "seq_len": source.seq_len,
                "micro_batch_size": source.micro_batch_size, "micro_batches": source.micro_batches,
                "seed": source.seed, "tokenizer_name": source.tokenizer_name}
    for name in Packed.ARRAYS:
        np.save(f"{prefix}-{name}.npy", getattr(source.packed, name))
    kind = "eval" if isinstance(source, EvalBatches) else "eval_pairs" if isinstance(source, PreferenceEvalBatches) \
        else "pairs" if isinstance(source, PreferenceBatches) else "examples"
    return {"kind": kind, "prefix": str(prefix),
            "examples": source.packed.examples, "truncated": source.packed.truncated,
            "micro_batch_size": source.micro_batch_size, "micro_batches": source.micro_batches,
            "seed": source.seed, "packing": source.packing, "describe": source.describe(),
            **({"objective": asdict(source.objective)} if kind in ("pairs", "eval_pairs") else {})}


def _mapped(prefix: str, name: str) -> np.ndarray:
    return np.load(f"{prefix}-{name}.npy", mmap_mode="r", allow_pickle=False)


def _read(entry: dict) -> Source:
    prefix = entry["prefix"]
    if entry["kind"] == "windows":
        return BatchSource(_mapped(prefix, "corpus"), entry["seq_len"], entry["micro_batch_size"],
                           entry["micro_batches"], entry["seed"], entry["tokenizer_name"])
    arrays = {name: _mapped(prefix, name) for name in Packed.ARRAYS}
    packed = Packed(**arrays, examples=entry["examples"], truncated=entry["truncated"])
    if entry["kind"] == "eval_pairs":
        return PreferenceEvalBatches(packed, entry["micro_batch_size"], entry["micro_batches"],
                                     PreferenceObjective(**entry["objective"]), entry["describe"])
    if entry["kind"] == "pairs":
        return PreferenceBatches(packed, entry["micro_batch_size"], entry["micro_batches"], entry["seed"],
                                 PreferenceObjective(**entry["objective"]), entry["describe"])
    if entry["kind"] == "eval":
        return EvalBatches(packed, entry["micro_batch_size"], entry["micro_batches"], entry["packing"],
                           entry["describe"])
    return ExampleBatches(packed, entry["micro_batch_size"], entry["micro_batches"], entry["seed"],
                          entry["packing"], entry["describe"])
