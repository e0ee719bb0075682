"""The pipeline's part of a worker process (one per device of the topology); the process itself,
its start-up, checkpoints and signals are :mod:`mobius.runtime.worker`'s.

Started by :mod:`mobius.launcher` through torch's elastic launcher, or directly by ``torchrun``
(then rank 0 makes the plan and broadcasts it).  With ``--data-parallel D`` the run's processes
are D replicas of the pipeline (:mod:`mobius.stages.replicas`), replica by replica.  Activations
travel between workers through host memory over gloo: the GPUs of the servers we target have no
peer-to-peer path, so device -> host -> device is the real route, and gloo moves the host leg.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.data import BatchSource, ExampleBatches
from mobius.data.packing import EvalBatches
from mobius.data.preference import PreferenceBatches, evaluation_of, held_out_sums, prepare_references, reference_files
from mobius.metrics import Evaluation, StepMetrics, Trace
from mobius.models import tied_parameter_names
from mobius.models.adapters import layer_states, write_export_shard
from mobius.models.precision import DTYPES
from mobius.models.preference import metric_sums, step_metrics
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import Device
from mobius.runtime.inputs import model_config_for
from mobius.runtime.optim import DynamicLossScaler, UpdateRule
from mobius.runtime.spec import RunSpec
from mobius.runtime.worker import Decision, Finished, WorkerContext, WorkerPayload, WorkerResult, run_worker
from mobius.stages.executor import StageRunner
from mobius.stages.replicas import ReplicaGroup, ReplicaLayout
from mobius.stages.transport import GlooTransport, Transport
from mobius.swap.disk import DiskState, block_params
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import Prefetcher
from mobius.swap.store import HostStageStore


def worker_main(payload: WorkerPayload, decision: Decision | None = None) -> WorkerResult:
    """Entry point of a pipeline worker process (:func:`mobius.runtime.worker.run_worker`)."""
    return run_worker(payload, PipelineWorker, decision)


@dataclass(frozen=True)
class PipelineReport:
    """What a pipeline worker (either schedule) says of itself after its last step."""

    budget_bytes: int  # the device budget it ran under
    peak_bytes_max: int  # the most device memory any worker held in a step
    host_bytes: int  # what its stage store holds on the host
    disk_bytes: tuple[int, int] | None = None  # --offload-dir: AdamW state read and written


class PipelineWorker:
    """The pipeline's part of a worker process (:class:`~mobius.runtime.worker.WorkerBackend`):
    this worker's stages, their step, their checkpoint shards and exports."""

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        plan, replicas = ctx.spec.setup.plan, ctx.spec.setup.data_parallel
        workers = max(plan.order) + 1
        if workers * replicas != ctx.world:
            raise InputError(f"the plan needs {workers} workers per replica x {replicas} replicas, but {ctx.world} "
                             "were started (under torchrun: --nproc-per-node is the GPUs of one node, and "
                             "--data-parallel the nodes)")
        self.layout = ReplicaLayout.of_rank(ctx.rank, ctx.world, replicas)
        transport = GlooTransport(first=self.layout.rank_of(0))
        self.position = transport.rank
        group = ReplicaGroup.join(self.layout, self.position, ctx.device, ctx.trace) if replicas > 1 else None
        self.parts = build_worker(ctx.cfg, ctx.spec, transport, ctx.device, ctx.trace, ctx.data, group)
        self.store, self.scaler = self.parts.store, self.parts.scaler
        self.evaluates = self.parts.held_out is not None
        self.peak_bytes_max = 0  # the most device memory any worker held in a step
        runner = self.parts.runner  # resident stages a preference run's reference pass loaded load again after it
        if prepare_references(runner.batches, self.parts.held_out, ck.resumed_checkpoint(ctx.cfg),
                              lambda micro: runner.evaluate(micro, 0), dist.all_reduce):
            runner.reload_resident()

    def step(self, step: int) -> StepMetrics:
        cfg, memory, traffic = self.cfg, self.parts.memory, self.parts.traffic
        traffic.reset()
        memory.reset_peak()
        t0 = time.perf_counter()
        loss = self.parts.runner.step(step)
        adam_s, adam_params = self.parts.runner.optimizer.take_busy()
        pairs = isinstance(self.parts.runner.batches, PreferenceBatches)
        stats = torch.cat([torch.tensor([loss, traffic.h2d, traffic.d2h, traffic.peer, adam_s, adam_params],
                                        dtype=torch.float64),
                           metric_sums(self.parts.runner.micro) if pairs else torch.zeros(0, dtype=torch.float64)])
        dist.all_reduce(stats)  # the loss (and a preference run's metrics): the last stage's workers computed it
        most = torch.tensor([memory.peak, adam_s, self.parts.runner.compute_s], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self.peak_bytes_max = max(self.peak_bytes_max, int(most[0].item()))
        return StepMetrics(step=step, loss=stats[0].item(), lr=UpdateRule.of(cfg.optim).lr_at(step),
                           tokens=self.parts.runner.batches.step_tokens(step),
                           step_time_s=time.perf_counter() - t0, h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]),
                           peer_bytes=int(stats[3]), peak_device_bytes=int(most[0].item()),
                           loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped_steps,
                           host_adam_s=most[1].item(), compute_s=most[2].item(),
                           host_adam_params_per_s=stats[5].item() / stats[4].item() if stats[4] > 0 else None,
                           grad_norm=self.parts.runner.grad_norm,
                           preference=step_metrics(stats[6:], self.parts.runner.micro[0].layout.pairs.step_pairs)
                           if pairs else None)

    def evaluate(self, done: int) -> Evaluation:
        held_out = self.parts.held_out
        local = sum(self.parts.runner.evaluate(held_out.pass_batches(k), done) for k in range(held_out.passes))
        total = torch.tensor([local, *held_out_sums(held_out)], dtype=torch.float64)
        dist.all_reduce(total)  # the last stage's worker computed it
        return evaluation_of(total.tolist(), held_out)

    def drain(self) -> None:
        self.parts.runner.drain()

    def checkpoint_files(self, done: int) -> dict[str, dict[str, torch.Tensor]]:
        files = checkpoint_files(self.store, done, self.parts.present, self.layout)
        kept = reference_files(self.parts.runner.batches, self.parts.held_out) if self.ctx.rank == 0 else {}
        return {**files, **kept}

    def restore(self, ckpt: ck.Checkpoint) -> None:
        restore(self.store, ckpt, self.parts.runner.optimizer.disk)

    def finish(self) -> Finished:
        """Each stage's tensors into the staging directory of every export; the weights if asked."""
        store, payload = self.store, self.ctx.payload
        disk = self.parts.runner.optimizer.disk
        if self.layout.index == 0:
            export(store, payload.exports, self.parts.present)
        report = PipelineReport(self.ctx.spec.budget_bytes[self.position], self.peak_bytes_max, store.host_bytes(),
                                (disk.read_bytes, disk.written_bytes) if disk is not None else None)
        return Finished(report, self.parts.weights() if payload.return_weights else None)

    def close(self) -> None:
        self.parts.close()


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

    def present(self, s: int):
        """Stage ``s``'s state in memory while the block runs (a master on disk read back)."""
        disk = self.runner.optimizer.disk
        return disk.present(s) if disk is not None else contextlib.nullcontext()

    def weights(self) -> dict[str, torch.Tensor]:
        """Copies of this worker's weights by name."""
        out = {}
        for s in self.store.stages:
            with self.present(s):
                out.update(self.store.stage_state_dict(s))
        return out

    def close(self) -> None:
        self.prefetcher.close()
        self.runner.close()
        self.device.close()


def build_worker(cfg: RunConfig, spec: RunSpec, transport: Transport, device: Device, trace: Trace,
                 data: tuple[BatchSource | ExampleBatches, EvalBatches | None],
                 replicas: ReplicaGroup | None = None) -> WorkerParts:
    """The runtime of worker ``transport.rank``: its stages in host memory, the prefetcher, the
    executor, training on ``data`` (the run's batches and held-out examples), as one of the
    ``replicas`` (None: the only one).  Between processes the transport is gloo; tests run several in
    threads."""
    plan, rank = spec.setup.plan, transport.rank
    torch.manual_seed(cfg.optim.seed)
    memory = DeviceMemory(spec.budget_bytes[rank], f"worker {rank}")
    traffic = Traffic()
    model_config = model_config_for(cfg)
    mine = plan.stages_of_gpu(rank)
    disk = None
    if cfg.offload_dir:  # the optimizer state of the stages the plan puts on disk waits there
        tied = {0, len(plan.bounds) - 1} if model_config.tie_embeddings else set()
        if plan.disk_masters and (replicas is not None or set(plan.disk_masters) & tied):
            raise ValueError(f"stages {plan.disk_masters} cannot keep their master weights on disk: replicas or "
                             "the tied embedding sum gradients on the host")
        if plan.disk_weights and cfg.optim.optimizer_lag:
            raise ValueError(f"stages {plan.disk_weights} cannot keep their weights on disk with an optimizer lag "
                             "(its two compute copies are the host's)")
        rank_here = dist.get_rank() if dist.is_initialized() else rank
        largest = max(plan.stages[s].grad_bytes // DTYPES[spec.precision].itemsize for s in mine)
        disk = DiskState(cfg.offload_dir, rank_here, through=device.disk_transfer, trace=trace,
                         block=block_params(largest),
                         masters=[s for s in plan.disk_masters if s in mine],
                         weights=[s for s in plan.disk_weights if s in mine])
    store = HostStageStore(model_config, plan.bounds, mine, cfg.optim.seed, UpdateRule.of(cfg.optim),
                           DTYPES[spec.precision], device, cfg.optim.optimizer_lag, disk)
    if replicas is not None:  # each parameter's AdamW runs on one replica's host
        replicas.assign({n: p.numel() for st in store.stages.values() for n, p in st.trained()})
        store.update_only(replicas.updates)
    if disk is not None:
        disk.attach({s: host for s, host in store.stages.items()
                     if host.optimizer is not None and s in plan.disk_stages})
    prefetcher = Prefetcher(store, model_config, memory, device, traffic, trace, disk)
    scaler = DynamicLossScaler(enabled=spec.precision == "fp16")
    batches, held_out = data
    runner = StageRunner(plan, store, prefetcher, memory, traffic, trace, batches, device,
                         scaler, transport, replicas, disk)
    return WorkerParts(store, memory, traffic, scaler, prefetcher, runner, device, held_out)


def checkpoint_files(store: HostStageStore, done: int, present=lambda s: contextlib.nullcontext(),
                     layout: ReplicaLayout = ReplicaLayout()) -> dict[str, dict[str, torch.Tensor]]:
    """One shard per stage of ``store``: weights, AdamW state and (lagging) the weights the next
    step computes with, by parameter name; ``present(s)``: stage ``s``'s state in memory meanwhile
    (a master on disk read back)."""
    files = {}
    lagged = store.lagged_state(done) if store.lag else {}
    # Every replica holds the same weights: the first writes them.  Each writes the AdamW state
    # of the parameters it updates; a checkpoint is read by name, whatever file holds a tensor.
    part = f"-replica{layout.index}" if layout.count > 1 else ""
    for s, host in store.stages.items():
        # State on disk is read into tensors of its own, which the checkpoint holds until it is
        # saved; the disk tier then drops its binding (the files keep the same).
        with present(s):
            named = _stage_state(store, s)
            if layout.index == 0:
                files[f"weights-stage{s:04d}.safetensors"] = {n: p.detach() for n, p in named.items()}
                if store.lag:
                    files[f"lagged-stage{s:04d}.safetensors"] = {ck.LAGGED + n: lagged[n] for n in named}
            if host.optimizer is not None:
                files[f"optimizer-stage{s:04d}{part}.safetensors"] = ck.optimizer_tensors(named, host.optimizer)
    return files


def restore(store: HostStageStore, ckpt: ck.Checkpoint, disk: DiskState | None = None) -> None:
    """Weights and AdamW state of ``store``'s stages, by name, from any backend's checkpoint."""
    aliases = tied_parameter_names(store.config)
    for s, host in store.stages.items():
        if disk is not None:
            disk.loaded(s)  # a master on disk bound, to be restored into
        ck.restore(ckpt, dict(host.trained()), host.optimizer, aliases)
        for b in range(len(host.compute_buffers)):
            store.refresh_compute_copy(s, b)
        if disk is not None:
            disk.unload(s)
    if store.lag:  # the weights the first step computes with: one update behind the master
        with torch.no_grad():
            for name, buf in store.lagged_state(ckpt.step).items():
                buf.copy_(ck.lagged_weights(ckpt, aliases.get(name, name), store.lag))


def export(store: HostStageStore, exports: list[tuple[str, bool]], present=lambda s: contextlib.nullcontext()) -> None:
    """Each stage's tensors into the staging directory of every export (``(directory, merged)``)."""
    for staging, merged in exports:
        for s, host in store.stages.items():
            with present(s):
                write_export_shard(store.config, Path(staging), f"stage-{s:05d}",
                                   layer_states(dict(host.named_params())), merged)


def _stage_state(store: HostStageStore, s: int) -> dict[str, torch.nn.Parameter]:
    """The parameters of stage ``s`` by name, without the tied copy of the token table (the
    embedding's copy is the one stored)."""
    aliases = tied_parameter_names(store.config)
    host = store.stages[s]
    return {n: p for n, p in host.trained() if n not in aliases}
