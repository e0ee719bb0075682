"""The run configuration: one typed dataclass, parsed from the DESIGN.md command line and checked
before anything expensive happens."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mobius.errors import InputError

BACKENDS = ("auto", "pipeline", "chunked", "single")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class RunConfig:
    topology: str = "auto"
    backend: str = "auto"
    model: str = "small"
    data: str | None = None
    steps: int = 40
    micro_batch_size: int = 4
    micro_batches: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    seed: int = 0
    precision: str | None = None  # None: bf16 on CUDA, fp32 on CPU
    metrics: str | None = None
    trace: str | None = None
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    stop_after: int | None = None
    export: str | None = None
    gpu_mem_gb: float | None = None
    cpu_workers: int = 2
    recompute: str = "auto"  # auto | on | off
    partitioner: str = "mip"
    stages: int | None = None  # force a stage count (uniform partition); None: the partitioner decides
    chunk_size: int | None = None  # chunked backend: elements per chunk (None: searched)
    rcache_blocks: int | None = None  # chunked backend: rCache blocks (None: searched)
    offload: str = "auto"  # chunked backend: auto (searched placement) | on (all chunks on the host) | off
    chunk_prefetch: bool = True  # chunked backend: gather the next layer's chunks while this one computes
    progress: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def add_model_and_batch_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``mobius.train`` and ``mobius.plan``."""
    d = RunConfig()
    p.add_argument("--topology", default=d.topology,
                   help="auto (probe this machine), a preset name, or a topology JSON file")
    p.add_argument("--model", default=d.model,
                   help="a preset (tiny, small, mobius-3b, gpt2, ...) or a Hugging Face directory (GPT-2, OPT, Llama)")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="compute precision (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="cap each device's memory (on CPU workers: the budget the runtime enforces)")
    p.add_argument("--cpu-workers", type=int, default=d.cpu_workers,
                   help="virtual workers of the CPU topology when no GPU is found")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default=d.recompute,
                   help="recompute stage activations in backward (auto: the plan's memory decides)")
    p.add_argument("--partitioner", choices=("mip", "min", "max", "uniform", "balanced"),
                   default=d.partitioner)
    p.add_argument("--stages", type=int, default=None,
                   help="force this many stages (uniform split) instead of the partitioner's choice")


def build_train_parser() -> argparse.ArgumentParser:
    d = RunConfig()
    p = OneLineParser(
        prog="python -m mobius.train",
        description="Fine-tune a language model with the Mobius pipeline (or the reference trainer).",
    )
    add_model_and_batch_args(p)
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="auto: chunked on NVLink topologies, else pipeline; single: plain PyTorch reference")
    p.add_argument("--data", default=None,
                   help="a text file or a directory of text files (default: this Python's stdlib sources)")
    p.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps of the run")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--metrics", default=None, help="write per-step metrics to this JSONL file")
    p.add_argument("--trace", default=None, help="write a Chrome trace (Perfetto) to this JSON file")
    p.add_argument("--save", default=None, help="checkpoint directory (written every --save-every steps and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end or on a stop)")
    p.add_argument("--resume", default=None, help="continue from this checkpoint (any backend or topology)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this run after K steps with a checkpoint, as a signal would (--steps stays the total)")
    p.add_argument("--export", default=None, help="write the fine-tuned model here as a Hugging Face directory")
    p.add_argument("--chunk-size", type=int, default=None, help="chunked backend: elements per chunk (default: searched)")
    p.add_argument("--rcache-blocks", type=int, default=None, help="chunked backend: rCache blocks (default: searched)")
    p.add_argument("--offload", choices=("auto", "on", "off"), default="auto",
                   help="chunked backend: keep chunks and their AdamW on the host (on), the device (off), or as searched")
    p.add_argument("--no-chunk-prefetch", dest="chunk_prefetch", action="store_false",
                   help="chunked backend: gather each chunk only when it is needed")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _check_writable_file(option: str, path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{option} {path}: not writable")


def validate(cfg: RunConfig) -> None:
    """Checks that need no model or data; the rest happen where the thing is loaded."""
    for name in ("steps", "micro_batch_size", "micro_batches", "seq_len", "cpu_workers"):
        if getattr(cfg, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if not cfg.lr > 0:
        raise InputError(f"--lr must be positive, got {cfg.lr}")
    if cfg.gpu_mem_gb is not None and not cfg.gpu_mem_gb > 0:
        raise InputError(f"--gpu-mem-gb must be positive, got {cfg.gpu_mem_gb}")
    for name in ("chunk_size", "rcache_blocks"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.stages is not None and cfg.stages <= 0:
        raise InputError(f"--stages must be positive, got {cfg.stages}")
    if cfg.save_every < 0:
        raise InputError(f"--save-every must be positive, got {cfg.save_every}")
    if cfg.stop_after is not None and cfg.stop_after <= 0:
        raise InputError(f"--stop-after must be positive, got {cfg.stop_after}")
    if cfg.save_every and not cfg.save:
        raise InputError("--save-every needs --save DIR")
    if cfg.save:
        parent = Path(cfg.save).resolve().parent
        if not parent.is_dir():
            raise InputError(f"--save {cfg.save}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise InputError(f"--save {cfg.save}: not writable")
        target = Path(cfg.save)
        if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / "manifest.json").exists())):
            raise InputError(f"--save {cfg.save}: exists and is not a Mobius checkpoint; refusing to replace it")
    _check_writable_file("--metrics", cfg.metrics)
    _check_writable_file("--trace", cfg.trace)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise InputError(f"--data {cfg.data}: no such file or directory")


def parse_train_args(argv: list[str] | None = None) -> RunConfig:
    args = build_train_parser().parse_args(argv)
    cfg = RunConfig.from_dict(vars(args))
    validate(cfg)
    return cfg
