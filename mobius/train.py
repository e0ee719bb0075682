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
import resource

import torch

from mobius import ownership
from mobius.config import RunConfig, parse_train_args, validate_for_backend
from mobius.errors import InputError, exits_cleanly, shown
from mobius.launcher import launch_chunked, launch_pipeline, running_under_torchrun, torchrun_decision
from mobius.metrics import StepMetrics, write_trace
from mobius.models import GPTConfig, build_model
from mobius.models.adapters import finish_export, layer_states, write_export_shard
from mobius.models.hf import check_export_target, start_export
from mobius.planner import available_host_memory, check_host_memory
from mobius.prepare import data_parallel_of, resolve_backend, resolve_precision, resolved
from mobius.reference import ReferenceTrainer
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import cuda_available
from mobius.runtime.inputs import check_model_input, make_data
from mobius.runtime.loop import run_steps
from mobius.runtime.worker import WorkerPayload
from mobius.signals import StopRequest
from mobius.stages.worker import worker_main


def check_outputs(cfg: RunConfig, model_config: GPTConfig) -> None:
    """Before the first step: every path the run writes is free or provably ours, and none of
    them is an input or another output."""
    ownership.check_paths({"--data": cfg.data.path, "--eval-data": cfg.data.eval_path,
                           "--chat-template": cfg.data.chat_template,
                           "--model": model_config.checkpoint, "--resume": cfg.checkpoint.resume},
                          {"--metrics": (cfg.outputs.metrics, "file"), "--trace": (cfg.outputs.trace, "file"),
                           "--tensorboard": (cfg.outputs.tensorboard, "dir"),
                           "--report-dir": (cfg.outputs.report_dir, "dir"),
                           "--save": (cfg.checkpoint.save, "dir"), "--export": (cfg.outputs.export, "dir"),
                           "--export-merged": (cfg.outputs.export_merged, "dir")})
    ownership.check_output_file("--metrics", cfg.outputs.metrics)
    ownership.check_output_file("--trace", cfg.outputs.trace)
    check_file_size_limit(cfg, model_config)
    ck.check_save_target(cfg)
    for option, out, _ in cfg.outputs.exports():
        check_export_target(model_config, out, option)


# What the runtime writes beside the run's outputs (the elastic agent's result and error files).
RUNTIME_FILE_BYTES = 2**20


def check_file_size_limit(cfg: RunConfig, model_config: GPTConfig) -> None:
    """``ulimit -f``: a run whose files cannot fit under the limit is refused before it trains
    (a checkpoint's optimizer file holds 8 bytes per trained parameter; an export up to 4 per
    parameter), not after, with a half-written checkpoint."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return
    need = RUNTIME_FILE_BYTES
    if cfg.checkpoint.save or cfg.outputs.exports():
        params = build_model(model_config, device="meta").parameters()
        need = max(need, sum((8 if p.requires_grad else 4) * p.numel() for p in params))
    if limit < need:
        raise InputError(f"the file-size limit (ulimit -f) is {limit} bytes, but this run writes files of up to "
                         f"{need / 2**20:.1f} MiB; raise the limit (ulimit -f unlimited)")


def train_single(cfg: RunConfig, model_config: GPTConfig, batches, held_out,
                 inputs: dict[str, str] | None = None) -> list[StepMetrics]:
    device = torch.device("cuda" if cuda_available() else "cpu")  # the reference runs on this machine's device
    cfg = cfg.changed(precision=resolve_precision(cfg, device.type == "cuda"))
    trainer = ReferenceTrainer(cfg, model_config, batches, device)

    def restore(ckpt: ck.Checkpoint) -> None:
        ck.restore(ckpt, trainer.trained(), trainer.optimizer)
        if trainer.lag:
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    if p.requires_grad:
                        p.copy_(ck.lagged_weights(ckpt, name, trainer.lag))

    def save(done: int) -> None:
        trained = trainer.trained()
        files = {"weights.safetensors": trained,
                 "optimizer.safetensors": ck.optimizer_tensors(trained, trainer.optimizer)}
        if trainer.lag:
            files["lagged-weights.safetensors"] = {ck.LAGGED + n: p for n, p in trainer.model.named_parameters()
                                                   if p.requires_grad}
        ck.save(cfg.checkpoint.save, files, ck.run_meta(cfg, model_config.to_dict(), done, trainer.scaler, inputs))

    start = 0
    if cfg.checkpoint.resume:
        start = ck.resume(ck.open_for_resume(cfg, model_config), restore, trainer.scaler, cfg.optim.precision)
    n = trainer.model.num_parameters()
    header = (f"mobius: backend single on {device}, model {cfg.model} ({n / 1e6:.1f}M parameters), "
              f"{cfg.batch.describe()}, {cfg.optim.precision}"
              + (f", resuming at step {start}" if start else "") + f"\n  update: {trainer.rule.describe()}")
    evaluate = (lambda done: trainer.evaluate(held_out)) if held_out is not None else None
    with StopRequest() as stop:
        history = run_steps(cfg, trainer.step, header, start_step=start, save_fn=save, stop=stop, eval_fn=evaluate)
    if cfg.outputs.trace:
        write_trace(cfg.outputs.trace, trainer.trace.collect())
    for _, out, merged in cfg.outputs.exports():
        staging = start_export(out, cfg.data.chat_template)
        write_export_shard(model_config, staging, "all", layer_states(trainer.master), merged)
        finish_export(model_config, staging, out, merged)
        print(f"exported to {shown(out)}", flush=True)
    return history


def run(cfg: RunConfig) -> list[StepMetrics] | None:
    model_config = check_model_input(cfg)
    out = cfg.outputs
    outputs = {"--save": cfg.checkpoint.save, "--export": out.export, "--export-merged": out.export_merged,
               "--metrics": out.metrics, "--trace": out.trace, "--tensorboard": out.tensorboard,
               "--report-dir": out.report_dir}
    with ownership.made_parents(outputs), ownership.output_locks(outputs):  # written by this run alone
        return _run_locked(cfg, model_config)


def _run_locked(cfg: RunConfig, model_config: GPTConfig) -> list[StepMetrics] | None:
    check_outputs(cfg, model_config)
    backend, topo = resolve_backend(cfg)  # options the backend does not take are refused before the data is read
    validate_for_backend(cfg, backend, topo.n if topo is not None else 1)
    inputs = ck.input_digests(cfg, model_config)
    if cfg.checkpoint.resume:
        ck.check_inputs(cfg, inputs)
        reads = {"model": model_config.checkpoint or cfg.model, "data": cfg.data.path or "the default corpus",
                 "held-out data": cfg.data.eval_path, "chat template": cfg.data.chat_template}
        print(f"resuming from {shown(cfg.checkpoint.resume)}: " + ", ".join(f"{what} {shown(path)}" for what, path in
                                                                          reads.items() if path), flush=True)
    # The data, read and checked before any worker starts; the workers map what this process made.
    batches, held_out = make_data(cfg, model_config)
    if cfg.optim.epochs is not None:  # the run's length in steps, which the learning-rate schedule needs
        cfg = cfg.changed(steps=max(1, math.ceil(cfg.optim.epochs / batches.epochs(1) - 1e-9)))
    steps = cfg.optim.steps
    print(f"data: {batches.describe()}; {steps} steps ({batches.epochs(steps):.2f} epochs) at peak lr {cfg.optim.lr:g}",
          flush=True)
    if held_out is not None:
        print(f"held out: {held_out.describe()}", flush=True)
    # This process holds the data; the workers map one copy of it (the page cache's, shared).
    holders = 1 if backend == "single" else 2
    data_bytes = holders * sum(source.host_bytes() for source in (batches, held_out) if source is not None)
    available = available_host_memory()
    if available is not None:  # every replica of the pipeline this machine runs
        replicas = data_parallel_of(cfg) if backend == "pipeline" else 1
        check_host_memory(cfg.model, model_config, cfg.optim.precision or "fp32", cfg.optim.optimizer_lag, available,
                          "this machine (available now)", data_bytes, data_parallel=replicas, replicas_here=replicas)
    if backend == "single":
        return train_single(cfg, model_config, batches, held_out, inputs)
    if backend == "chunked":
        return launch_chunked(cfg, model_config, topo, inputs=inputs, data=(batches, held_out))
    return launch_pipeline(cfg, model_config, topo, inputs=inputs, data=(batches, held_out))


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_args(argv, checkpoint_settings=ck.run_config, resolve=resolved)
    if running_under_torchrun() and cfg.backend != "single":
        # Started by torchrun (e.g. multi-node): this process is one pipeline worker.
        if cfg.outputs.exports() or cfg.backend == "chunked" or cfg.optim.epochs is not None \
                or cfg.emulation.enabled or cfg.pipeline.replan == "auto":
            raise InputError("under torchrun only the pipeline backend runs, without --export, --epochs, --replan auto "
                             "or --emulate "
                             "(several boxes emulate on one machine: --emulate --data-parallel D); start "
                             "python -m mobius.train directly for the others")
        worker_main(WorkerPayload(cfg, None, ""), torchrun_decision(cfg))
        return
    run(cfg)


if __name__ == "__main__":
    main()
