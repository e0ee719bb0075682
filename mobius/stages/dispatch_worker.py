"""The dispatched schedule's part of the worker process (``--schedule dispatched``): one process
drives every device of the box, a thread each (:mod:`mobius.stages.dispatch`), so the host's
pieces are one store every device loads from; the process itself, its start-up, checkpoints and
signals are :mod:`mobius.runtime.worker`'s, and its checkpoint shards, exports and restore are the
bound pipeline's (:mod:`mobius.stages.worker`), piece by piece.  With data-parallel replicas
(``--data-parallel D``, emulated boxes) there is one such process per box."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mobius.boundary.errors import InputError
from mobius.data.preference import PreferenceBatches, evaluation_of, held_out_sums, prepare_references, reference_files
from mobius.metrics import Evaluation, StepMetrics
from mobius.models.preference import metric_sums, step_metrics
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import open_device
from mobius.runtime.emulation import EmulatedLinks
from mobius.runtime.inputs import model_config_for
from mobius.runtime.optim import UpdateRule
from mobius.runtime.worker import (
    Decision,
    Finished,
    WorkerContext,
    WorkerPayload,
    WorkerResult,
    collective_timeout_s,
    run_worker,
)
from mobius.stages.dispatch import build_dispatched
from mobius.stages.replicas import ReplicaGroup, ReplicaLayout
from mobius.stages.worker import PipelineReport, checkpoint_files, export, restore


def worker_main(payload: WorkerPayload, decision: Decision | None = None) -> WorkerResult:
    """Entry point of the dispatched schedule's process (:func:`mobius.runtime.worker.run_worker`)."""
    return run_worker(payload, DispatchedWorker, decision)


class DispatchedWorker:
    """:class:`~mobius.runtime.worker.WorkerBackend` of the dispatched schedule: every device of
    the box, the pieces' store, their checkpoint shards and exports."""

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.cfg, spec = ctx, ctx.cfg, ctx.spec
        pipe = spec.setup
        if ctx.world != pipe.data_parallel:
            raise InputError(f"the dispatched schedule drives every GPU of a box from one process, but {ctx.world} "
                             f"were started for {pipe.data_parallel} boxes: run it with python -m mobius.train, "
                             "not torchrun")
        n = len(spec.budget_bytes)
        self.layout = ReplicaLayout.of_rank(ctx.rank, ctx.world, pipe.data_parallel)  # a process a box
        # The worker's own device is its box's GPU 0; the others open here, each with its emulated link.
        first = spec.first_gpu(ctx.rank)
        devices = [ctx.device] + [open_device(spec.cuda, g, spec.enforced_budget(first + g),
                                              EmulatedLinks(spec.emulation, first + g) if spec.emulation else None)
                                  for g in range(1, n)]
        replicas = ReplicaGroup.join(self.layout, 0, ctx.device, ctx.trace, broadcasts_apart=True) \
            if pipe.data_parallel > 1 else None
        batches, self.held_out = ctx.data
        self.runner = build_dispatched(ctx.cfg, model_config_for(ctx.cfg), pipe.dispatched, spec.precision, devices,
                                       list(spec.budget_bytes), batches, ctx.trace, collective_timeout_s(spec),
                                       replicas, pipe.plan.device_adam_params_per_s)
        for d in devices[1:]:
            d.start_steps()
        self.store = self.runner.store
        self.scaler = self.runner.updates.scaler  # fp16's: the steps' votes update it, a checkpoint keeps it
        self.evaluates = self.held_out is not None
        self.peak_bytes_max = 0
        self._began: dict[int, float] = {}  # step -> when it was handed out (time.perf_counter)
        self._finished = 0.0  # when the last step settled had its last update in (time.perf_counter)
        prepare_references(batches, self.held_out, ck.resumed_checkpoint(ctx.cfg),
                           lambda micro: self.runner.evaluate(micro, 0),
                           dist.all_reduce if self.layout.count > 1 else None)

    def step(self, step: int) -> StepMetrics:
        """The step's loss as soon as the head has it (every replica's share summed); its traffic
        and peak memory: what the devices did since the last step returned (the steps overlap).
        What its updates decide, and its time, :meth:`settle` fills in once they are in."""
        cfg, workers = self.cfg, self.runner.workers
        for w in workers:
            w.traffic.reset()
            w.memory.reset_peak()
        t0 = self._began[step] = time.perf_counter()
        loss = self.runner.step(step)
        pairs = isinstance(self.runner.batches, PreferenceBatches)
        found = metric_sums(self.runner.micro).tolist() if pairs else []
        stats = self._summed([loss, *(sum(getattr(w.traffic, k) for w in workers) for k in ("h2d", "d2h", "peer")),
                              *found])
        peak = int(self._summed([max(w.memory.peak for w in workers)], dist.ReduceOp.MAX)[0])
        self.peak_bytes_max = max(self.peak_bytes_max, peak)
        return StepMetrics(step=step, loss=stats[0], lr=UpdateRule.of(cfg.optim).lr_at(step),
                           tokens=self.runner.batches.step_tokens(step),
                           step_time_s=time.perf_counter() - t0, h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]),
                           peer_bytes=int(stats[3]), peak_device_bytes=peak,
                           preference=step_metrics(stats[4:], self.runner.micro[0].layout.pairs.step_pairs)
                           if pairs else None)

    def settle(self, m: StepMetrics) -> StepMetrics:
        """Step ``m``'s metrics once its updates are in (called after the next step is handed
        out, or before the run stops, saves or evaluates): its gradient norm, fp16 loss scale and
        skipped steps as its decision left them, and its time from the end of the step before (or
        its own start, where the devices waited for it) to its last update, as the plan predicts a
        step (a step that redoes its updates takes the redo in its own time, not the next one's)."""
        finished, decided = self.runner.updates.settled(m.step)
        began = self._began.pop(m.step)
        m.step_time_s = finished - max(began, self._finished)
        self._finished = finished
        m.grad_norm, m.loss_scale, m.skipped_steps = decided.grad_norm, decided.loss_scale, decided.skipped_steps
        return m

    def _summed(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """``values`` over the replicas (as they are with one)."""
        if self.layout.count == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def evaluate(self, done: int) -> Evaluation:
        local = sum(self.runner.evaluate(self.held_out.pass_batches(k), done) for k in range(self.held_out.passes))
        return evaluation_of(self._summed([local, *held_out_sums(self.held_out)]), self.held_out)

    def drain(self) -> None:
        self.runner.drain()

    def checkpoint_files(self, done: int) -> dict[str, dict[str, torch.Tensor]]:
        kept = reference_files(self.runner.batches, self.held_out) if self.ctx.rank == 0 else {}
        return {**checkpoint_files(self.store, done, layout=self.layout), **kept}

    def restore(self, ckpt: ck.Checkpoint) -> None:
        restore(self.store, ckpt)
        self.runner.resume_at(ckpt.step)

    def finish(self) -> Finished:
        if self.layout.index == 0:  # every replica holds the same weights
            export(self.store, self.ctx.payload.exports)
        report = PipelineReport(self.ctx.spec.budget_bytes[0], self.peak_bytes_max, self.store.host_bytes())
        weights = {n: w for p in self.store.stages for n, w in self.store.stage_state_dict(p).items()} \
            if self.ctx.payload.return_weights else None
        return Finished(report, weights)

    def close(self) -> None:
        self.runner.close()
