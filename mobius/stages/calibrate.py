"""What the pipeline runtime itself costs on this machine, measured by running it (issue 15): the
cost model's per-micro-batch and per-stage-switch overheads and the hand-off of an activation
between two workers.  The layer profile cannot see them: they are the runtime's own work (stream
hand-overs, events, memory accounting, Python), not the layers'.

* :func:`measure_runtime_overheads` runs the real :class:`~mobius.stages.schedule.StageRunner` of one
  CPU worker on a tiny model, its layers as one stage and as one stage each, for few and for many
  micro-batches.  Per extra micro-batch, each extra stage costs the runtime's work of one
  micro-batch in each pass (``o``); at a fixed count of micro-batches, the rest of what each extra
  stage costs is its switch (``w``: waiting for it, its working memory, its gradient buffer, its
  release).  The layers' own time cancels out of both differences.
* :func:`measure_handoff` sends an activation from one gloo endpoint to another and back: the host
  leg between two workers' processes (our GPUs have no peer-to-peer path), beyond the copies to and
  from the devices the cost model charges by bandwidth.
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time

import torch
import torch.distributed as dist

from mobius.config import RunConfig
from mobius.metrics import Trace
from mobius.models import get_config
from mobius.partition.baselines import uniform_bounds
from mobius.partition.cost import stage_costs
from mobius.partition.profile import analytic_profile
from mobius.runtime.device import CpuDevice, cpu_threads_per_worker
from mobius.runtime.spec import Plan, RunSpec, StagePlan
from mobius.stages.transport import LocalGroup
from mobius.stages.worker import build_worker

CALIBRATION_VERSION = 1  # part of the cached results' key: a changed measurement is made again
# The calibration model: ten layers (embedding, eight blocks, head) that cost little, so the
# runtime's own work is a large part of each step.
MODEL, SEQ_LEN, MICRO_BATCH = "tiny8", 16, 1
FEW, MANY = 2, 12  # micro-batches per step
STEPS = 5  # per configuration; the first warms up, the fastest of the rest counts (noise only adds)
ROUNDS = 3  # the median of this many estimates
HANDOFF_REPEATS = 15


def _plan(stages: int, micro_batches: int) -> Plan:
    profile = analytic_profile(MODEL, get_config(MODEL), MICRO_BATCH, SEQ_LEN, 1.0, "fp32")
    bounds = uniform_bounds(profile.n, stages)
    costs = stage_costs(profile, bounds, recompute=False)
    return Plan(model=MODEL, topology="calibration", micro_batch_size=MICRO_BATCH, micro_batches=micro_batches,
                seq_len=SEQ_LEN, precision="fp32", recompute=False, partitioner="calibration", bounds=bounds,
                order=[0], contention=0.0, predicted_step_s=0.0,
                stages=[StagePlan(j, (c.start, c.end), 0, c.param_bytes, 0.0, 0.0, 0.0, 0.0, c.mem_fwd, c.mem_bwd,
                                  c.grad_bytes) for j, c in enumerate(costs)])


def _step_s(stages: int, micro_batches: int) -> float:
    """The fastest step of one CPU worker running the calibration model in ``stages`` stages."""
    cfg = RunConfig(model=MODEL, topology="cpu", cpu_workers=1, steps=STEPS, seq_len=SEQ_LEN,
                    micro_batch_size=MICRO_BATCH, micro_batches=micro_batches, recompute="off", precision="fp32",
                    progress=False)
    spec = RunSpec("pipeline", False, "fp32", (2**31,), plan=_plan(stages, micro_batches).to_dict())
    parts = build_worker(cfg, spec, LocalGroup(1).endpoint(0), CpuDevice(check=False), Trace(enabled=False))
    times = []
    try:
        for k in range(STEPS):
            t0 = time.perf_counter()
            parts.runner.step(k)
            times.append(time.perf_counter() - t0)
    finally:
        parts.close()
    return min(times[1:])


def measure_runtime_overheads(workers: int) -> tuple[float, float]:
    """(``o``, ``w``): seconds of the runtime's own work per micro-batch per stage in each pass, and
    per stage switch in each pass, on one of ``workers`` CPU workers' share of the cores."""
    layers = analytic_profile(MODEL, get_config(MODEL), MICRO_BATCH, SEQ_LEN, 1.0, "fp32").n
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker(workers))
    estimates = []
    try:
        for _ in range(ROUNDS):
            t = {(s, m): _step_s(s, m) for s in (1, layers) for m in (FEW, MANY)}
            per_mb = {s: (t[(s, MANY)] - t[(s, FEW)]) / (MANY - FEW) for s in (1, layers)}
            fixed = {s: t[(s, FEW)] - FEW * per_mb[s] for s in (1, layers)}
            passes = 2 * (layers - 1)  # forward and backward of each extra stage
            estimates.append(((per_mb[layers] - per_mb[1]) / passes, (fixed[layers] - fixed[1]) / passes))
    finally:
        torch.set_num_threads(threads)
    # A cost is never negative; a negative estimate is noise around a cost too small to see.
    return (max(0.0, statistics.median(o for o, _ in estimates)),
            max(0.0, statistics.median(w for _, w in estimates)))


def measure_handoff(nbytes: int) -> float:
    """Seconds for ``nbytes`` to go from one gloo endpoint to another on this host (the median
    one-way time of a round trip).  Both endpoints live in this process, on two threads; gloo
    moves the bytes over the same loopback sockets as between two worker processes."""
    store = dist.HashStore()
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    _together(join)
    bufs = [torch.zeros(max(1, nbytes // 4)), torch.zeros(max(1, nbytes // 4))]
    one_way = []

    def echo(rank: int) -> None:
        pg, buf = groups[rank], bufs[rank]
        for i in range(HANDOFF_REPEATS):
            if rank == 0:
                t0 = time.perf_counter()
                pg.send([buf], 1, i).wait()
                pg.recv([buf], 1, i).wait()
                one_way.append((time.perf_counter() - t0) / 2)
            else:
                pg.recv([buf], 0, i).wait()
                pg.send([buf], 0, i).wait()

    _together(echo)
    return statistics.median(one_way[1:])


def _together(fn) -> None:
    """``fn(0)`` and ``fn(1)`` on two threads at once (each end of a gloo pair waits for the other)."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as err:  # re-raised on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
