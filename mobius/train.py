"""``python -m mobius.train``: the command our users type.

Resolves the topology, chooses the backend (:mod:`mobius.backends`), checks the input and the
outputs, makes the data, then hands the run to the backend.
"""

from __future__ import annotations

from mobius.boundary.errors import quiet_interrupts_while_importing

if __name__ == "__main__":
    quiet_interrupts_while_importing()

# The imports below take seconds; the guard above must come first.
# ruff: noqa: E402
import contextlib
import math
import resource

from mobius.backends import BACKENDS, check_options, join_torchrun, resolve, resolved
from mobius.boundary import ownership
from mobius.boundary.errors import InputError, exits_cleanly, shown
from mobius.config import RunConfig, parse_train_args
from mobius.launcher import running_under_torchrun
from mobius.metrics import StepMetrics
from mobius.models import GPTConfig, build_model
from mobius.models.hf import check_export_target
from mobius.planning.planner import available_host_memory, check_host_memory
from mobius.data.preference import use_kept_references
from mobius.planning.prepare import Decided
from mobius.runtime import checkpoint as ck
from mobius.runtime.inputs import check_model_input, make_data


def offload_dirs(cfg: RunConfig) -> dict[str, str]:
    """The directories of ``--offload-dir``, each under the name its messages give it."""
    dirs = cfg.offload_dir
    return {"--offload-dir" if len(dirs) == 1 else f"--offload-dir ({k} of {len(dirs)})": d
            for k, d in enumerate(dirs, 1)}


def check_outputs(cfg: RunConfig, model_config: GPTConfig) -> None:
    """Before the first step: every path the run writes is free or provably ours, and none of
    them is an input or another output."""
    check_file_size_limit(cfg, model_config)
    ownership.check_paths({"--data": cfg.data.path, "--eval-data": cfg.data.eval_path,
                           "--chat-template": cfg.data.chat_template,
                           "--model": model_config.checkpoint, "--resume": cfg.checkpoint.resume},
                          {"--metrics": (cfg.outputs.metrics, "file"), "--trace": (cfg.outputs.trace, "file"),
                           "--tensorboard": (cfg.outputs.tensorboard, "dir"),
                           "--report-dir": (cfg.outputs.report_dir, "dir"),
                           **{option: (d, "dir") for option, d in offload_dirs(cfg).items()},
                           "--save": (cfg.checkpoint.save, "dir"), "--export": (cfg.outputs.export, "dir"),
                           "--export-merged": (cfg.outputs.export_merged, "dir")})
    ownership.check_output_file("--metrics", cfg.outputs.metrics)
    ownership.check_output_file("--trace", cfg.outputs.trace)
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


def run(cfg: RunConfig) -> list[StepMetrics] | None:
    model_config = check_model_input(cfg)
    out = cfg.outputs
    outputs = {"--save": cfg.checkpoint.save, "--export": out.export, "--export-merged": out.export_merged,
               "--metrics": out.metrics, "--trace": out.trace, "--tensorboard": out.tensorboard,
               "--report-dir": out.report_dir, **offload_dirs(cfg)}
    with ownership.made_parents(outputs), ownership.output_locks(outputs):  # written by this run alone
        return _run_locked(cfg, model_config)


def _run_locked(cfg: RunConfig, model_config: GPTConfig) -> list[StepMetrics] | None:
    check_outputs(cfg, model_config)
    with contextlib.ExitStack() as working:
        for option, directory in offload_dirs(cfg).items():
            working.enter_context(ownership.working_dir(option, directory))
        decided = resolve(cfg)  # decided once: everything after reads them
        check_options(decided, model_config)  # before the data is read
        return _run_prepared(decided, model_config)


def _run_prepared(decided: Decided, model_config: GPTConfig) -> list[StepMetrics] | None:
    cfg, backend = decided.cfg, BACKENDS[decided.backend]
    inputs = ck.input_digests(cfg, model_config)
    if cfg.checkpoint.resume:
        ck.check_inputs(cfg, inputs)
        reads = {"model": model_config.checkpoint or cfg.model, "data": cfg.data.path or "the default corpus",
                 "held-out data": cfg.data.eval_path, "chat template": cfg.data.chat_template}
        print(f"resuming from {shown(cfg.checkpoint.resume)}: " + ", ".join(f"{what} {shown(path)}" for what, path in
                                                                          reads.items() if path), flush=True)
    with backend.meanwhile(decided, model_config) if backend.meanwhile else contextlib.nullcontext():
        return _run_read(decided, model_config, inputs)


def _run_read(decided: Decided, model_config: GPTConfig, inputs: dict[str, str]) -> list[StepMetrics] | None:
    # The data, read and checked before any worker starts; the workers map what this process made.
    batches, held_out = make_data(decided.cfg, model_config)
    if decided.cfg.optim.epochs is not None:  # the run's length in steps, which the learning-rate schedule needs
        decided = decided.with_steps(max(1, math.ceil(decided.cfg.optim.epochs / batches.epochs(1) - 1e-9)))
    cfg, backend = decided.cfg, BACKENDS[decided.backend]
    steps = cfg.optim.steps
    print(f"data: {batches.describe()}; {steps} steps ({batches.epochs(steps):.2f} epochs) at peak lr {cfg.optim.lr:g}",
          flush=True)
    if held_out is not None:
        print(f"held out: {held_out.describe()}", flush=True)
    if cfg.objective.preference is not None and cfg.checkpoint.resume:  # what the resumed checkpoint spares
        kept = use_kept_references(batches, held_out, ck.resumed_checkpoint(cfg))
        said = {True: "kept by the checkpoint, not computed again",
                False: "computed again (the checkpoint keeps no table of these rows)"}
        print("reference log-probabilities: " + "; ".join(
            f"of the {what} pairs {said[name in kept]}" for what, name, source in
            (("training", "train", batches), ("held-out", "held_out", held_out)) if source is not None), flush=True)
    # This process holds the data; the workers map one copy of it (the page cache's, shared).
    holders = 2 if backend.in_workers else 1
    data_bytes = holders * sum(source.host_bytes() for source in (batches, held_out) if source is not None)
    available = available_host_memory()
    if available is not None:  # every replica of the pipeline this machine runs
        replicas = decided.replicas
        check_host_memory(cfg.model, model_config, cfg.optim.precision, cfg.optim.optimizer_lag, available,
                          "this machine (available now)", data_bytes, data_parallel=replicas, replicas_here=replicas,
                          moments_on_disk=bool(cfg.offload_dir))
    return backend.train(decided, model_config, data=(batches, held_out), inputs=inputs)


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_args(argv, checkpoint_settings=ck.run_config, resolve=resolved)
    if running_under_torchrun() and join_torchrun(cfg):
        return
    run(cfg)


if __name__ == "__main__":
    main()
