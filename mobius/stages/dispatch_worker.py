"""The dispatched schedule's part of the worker process (``--schedule dispatched``): one process
drives every device of the box, a thread each (:mod:`mobius.stages.dispatch`), so the host's
pieces are one store every device loads from; the process itself, its start-up, checkpoints and
signals are :mod:`mobius.runtime.worker`'s, and its checkpoint shards, exports and restore are the
bound pipeline's (:mod:`mobius.stages.worker`), piece by piece."""

from __future__ import annotations

import time

import torch

from mobius.boundary.errors import InputError
from mobius.metrics import StepMetrics
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import open_device
from mobius.runtime.emulation import EmulatedLinks
from mobius.runtime.inputs import model_config_for
from mobius.runtime.optim import DynamicLossScaler, UpdateRule
from mobius.runtime.worker import (
    Decision,
    WorkerContext,
    WorkerPayload,
    WorkerResult,
    collective_timeout_s,
    run_worker,
)
from mobius.stages.dispatch import build_dispatched
from mobius.stages.worker import checkpoint_files, export, restore


def worker_main(payload: WorkerPayload, decision: Decision | None = None) -> WorkerResult:
    """Entry point of the dispatched schedule's process (:func:`mobius.runtime.worker.run_worker`)."""
    return run_worker(payload, DispatchedWorker, decision)


class DispatchedWorker:
    """:class:`~mobius.runtime.worker.WorkerBackend` of the dispatched schedule: every device of
    the box, the pieces' store, their checkpoint shards and exports."""

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.cfg, spec = ctx, ctx.cfg, ctx.spec
        if ctx.world != 1:
            raise InputError(f"the dispatched schedule drives every GPU from one process, but {ctx.world} were "
                             "started: run it with python -m mobius.train, not torchrun")
        n = len(spec.budget_bytes)
        # The worker's own device is GPU 0; the others open here, each with its emulated link.
        devices = [ctx.device] + [open_device(spec.cuda, g, spec.enforced_budget(g),
                                              EmulatedLinks(spec.emulation, g) if spec.emulation else None)
                                  for g in range(1, n)]
        batches, self.held_out = ctx.data
        self.runner = build_dispatched(ctx.cfg, model_config_for(ctx.cfg), spec.dispatched, spec.precision, devices,
                                       list(spec.budget_bytes), batches, ctx.trace, collective_timeout_s(spec))
        for d in devices[1:]:
            d.start_steps()
        self.store = self.runner.store
        self.scaler = DynamicLossScaler(enabled=False)  # fp16 is refused (check_dispatched)
        self.evaluates = self.held_out is not None
        self.peak_bytes_max = 0

    def step(self, step: int) -> StepMetrics:
        """The step's loss as soon as the head has it; its traffic and peak memory: what the devices
        did since the last step returned (the steps overlap)."""
        cfg, workers = self.cfg, self.runner.workers
        for w in workers:
            w.traffic.reset()
            w.memory.reset_peak()
        t0 = time.perf_counter()
        loss = self.runner.step(step)
        peak = max(w.memory.peak for w in workers)
        self.peak_bytes_max = max(self.peak_bytes_max, peak)
        return StepMetrics(step=step, loss=loss, lr=UpdateRule.of(cfg.optim).lr_at(step),
                           tokens=cfg.batch.micro_batches * cfg.batch.micro_batch_size * cfg.batch.seq_len,
                           step_time_s=time.perf_counter() - t0, h2d_bytes=sum(w.traffic.h2d for w in workers),
                           d2h_bytes=sum(w.traffic.d2h for w in workers),
                           peer_bytes=sum(w.traffic.peer for w in workers), peak_device_bytes=peak,
                           grad_norm=self.runner.grad_norm)

    def evaluate(self, done: int) -> float:
        return sum(self.runner.evaluate(self.held_out.pass_batches(k), done) for k in range(self.held_out.passes))

    def drain(self) -> None:
        self.runner.drain()

    def checkpoint_files(self, done: int) -> dict[str, dict[str, torch.Tensor]]:
        return checkpoint_files(self.store, done)

    def restore(self, ckpt: ck.Checkpoint) -> None:
        restore(self.store, ckpt)
        self.runner.resume_at(ckpt.step)

    def finish(self) -> dict:
        export(self.store, self.ctx.payload.exports)
        out = {"budget_bytes": self.ctx.spec.budget_bytes[0], "peak_bytes_max": self.peak_bytes_max,
               "host_bytes": self.store.host_bytes()}
        if self.ctx.payload.return_weights:
            out["weights"] = {n: w for p in self.store.stages for n, w in self.store.stage_state_dict(p).items()}
        return out

    def close(self) -> None:
        self.runner.close()
