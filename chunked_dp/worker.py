"""One chunked-DP worker process, started by the same elastic launcher as the pipeline."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from chunked_dp.engine import ChunkedEngine
from chunked_dp.setup import ChunkedSetup
from mobius import checkpoint as ck
from mobius.config import RunConfig
from mobius.metrics import Trace
from mobius.optim import DynamicLossScaler
from mobius.precision import DTYPES
from mobius.runtime.device import open_device
from mobius.runtime.emulation import EmulatedLinks, EmulationSpec
from mobius.runtime.inputs import model_config_for, worker_data
from mobius.runtime.loop import run_steps
from mobius.runtime.spec import RunSpec
from mobius.workers import (
    agree,
    gather_trace,
    install_stop,
    share_cpu_cores,
    tied_to_launcher,
)

COLLECTIVE_TIMEOUT_S = 60


def worker_main(payload: dict) -> dict:
    with tied_to_launcher(payload):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cuda = payload["spec"]["cuda"]
        # On GPUs the collectives of device chunks go through NCCL, those of offloaded chunks (host
        # memory) through gloo: NCCL has no CPU tensors.
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s(payload["spec"])))
        try:
            return _run(payload, rank, world, cuda)
        finally:
            dist.destroy_process_group()


def collective_timeout_s(spec: dict) -> float:
    """Under ``--emulate`` a worker may legitimately wait several dilated steps for a peer."""
    if not spec.get("emulation"):
        return COLLECTIVE_TIMEOUT_S
    return COLLECTIVE_TIMEOUT_S + 3 * spec["emulation"]["factor"] * spec["chunked"]["predicted"]["step"]


def _run(payload: dict, rank: int, world: int, cuda: bool) -> dict:
    cfg = RunConfig.from_dict(payload["cfg"])
    spec = RunSpec.from_dict(payload["spec"])
    emulation = EmulatedLinks(EmulationSpec.from_dict(spec.emulation), rank) if spec.emulation else None
    device = open_device(cuda, int(os.environ.get("LOCAL_RANK", 0)), emulation=emulation)
    share_cpu_cores(world)  # CPU workers compute on them; GPU workers step offloaded chunks there
    trace = Trace(enabled=bool(cfg.trace), pid=rank)
    trace.set_origin(payload.get("t_origin", time.perf_counter()))
    model_config = model_config_for(cfg)
    setup = ChunkedSetup.from_dict(spec.chunked)
    engine = ChunkedEngine(model_config, rank, world, device, setup.chunk_size, setup.n_block, setup.offload,
                           setup.device_chunks, DTYPES[spec.precision], cfg.seed, cfg.lr, cfg.steps, trace,
                           prefetch=cfg.chunk_prefetch, group=setup.group, timing=setup.timing)
    batches, held_out = worker_data(cfg, model_config, payload.get("data"))
    device.start_steps()
    stop = install_stop(payload)
    start = 0
    if cfg.resume:
        ckpt = ck.load_checkpoint(cfg.resume, verify=False)  # each file checked as it is read
        engine.load(ckpt)
        ck.restore_rng(ckpt)
        start = ckpt.step

    def save(done: int) -> None:
        """Full tensors by name (all-gathered), written by rank 0: any backend can resume them."""
        weights, optim = engine.state_dict(), engine.optimizer_state()
        if rank == 0:
            staging = ck.begin_save(cfg.save)
            ck.write_tensors(staging, "weights.safetensors", weights)
            ck.write_tensors(staging, "optimizer.safetensors", optim)
            ck.write_tensors(staging, "rng.safetensors", ck.rng_tensors())
            ck.finish_save(cfg.save, staging, ck.run_meta(cfg, model_config.to_dict(), done, DynamicLossScaler(False),
                                                         payload.get("inputs")))
        dist.barrier()

    header = payload["header"] + (f", resuming at step {start}" if start else "")
    evaluate = (lambda done: engine.evaluate(held_out)) if held_out is not None else None

    def one_step(step: int):
        m = engine.step(step, batches)
        if emulation is not None:
            m.emulated_step_s = m.step_time_s / emulation.factor
        return m

    history = run_steps(cfg, one_step, header, start_step=start, save_fn=save,
                        stop=stop, agree=agree, main=rank == 0, eval_fn=evaluate)
    engine.close()
    gather_trace(trace, cfg.trace, rank, world)
    weights = engine.state_dict() if payload.get("return_weights") else None
    return {"rank": rank, "history": [m.__dict__ for m in history] if rank == 0 else None, "weights": weights,
            "counters": engine.counters.__dict__, "chunks": len(engine.chunks), "chunk_size": engine.chunks[0].size}
