"""``python -m mobius.train``: the command our users type.

Resolves the topology, chooses the backend, checks the input, then either trains in this process
(``--backend single``) or launches one pipeline worker per device.
"""

from __future__ import annotations

from mobius.errors import quiet_interrupts_while_importing

if __name__ == "__main__":
    quiet_interrupts_while_importing()

# The imports below take seconds; the guard above must come first.
# ruff: noqa: E402
import math
import sys
import time
from typing import Callable

import torch

from mobius import checkpoint as ck
from mobius import ownership
from mobius.config import RunConfig, parse_train_args
from mobius.data import BatchSource, load_corpus, tokenizer_for
from mobius.errors import InputError, RunError, exits_cleanly
from mobius.metrics import (
    MetricsWriter,
    StepMetrics,
    is_metrics_file,
    is_trace_file,
    write_trace,
)
from mobius.models import GPTConfig, get_config
from mobius.runtime.device import cuda_available
from mobius.signals import StopRequest


def check_model_input(cfg: RunConfig) -> GPTConfig:
    model_config = get_config(cfg.model)
    if cfg.seq_len > model_config.context:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s context of {model_config.context}")
    if model_config.hf_arch and not model_config.checkpoint:
        raise InputError(f"--model {cfg.model} has config.json but no *.safetensors weights: it can be planned "
                         "(python -m mobius.plan) but not trained")
    if not model_config.runnable:
        raise InputError(f"model {cfg.model} can be planned (python -m mobius.plan) but not run: "
                         f"{model_config.shape_problem()}")
    if model_config.checkpoint:
        from mobius.models.hf import check_weights

        check_weights(model_config)
    return model_config


def check_outputs(cfg: RunConfig, model_config: GPTConfig) -> None:
    """Before the first step: every path the run writes is free or provably ours, and none of
    them is an input or another output."""
    ownership.check_paths({"--data": cfg.data, "--model": model_config.checkpoint, "--resume": cfg.resume},
                          {"--metrics": (cfg.metrics, "file"), "--trace": (cfg.trace, "file"),
                           "--save": (cfg.save, "dir"), "--export": (cfg.export, "dir")})
    ownership.check_output_file("--metrics", cfg.metrics, is_metrics_file)
    ownership.check_output_file("--trace", cfg.trace, is_trace_file)
    ck.check_save_target(cfg)
    if cfg.export:
        from mobius.models.hf import check_export_target

        check_export_target(model_config, cfg.export)


def make_batches(cfg: RunConfig, model_config: GPTConfig) -> BatchSource:
    tokenizer = tokenizer_for(cfg.model)
    corpus = load_corpus(cfg.data, tokenizer=tokenizer)
    if model_config.vocab_size < tokenizer.vocab_size and int(corpus.max()) >= model_config.vocab_size:
        raise InputError(f"model {cfg.model} has a vocabulary of {model_config.vocab_size}, but the data has token "
                         f"id {int(corpus.max())} ({type(tokenizer).__name__})")
    return BatchSource(corpus, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batches, cfg.seed)


def run_steps(cfg: RunConfig, step_fn: Callable[[int], StepMetrics], header: str, start_step: int = 0,
              save_fn: Callable[[int], None] | None = None, stop: StopRequest | None = None,
              agree: Callable[[bool, bool], tuple[bool, bool]] | None = None, main: bool = True) -> list[StepMetrics]:
    """Drive ``step_fn`` from ``start_step`` to ``cfg.steps`` with a progress bar, the metrics file,
    checkpoints (``--save-every``, ``--stop-after``, a signal, the end) and a summary.

    ``agree`` makes every pipeline worker take the same stop/save decision; only ``main`` prints.
    """
    from tqdm import tqdm

    if main:
        print(header, flush=True)
    writer = MetricsWriter(cfg.metrics if main else None, append=start_step > 0)
    history: list[StepMetrics] = []
    t0 = time.perf_counter()
    bar = tqdm(range(start_step, cfg.steps), disable=not (cfg.progress and main), unit="step", dynamic_ncols=True,
               file=sys.stdout, initial=start_step, total=cfg.steps)
    stopped_at = None
    try:
        for step in bar:
            m = step_fn(step)
            if not math.isfinite(m.loss) and cfg.precision != "fp16":
                where = f"; the last checkpoint in {cfg.save} is kept" if cfg.save else ""
                raise RunError(f"loss is {m.loss} at step {step}: stopping ({cfg.precision}){where}")
            history.append(m)
            writer.write(m)
            bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens / max(m.step_time_s, 1e-9):.0f}")
            done = step + 1
            want_stop = (stop is not None and stop.check()) or (
                cfg.stop_after is not None and done - start_step >= cfg.stop_after)
            want_save = bool(cfg.save) and (want_stop or done == cfg.steps
                                            or bool(cfg.save_every and done % cfg.save_every == 0))
            if agree is not None:
                want_stop, want_save = agree(want_stop, want_save)
            if want_save and save_fn is not None:
                save_fn(done)
            if want_stop and done < cfg.steps:
                stopped_at = done
                break
    finally:
        bar.close()
        writer.close()
    if main and history:
        wall = time.perf_counter() - t0
        tokens = sum(m.tokens for m in history)
        peak = max(m.peak_device_bytes for m in history)
        print(f"done: {len(history)} steps, loss {history[0].loss:.4f} -> {history[-1].loss:.4f}, "
              f"{tokens / wall:.0f} tokens/s, wall {wall:.1f} s, peak device memory {peak / 2**20:.1f} MiB",
              flush=True)
    if main and stopped_at is not None:
        saved = f"checkpoint saved to {cfg.save}; continue with --resume {cfg.save}" if cfg.save else "nothing saved (no --save)"
        print(f"stopped after step {stopped_at} of {cfg.steps}: {saved}", flush=True)
    return history


def train_single(cfg: RunConfig, model_config: GPTConfig) -> list[StepMetrics]:
    from mobius.reference import ReferenceTrainer

    device = torch.device("cuda" if cuda_available() else "cpu")
    cfg.precision = cfg.precision or ("bf16" if device.type == "cuda" else "fp32")
    trainer = ReferenceTrainer(cfg, model_config, make_batches(cfg, model_config), device)
    start = 0
    if cfg.resume:
        ckpt = ck.open_for_resume(cfg, model_config)
        ck.restore(ckpt, dict(trainer.model.named_parameters()), trainer.optimizer)
        ck.restore_scaler(ckpt, trainer.scaler, cfg.precision)
        ck.restore_rng(ckpt)
        start = ckpt.step

    def save(done: int) -> None:
        staging = ck.begin_save(cfg.save)
        named = dict(trainer.model.named_parameters())
        ck.write_tensors(staging, "weights.safetensors", named)
        ck.write_tensors(staging, "optimizer.safetensors", ck.optimizer_tensors(named, trainer.optimizer))
        ck.write_tensors(staging, "rng.safetensors", ck.rng_tensors())
        ck.finish_save(cfg.save, staging, ck.run_meta(cfg, model_config.to_dict(), done, trainer.scaler))

    n = trainer.model.num_parameters()
    header = (f"mobius: backend single on {device}, model {cfg.model} ({n / 1e6:.1f}M parameters), "
              f"{cfg.micro_batches}x{cfg.micro_batch_size} sequences of {cfg.seq_len} per step, {cfg.precision}"
              + (f", resuming at step {start}" if start else ""))
    stop = StopRequest().install()
    history = run_steps(cfg, trainer.step, header, start_step=start, save_fn=save, stop=stop)
    if cfg.trace:
        write_trace(cfg.trace, trainer.trace.events)
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
    check_outputs(cfg, model_config)
    from mobius.backend import resolve_backend
    from mobius.planner import check_host_memory_available

    check_host_memory_available(cfg.model, model_config, cfg.precision or "fp32")
    backend, topo = resolve_backend(cfg)
    if backend == "single":
        return train_single(cfg, model_config)
    if backend == "chunked":
        from mobius.launcher import launch_chunked

        return launch_chunked(cfg, model_config, topo)
    from mobius.launcher import launch_pipeline

    return launch_pipeline(cfg, model_config, topo)


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_args(argv)
    from mobius.launcher import running_under_torchrun

    if running_under_torchrun() and cfg.backend != "single":
        # Started by torchrun (e.g. multi-node): this process is one pipeline worker.
        if cfg.export or cfg.backend == "chunked":
            raise InputError("under torchrun only the pipeline backend runs, without --export; "
                             "start python -m mobius.train directly for the others")
        from mobius.stages.worker import worker_main

        worker_main({"cfg": cfg.to_dict(), "plan": None, "header": "mobius: pipeline worker (torchrun)",
                     "budget_bytes": None})
        return
    run(cfg)


if __name__ == "__main__":
    main()
