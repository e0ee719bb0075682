"""``python -m mobius.train``: the command our users type.

Resolves the topology, chooses the backend, checks the input, then either trains in this process
(``--backend single``) or launches one pipeline worker per device.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from mobius.config import RunConfig, parse_train_args
from mobius.data import BatchSource, load_corpus, tokenizer_for
from mobius.errors import InputError, exits_cleanly
from mobius.metrics import MetricsWriter, StepMetrics
from mobius.models import GPTConfig, get_config


def check_model_input(cfg: RunConfig) -> GPTConfig:
    model_config = get_config(cfg.model)
    if cfg.seq_len > model_config.context:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s context of {model_config.context}")
    if model_config.hf_arch and not model_config.checkpoint:
        raise InputError(f"--model {cfg.model} has config.json but no *.safetensors weights: it can be planned "
                         "(python -m mobius.plan) but not trained")
    if not model_config.runnable:
        raise InputError(f"model {cfg.model} can be planned (python -m mobius.plan) but not run: "
                         f"{model_config.hidden} hidden is not divisible by {model_config.heads} heads")
    return model_config


def make_batches(cfg: RunConfig, model_config: GPTConfig) -> BatchSource:
    tokenizer = tokenizer_for(cfg.model)
    corpus = load_corpus(cfg.data, tokenizer=tokenizer)
    if model_config.vocab_size < tokenizer.vocab_size and int(corpus.max()) >= model_config.vocab_size:
        raise InputError(f"model {cfg.model} has a vocabulary of {model_config.vocab_size}, but the data has token "
                         f"id {int(corpus.max())} ({type(tokenizer).__name__})")
    return BatchSource(corpus, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batches, cfg.seed)


def run_steps(cfg: RunConfig, step_fn: Callable[[int], StepMetrics], header: str) -> list[StepMetrics]:
    """Drive ``step_fn`` over the run's steps with a progress bar, metrics file and summary."""
    from tqdm import tqdm

    print(header, flush=True)
    writer = MetricsWriter(cfg.metrics)
    history: list[StepMetrics] = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not cfg.progress, unit="step", dynamic_ncols=True, file=sys.stdout)
    try:
        for step in bar:
            m = step_fn(step)
            history.append(m)
            writer.write(m)
            bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens / max(m.step_time_s, 1e-9):.0f}")
    finally:
        bar.close()
        writer.close()
    wall = time.perf_counter() - t0
    tokens = sum(m.tokens for m in history)
    peak = max(m.peak_device_bytes for m in history)
    print(f"done: {len(history)} steps, loss {history[0].loss:.4f} -> {history[-1].loss:.4f}, "
          f"{tokens / wall:.0f} tokens/s, wall {wall:.1f} s, peak device memory {peak / 2**20:.1f} MiB",
          flush=True)
    return history


def train_single(cfg: RunConfig, model_config: GPTConfig) -> list[StepMetrics]:
    from mobius.reference import ReferenceTrainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg.precision = cfg.precision or ("bf16" if device.type == "cuda" else "fp32")
    trainer = ReferenceTrainer(cfg, model_config, make_batches(cfg, model_config), device)
    n = trainer.model.num_parameters()
    header = (f"mobius: backend single on {device}, model {cfg.model} ({n / 1e6:.1f}M parameters), "
              f"{cfg.micro_batches}x{cfg.micro_batch_size} sequences of {cfg.seq_len} per step, {cfg.precision}")
    history = run_steps(cfg, trainer.step, header)
    if cfg.export:
        from mobius.models.hf import finalize_export, start_export, write_shard

        staging = start_export(cfg.export)
        layers = {i: dict(layer.named_parameters()) for i, layer in enumerate(trainer.model.layers)}
        write_shard(model_config, staging, "all", layers)
        finalize_export(model_config, staging, cfg.export)
        print(f"exported to {cfg.export}", flush=True)
    return history


def run(cfg: RunConfig) -> list[StepMetrics] | None:
    model_config = check_model_input(cfg)
    if cfg.export:
        from mobius.models.hf import check_export_target

        check_export_target(model_config, cfg.export)
    from mobius.backend import resolve_backend

    backend, topo = resolve_backend(cfg)
    if backend == "single":
        return train_single(cfg, model_config)
    from mobius.launcher import launch_pipeline

    return launch_pipeline(cfg, model_config, topo)


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_args(argv)
    from mobius.launcher import running_under_torchrun

    if running_under_torchrun() and cfg.backend != "single":
        # Started by torchrun (e.g. multi-node): this process is one worker.
        from mobius.stages.worker import worker_main

        worker_main({"cfg": cfg.to_dict(), "plan": None, "header": "mobius: pipeline worker (torchrun)",
                     "budget_bytes": None})
        return
    run(cfg)


if __name__ == "__main__":
    main()
