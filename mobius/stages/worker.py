"""One pipeline worker process (one per device of the topology).

Started by :mod:`mobius.launcher` through torch's elastic launcher, or directly by ``torchrun``
(then rank 0 makes the plan and broadcasts it).  Activations travel between workers through host
memory over gloo: the GPUs of the servers we target have no peer-to-peer path, so device -> host
-> device is the real route, and gloo moves the host leg.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mobius import checkpoint as ck
from mobius.config import RunConfig
from mobius.metrics import StepMetrics, Trace
from mobius.models import tied_parameter_names
from mobius.models.adapters import layer_states, write_export_shard
from mobius.optim import DynamicLossScaler, lr_at
from mobius.precision import DTYPES
from mobius.runtime.device import Device, open_device
from mobius.runtime.emulation import EmulatedLinks, EmulationSpec
from mobius.data import BatchSource, ExampleBatches
from mobius.data.packing import EvalBatches
from mobius.runtime.inputs import model_config_for, worker_data
from mobius.runtime.loop import run_steps
from mobius.runtime.spec import RunSpec
from mobius.stages.schedule import StageRunner
from mobius.stages.transport import GlooTransport, Transport
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import Prefetcher
from mobius.swap.store import HostStageStore
from mobius.workers import (
    agree,
    gather_trace,
    install_stop,
    share_cpu_cores,
    tied_to_launcher,
)

COLLECTIVE_TIMEOUT_S = 60


def worker_main(payload: dict, decide=None) -> dict:
    """Entry point of a worker; returns rank 0's history and, if asked, this worker's weights.
    Under torchrun the payload has no spec: rank 0 makes it with ``decide()`` and shares it."""
    with tied_to_launcher(payload):
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s(payload.get("spec"))))
        try:
            return _run(payload, rank, world, decide)
        finally:
            dist.destroy_process_group()


def collective_timeout_s(spec: dict | None) -> float:
    """How long a message may wait for its receiver before the run fails: under ``--emulate`` a
    worker may legitimately be busy for several dilated steps' worth of wall time."""
    if not spec or not spec.get("emulation"):
        return COLLECTIVE_TIMEOUT_S
    return COLLECTIVE_TIMEOUT_S + 3 * spec["emulation"]["factor"] * spec["plan"]["predicted_step_s"]


def _run(payload: dict, rank: int, world: int, decide) -> dict:
    cfg = RunConfig.from_dict(payload["cfg"])
    if payload.get("spec") is None:  # started by torchrun: rank 0 decides, everyone follows
        shared = [decide() if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        payload = {**payload, "spec": shared[0]}
        cfg.precision = shared[0]["precision"]
    spec = RunSpec.from_dict(payload["spec"])
    plan = spec.the_plan()
    if max(plan.order) >= world:
        raise RuntimeError(f"the plan needs {len(plan.order)} workers, but {world} were started")
    emulation = EmulatedLinks(EmulationSpec.from_dict(spec.emulation), rank) if spec.emulation else None
    device = open_device(spec.cuda, int(os.environ.get("LOCAL_RANK", 0)), spec.budget_bytes[rank], emulation)
    trace = Trace(enabled=bool(cfg.trace), pid=rank)
    trace.set_origin(payload.get("t_origin", time.perf_counter()))  # CLOCK_MONOTONIC: shared by all workers
    # Workers share the host's cores: CPU workers for everything, GPU workers for their optimizer
    # (one fused AdamW per worker, all at once; the profile measures it so).
    share_cpu_cores(world)
    data = worker_data(cfg, model_config_for(cfg), payload.get("data"))  # mapped, or made here under torchrun
    parts = build_worker(cfg, spec, GlooTransport(), device, trace, data)
    device.start_steps()
    store, memory, traffic, scaler, runner = parts.store, parts.memory, parts.traffic, parts.scaler, parts.runner
    model_config = store.config
    def one_step(step: int) -> StepMetrics:
        _inject_fault(rank, step)
        traffic.reset()
        memory.reset_peak()
        t0 = time.perf_counter()
        loss = runner.step(step)
        stats = torch.tensor([loss, traffic.h2d, traffic.d2h, traffic.peer], dtype=torch.float64)
        dist.all_reduce(stats)
        peak = torch.tensor([memory.peak], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        tokens = cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
        wall = time.perf_counter() - t0
        return StepMetrics(step=step, loss=stats[0].item(),
                           lr=lr_at(step, cfg.steps, cfg.lr), tokens=tokens, step_time_s=wall,
                           emulated_step_s=wall / emulation.factor if emulation else None,
                           h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]), peer_bytes=int(stats[3]),
                           peak_device_bytes=int(peak.item()), loss_scale=scaler.scale,
                           skipped_steps=scaler.skipped_steps)

    start = 0
    if cfg.resume:
        start = _restore(cfg, store, scaler, model_config)
    stop = install_stop(payload)

    def save(done: int) -> None:
        runner.drain()
        _save(cfg, store, scaler, model_config, done, rank, payload.get("inputs"))

    held_out = parts.held_out  # None when the run does not evaluate

    def evaluate(done: int) -> float:
        local = sum(runner.evaluate(held_out.pass_batches(k), done) for k in range(held_out.passes))
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)  # the last stage's worker computed it
        return total.item()

    header = payload["header"] + (f", resuming at step {start}" if start else "")
    try:
        history = run_steps(cfg, one_step, header, start_step=start, save_fn=save, stop=stop, agree=agree,
                            main=rank == 0, eval_fn=evaluate if held_out is not None else None)
        runner.drain()  # with a lag, the last step's update; resident stages back in the host store
        gather_trace(trace, cfg.trace, rank, world)
    finally:
        parts.close()
    for staging, merged in payload.get("exports", []):
        for s, host in store.stages.items():
            write_export_shard(model_config, Path(staging), f"stage-{s:05d}", layer_states(dict(host.named_params())),
                               merged)
    result = {"rank": rank, "history": [m.__dict__ for m in history] if rank == 0 else None,
              "budget_bytes": spec.budget_bytes[rank], "peak_bytes_max": max((m.peak_device_bytes for m in history), default=0)}
    if payload.get("return_weights"):
        result["weights"] = store.state_dict()
    return result


@dataclass
class WorkerParts:
    """One pipeline worker's runtime, built by :func:`build_worker`."""

    store: HostStageStore
    memory: DeviceMemory
    traffic: Traffic
    scaler: DynamicLossScaler
    prefetcher: Prefetcher
    runner: StageRunner
    device: Device
    held_out: EvalBatches | None  # the run's held-out examples, if it evaluates

    def close(self) -> None:
        self.prefetcher.close()
        self.runner.close()
        self.device.close()


def build_worker(cfg: RunConfig, spec: RunSpec, transport: Transport, device: Device, trace: Trace,
                 data: tuple[BatchSource | ExampleBatches, EvalBatches | None]) -> WorkerParts:
    """The runtime of worker ``transport.rank``: its stages in host memory, the prefetcher, the
    executor, training on ``data`` (the run's batches and held-out examples).  Between processes
    the transport is gloo; tests run several in threads."""
    plan, rank = spec.the_plan(), transport.rank
    torch.manual_seed(cfg.seed)
    memory = DeviceMemory(spec.budget_bytes[rank], f"worker {rank}")
    traffic = Traffic()
    model_config = model_config_for(cfg)
    store = HostStageStore(model_config, plan.bounds, plan.stages_of_gpu(rank), cfg.seed, cfg.lr,
                           DTYPES[spec.precision], device, cfg.optimizer_lag)
    prefetcher = Prefetcher(store, model_config, memory, device, traffic, trace)
    scaler = DynamicLossScaler(enabled=spec.precision == "fp16")
    batches, held_out = data
    runner = StageRunner(plan, store, prefetcher, memory, traffic, trace, batches, device,
                         cfg.steps, cfg.lr, scaler, transport)
    return WorkerParts(store, memory, traffic, scaler, prefetcher, runner, device, held_out)


def _inject_fault(rank: int, step: int) -> None:
    """Fault injection for the dead-worker tests: ``MOBIUS_FAULT=RANK:STEP`` SIGKILLs that worker."""
    spec = os.environ.get("MOBIUS_FAULT")
    if spec and spec == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _stage_state(store: HostStageStore, s: int) -> dict[str, torch.nn.Parameter]:
    """The parameters of stage ``s`` by name, without the tied copy of the token table (the
    embedding's copy is the one stored)."""
    aliases = tied_parameter_names(store.config)
    host = store.stages[s]
    return {n: p for n, p in host.trained() if n not in aliases}


def _save(cfg: RunConfig, store: HostStageStore, scaler: DynamicLossScaler, model_config, done: int, rank: int,
          inputs: dict | None) -> None:
    """Every worker writes its stages' shards; rank 0 checksums them and swaps the checkpoint in."""
    staging = ck.staging_dir(cfg.save)
    if rank == 0:
        ck.begin_save(cfg.save)
    dist.barrier()
    lagged = store.lagged_state(done) if store.lag else {}
    for s, host in store.stages.items():
        named = _stage_state(store, s)
        ck.write_tensors(staging, f"weights-stage{s:04d}.safetensors", named)
        ck.write_tensors(staging, f"optimizer-stage{s:04d}.safetensors", ck.optimizer_tensors(named, host.optimizer))
        if store.lag:
            ck.write_tensors(staging, f"lagged-stage{s:04d}.safetensors", {ck.LAGGED + n: lagged[n] for n in named})
    if rank == 0:
        ck.write_tensors(staging, "rng.safetensors", ck.rng_tensors())
    dist.barrier()
    if rank == 0:
        ck.finish_save(cfg.save, staging, ck.run_meta(cfg, model_config.to_dict(), done, scaler, inputs))
    dist.barrier()


def _restore(cfg: RunConfig, store: HostStageStore, scaler: DynamicLossScaler, model_config) -> int:
    """Weights and AdamW state of this worker's stages, by name, from any backend's checkpoint."""
    ckpt = ck.load_checkpoint(cfg.resume, verify=False)  # each file checked as it is read
    aliases = tied_parameter_names(model_config)
    for s, host in store.stages.items():
        ck.restore(ckpt, dict(host.trained()), host.optimizer, aliases)
        for b in range(len(host.compute_buffers)):
            store.refresh_compute_copy(s, b)
    if store.lag:  # the weights the first step computes with: one update behind the master
        lagged = store.lagged_state(ckpt.step)
        with torch.no_grad():
            for name, buf in lagged.items():
                buf.copy_(ck.lagged_weights(ckpt, aliases.get(name, name), store.lag))
    ck.restore_scaler(ckpt, scaler, cfg.precision)
    ck.restore_rng(ckpt)
    return ckpt.step
