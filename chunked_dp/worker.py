"""The chunked engine's part of a worker process; the process itself, its start-up, checkpoints
and signals are :mod:`mobius.runtime.worker`'s, as for the pipeline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from chunked_dp.engine import ChunkedEngine
from mobius.data.preference import prepare_references, reference_files
from mobius.metrics import Evaluation, StepMetrics
from mobius.models.precision import DTYPES
from mobius.runtime import checkpoint as ck
from mobius.runtime.inputs import model_config_for
from mobius.runtime.optim import DynamicLossScaler, UpdateRule
from mobius.runtime.worker import Finished, WorkerContext, WorkerPayload, WorkerResult, run_worker


def worker_main(payload: WorkerPayload) -> WorkerResult:
    """Entry point of a chunked worker process (:func:`mobius.runtime.worker.run_worker`)."""
    return run_worker(payload, ChunkedWorker)


@dataclass(frozen=True)
class ChunkedReport:
    """What a chunked worker says of itself after its last step."""

    counters: dict  # the engine's traffic and cache counters of the last step
    chunks: int  # how many chunks
    chunk_size: int  # elements per chunk


class ChunkedWorker:
    """One data-parallel rank of the chunked engine (:class:`~mobius.runtime.worker.WorkerBackend`)."""

    def __init__(self, ctx: WorkerContext):
        cfg, spec = ctx.cfg, ctx.spec
        self.ctx = ctx
        setup = spec.setup
        self.engine = ChunkedEngine(model_config_for(cfg), ctx.rank, ctx.world, ctx.device, setup.chunk_size,
                                    setup.n_block, setup.offload, setup.device_chunks, DTYPES[spec.precision],
                                    cfg.optim.seed, UpdateRule.of(cfg.optim), ctx.trace,
                                    prefetch=cfg.chunked.prefetch,
                                    group=setup.group, timing=setup.timing)
        self.batches, self.held_out = ctx.data
        self.scaler = DynamicLossScaler(enabled=False)  # no fp16 loss scaling here
        self.evaluates = self.held_out is not None
        prepare_references(self.batches, self.held_out, ck.resumed_checkpoint(cfg), self.engine.forward_only,
                           dist.all_reduce)

    def step(self, step: int) -> StepMetrics:
        return self.engine.step(step, self.batches)

    def evaluate(self, done: int) -> Evaluation:
        return self.engine.evaluate(self.held_out)

    def drain(self) -> None:
        """Each chunk's update is done within its step."""

    def checkpoint_files(self, done: int) -> dict[str, dict[str, torch.Tensor]]:
        """Full tensors by name (all-gathered by every rank), written by rank 0: any backend can
        resume them."""
        weights, optim = self.engine.state_dict(), self.engine.optimizer_state()
        if self.ctx.rank != 0:
            return {}
        return {"weights.safetensors": weights, "optimizer.safetensors": optim,
                **reference_files(self.batches, self.held_out)}

    def restore(self, ckpt: ck.Checkpoint) -> None:
        self.engine.load(ckpt)

    def finish(self) -> Finished:
        engine = self.engine
        weights = engine.state_dict() if self.ctx.payload.return_weights else None
        return Finished(ChunkedReport(dict(engine.counters.__dict__), len(engine.chunks), engine.chunks[0].size),
                        weights)

    def close(self) -> None:
        self.engine.close()
