"""Start one worker per device, pipeline or chunked, through torch's elastic launcher (torchrun's
machinery, standalone rendezvous on loopback), after every pre-flight check has passed.

A worker that dies ends the run: the elastic agent stops the others (no restarts) and we exit
non-zero naming the rank and its error; collectives time out after 60 s, so nothing hangs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from chunked_dp import worker as chunked_worker
from chunked_dp.prepare import prepare_chunked
from mobius.config import RunConfig
from mobius.data.shared import share
from mobius.errors import InputError, shown
from mobius.janitor import scratch_dir
from mobius.metrics import seconds_text
from mobius.models import GPTConfig, build_model
from mobius.models.adapters import finish_export
from mobius.models.hf import start_export
from mobius.prepare import prepare_pipeline, resolve_topology
from mobius.replan import Replanner
from mobius.runtime.emulation import create_counters
from mobius.runtime.inputs import check_model_input
from mobius.runtime.optim import UpdateRule
from mobius.runtime.spec import RunSpec
from mobius.runtime.worker import Decision, WorkerPayload, outside_torchrun
from mobius.signals import LauncherSignals
from mobius.stages import worker as pipeline_worker
from topology import Topology


def launch_pipeline(cfg: RunConfig, model_config: GPTConfig, topo: Topology, return_weights: bool = False,
                    inputs: dict[str, str] | None = None, data: tuple | None = None):
    """``inputs``: the digests the run's checkpoints record (:func:`mobius.runtime.checkpoint.input_digests`);
    ``data``: the run's training and held-out batches, made here and shared with the workers (None:
    each worker makes them)."""
    spec, plan = prepare_pipeline(cfg, topo, model_config)
    header = pipeline_header(cfg, model_config, topo, spec)
    # Each worker writes its stages' tensors into the staging directory of each export.
    wanted = cfg.outputs.exports()
    exports = [(str(start_export(out, cfg.data.chat_template)), merged) for _, out, merged in wanted]
    replan = Replanner(cfg, topo, model_config) if cfg.pipeline.replan == "auto" else None
    payload = WorkerPayload(cfg.changed(precision=spec.precision), spec, header, inputs, exports, return_weights,
                            replan=replan)
    print(f"starting {topo.n * spec.data_parallel} worker processes", flush=True)
    results = launch_workers(topo.n * spec.data_parallel, pipeline_worker.worker_main, payload, data)
    for (_, out, merged), (staging, _) in zip(wanted, exports):
        finish_export(model_config, Path(staging), out, merged)
        print(f"exported to {shown(out)}", flush=True)
    history = results[0].history
    if return_weights:
        weights = {}
        for r in results.values():
            weights.update(r.weights)
        return history, weights, results
    return history


def pipeline_header(cfg: RunConfig, model_config: GPTConfig, topo: Topology, spec: RunSpec) -> str:
    """The run's first line: where it runs, the model, the plan and its prediction."""
    plan = spec.plan
    n_params = build_model(model_config, device="meta").num_parameters()
    emulating = f", {spec.emulation.header(plan.predicted_step_s, cfg.optim.steps)}" if spec.emulation else ""
    replicas = f" x {spec.data_parallel} replicas (ZeRO-1 host AdamW)" if spec.data_parallel > 1 else ""
    return (f"mobius: backend pipeline on {topo.n} {_devices(spec)}{replicas}{emulating} ({topo.name}), "
            f"model {cfg.model} ({n_params / 1e6:.1f}M parameters), {len(plan.bounds)} stages ({plan.partitioner}"
            + (f"; {len(plan.resident)} resident, updated on their devices" if plan.resident else "") + "), "
            f"mapping {plan.order}, {cfg.batch.describe()}, "
            f"{spec.precision}, recompute {'on' if plan.recompute else 'off'}, "
            f"predicted {seconds_text(plan.predicted_step_s)}/step" + (" (emulated)" if spec.emulation else "")
            + f"\n  update: {UpdateRule.of(cfg.optim).describe()}")


def launch_workers(n: int, entry, payload: WorkerPayload, data: tuple | None) -> dict:
    """:func:`run_workers`; under ``--emulate`` with the emulated links' shared counters, in a
    directory of the launcher's own."""
    spec = payload.spec
    with scratch_dir("mobius-links-") as links:
        if spec.emulation:
            counters = str(Path(links) / "counters")
            create_counters(counters, n)
            payload = replace(payload, spec=replace(spec, emulation=replace(spec.emulation, counters=counters)))
        return run_workers(n, entry, payload, data)


def _devices(spec: RunSpec) -> str:
    return "CUDA GPUs" if spec.cuda else "CPU workers"


def run_workers(n: int, entry, payload: WorkerPayload, data: tuple | None = None) -> dict:
    """Start ``n`` workers running ``entry(payload)`` through the elastic launcher; a failed worker
    ends everything with one line naming it.  ``data`` (training batches, held-out examples) is
    written into the run's directory once and memory-mapped by every worker."""
    # We report a failed or interrupted worker in one line ourselves: the agent's own logging
    # (stack traces of the children, "closing process" warnings) would bury it.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    payload = replace(payload, t_origin=time.perf_counter())
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers GPUs as NVML and the topology do
    # Stages of many sizes come and go on each GPU: with fixed segments the caching allocator held
    # 180 MB reserved but unusable beside 500 MB of tensors under a 760 MB cap (H100, GPT-2 medium).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with scratch_dir("mobius-run-") as run_dir:
        # torch's own files of the launch (each worker's error file) go into it too, so a killed
        # launcher leaves none of them behind either.
        previous, tempfile.tempdir = tempfile.tempdir, run_dir
        try:
            if data is not None:
                payload = replace(payload, data=share(*data, run_dir))
            return _launch(n, entry, payload, run_dir)
        finally:
            tempfile.tempdir = previous


def _launch(n: int, entry, payload: WorkerPayload, run_dir: str) -> dict:
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"mobius-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn", signals_to_handle="",  # SIGINT, SIGTERM, SIGHUP, SIGQUIT: ours
                          logs_specs=DefaultLogsSpecs(log_dir=run_dir))  # the agent's directory goes with ours
    # First SIGINT/SIGTERM: the workers finish the step and save; a second: everything exits now.
    signals = LauncherSignals(run_dir)
    payload = replace(payload, launcher_pid=os.getpid(), stop_file=str(signals.stop.stop_file),
                      started_file=str(signals.started_file), run_dir=run_dir)
    try:
        with signals, outside_torchrun():
            return elastic_launch(launch, entry)(payload)
    except ChildFailedError as err:
        if signals.aborted:
            print(f"interrupted ({signal.Signals(signals.aborted).name}) before training started", file=sys.stderr)
            raise SystemExit(128 + signals.aborted) from None
        print(f"error: {shown(describe_failure(err))}", file=sys.stderr)
        raise SystemExit(1)


def launch_chunked(cfg: RunConfig, model_config: GPTConfig, topo: Topology, return_weights: bool = False,
                   inputs: dict[str, str] | None = None, data: tuple | None = None):
    """Data parallelism over chunks (chunked_dp), one worker per device, through the same launcher
    (``inputs`` and ``data`` as for :func:`launch_pipeline`)."""
    spec = prepare_chunked(cfg, topo, model_config)
    setup = spec.chunked
    n_params = build_model(model_config, device="meta").num_parameters()
    step_s = setup.predicted["step"]
    emulating = f", {spec.emulation.header(step_s, cfg.optim.steps)}" if spec.emulation else ""
    lanes = ", ".join(f"{lane} {seconds_text(s)}" for lane, s in setup.predicted.items() if lane != "step")
    header = (f"mobius: backend chunked on {topo.n} {_devices(spec)}{emulating} ({topo.name}), "
              f"model {cfg.model} ({n_params / 1e6:.1f}M parameters), chunk {setup.chunk_size} elements, "
              f"rCache {setup.n_block} blocks, {setup.chunks_on_device} of {setup.n_chunks} chunks on the device, "
              f"{cfg.batch.micro_batches}x{cfg.batch.micro_batch_size} sequences of {cfg.batch.seq_len} per step "
              f"({setup.group} per pass), {spec.precision}"
              # the prediction is the GPUs' (analytic profile): shown where GPUs compute or are emulated
              + (f", predicted {seconds_text(step_s)}/step ({lanes})" if spec.cuda or spec.emulation else "")
              + f"\n  why: {setup.reasons}\n  update: {UpdateRule.of(cfg.optim).describe()}")
    payload = WorkerPayload(cfg.changed(precision=spec.precision), spec, header, inputs,
                            return_weights=return_weights)
    results = launch_workers(topo.n, chunked_worker.worker_main, payload, data)
    history = results[0].history
    return (history, results[0].weights, results) if return_weights else history


def running_under_torchrun() -> bool:
    """True when torchrun started this process; its variables are checked first, so that a stray
    or malformed one is one line here, not a traceback (or a minute's wait) in a worker."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if "RANK" not in os.environ:
        raise InputError("TORCHELASTIC_RUN_ID is set but RANK is not: this process was not started by torchrun; "
                         "unset TORCHELASTIC_RUN_ID to run on this machine alone")
    absent = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": os.environ.get("WORLD_SIZE", ""), "MASTER_PORT": "1"}
    values = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = os.environ.get(name, absent.get(name, ""))
        if not text.strip().isdigit():
            raise InputError(f"torchrun's {name}={text[:20]!r} is not a non-negative integer")
        values[name] = int(text)
    world, local = values["WORLD_SIZE"], values["LOCAL_WORLD_SIZE"]
    if not (world >= 1 and 1 <= local <= world and world % local == 0):
        raise InputError(f"torchrun's WORLD_SIZE={world} and LOCAL_WORLD_SIZE={local} do not describe nodes of "
                         "equal size")
    if not (values["RANK"] < world and values["LOCAL_RANK"] < local):
        raise InputError(f"torchrun's RANK={values['RANK']} / LOCAL_RANK={values['LOCAL_RANK']} is outside "
                         f"WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local}")
    if "MASTER_PORT" in os.environ and not 1 <= values["MASTER_PORT"] <= 65535:
        raise InputError(f"torchrun's MASTER_PORT={values['MASTER_PORT']} is not a port (1-65535)")
    return True


def torchrun_decision(cfg: RunConfig) -> Decision:
    """Under torchrun each node plans for itself no more: every node describes its devices, rank 0
    checks that the nodes match and plans one replica's pipeline for that node shape, once."""
    model_config = check_model_input(cfg)
    topo = resolve_topology(cfg)  # this node's devices

    def decide(nodes: list[str]) -> tuple[RunSpec, str]:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(nodes)))
        shapes = {n: shape for n, shape in enumerate(nodes[::local])}
        if len(set(shapes.values())) > 1:
            raise InputError("the nodes differ: " + "; ".join(f"node {n} has {s}" for n, s in shapes.items())
                             + " (every node runs the same pipeline: give them the same GPUs)")
        spec, _ = prepare_pipeline(cfg, topo, model_config)
        return spec, pipeline_header(cfg, model_config, topo, spec)

    return Decision(node=topo.shape, decide=decide)


def describe_failure(err) -> str:
    """One line naming the worker that failed first and why.

    A worker killed by a signal is the root cause even if a peer's error (its connection
    closing) was recorded a moment earlier."""
    failures = err.failures

    def summary(f) -> str:
        message = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
        lines = str(message).strip().splitlines()
        last = lines[-1] if lines else f"exit code {f.exitcode}"
        for ours in ("RunError: ", "InputError: ", "CheckpointError: "):  # already a sentence for the user
            if last.startswith(ours):
                return last[len(ours):]
        return last

    ranked = sorted(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp))
    rank, root = ranked[0]
    others = [f"worker {r}: {summary(f)[:120]}" for r, f in ranked[1:]]
    return f"worker {rank} failed: {summary(root)}" + (f" (then {'; '.join(others)})" if others else "")
