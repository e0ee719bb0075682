"""What the pipeline runtime itself costs on this machine, measured by running it: the
cost model's per-micro-batch work ``o``, per-stage-switch work ``w`` and hand-off ``h`` of an
activation between two workers.  The layer profile cannot see them: they are the runtime's own work
(stream and sender threads, gloo, events, memory accounting, Python), not the layers'.

* :func:`time_calibration_runs` starts two CPU workers as processes over gloo, as a rehearsal
  does, and times the real runtime on a tiny model in few and in many stages, for few and for many
  micro-batches: the runtime's own work is most of those steps.
* :func:`fit_runtime_costs` finds the ``o``, ``w`` and ``h`` with which the cost model
  (:func:`~mobius.partition.cost.settle`, on the calibration model's measured profile) predicts
  those four step times best.  (Measured with one worker alone, ``o`` came out 4x smaller than a
  two-worker run shows: the messages between workers' processes are most of it.)
* :func:`measure_handoff` times gloo alone, for the part of a hand-off that grows with the message.

Starting two processes (an interpreter, torch, gloo) is most of the calibration's time: a run that
will need it starts it early (:func:`started_early`), while it reads its data, and takes its times
before it profiles anything, so that neither measurement shares the cores with the other.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mobius.boundary.janitor import scratch_dir, temporary_files_in
from mobius.config import RunConfig
from mobius.data import BatchSource
from mobius.launcher import start_worker_server
from mobius.mapping import cross_map
from mobius.metrics import Trace
from mobius.models import get_config, layer_count
from mobius.partition.baselines import uniform_bounds
from mobius.partition.cost import settle, stage_costs
from mobius.partition.profile import Profile, analytic_profile, measure_profile
from mobius.runtime.device import CpuDevice, cpu_threads_per_worker
from mobius.runtime.spec import PipelineSetup, Plan, RunSpec, StagePlan
from mobius.runtime.worker import Inherited, outside_torchrun, tied_to_launcher
from mobius.signals import signals_deferred
from mobius.stages.transport import GlooTransport, on_threads
from mobius.stages.worker import build_worker
from topology import cpu_topology

CALIBRATION_VERSION = 3  # part of the cached results' key: a changed measurement is made again
# The calibration model: ten layers (embedding, eight blocks, head) that cost little, so the
# runtime's own work is much of each step.
MODEL, SEQ_LEN, MICRO_BATCH = "tiny8", 16, 1
WORKERS = 2  # a hand-off needs two
FEW, MANY = 2, 12  # micro-batches per step
STEPS = 4  # per configuration; the first warms up, the fastest of the rest counts (noise only adds)
CORPUS_TOKENS = 4096  # random byte tokens: what the steps cost does not depend on the text
HANDOFF_REPEATS = 15
POLL_S = 0.02  # how often the calibration's owner looks for its workers' times
FIT_STEPS = 6  # Gauss-Newton steps at most
SEARCH_ROUNDS = 8


def calibration_configs() -> list[tuple[int, int]]:
    """(stages, micro-batches) of the calibration runs: one stage per worker and one per layer."""
    return [(s, m) for s in (WORKERS, layer_count(get_config(MODEL))) for m in (FEW, MANY)]


def _plan(stages: int, micro_batches: int) -> Plan:
    profile = analytic_profile(MODEL, get_config(MODEL), MICRO_BATCH, SEQ_LEN, 1.0, "fp32")
    costs = stage_costs(profile, uniform_bounds(profile.n, stages), recompute=False)
    return Plan(model=MODEL, topology="calibration", micro_batch_size=MICRO_BATCH, micro_batches=micro_batches,
                seq_len=SEQ_LEN, precision="fp32", recompute=False, partitioner="calibration",
                bounds=[(c.start, c.end) for c in costs], order=list(range(WORKERS)), contention=0.0,
                predicted_step_s=0.0,
                stages=[StagePlan(j, (c.start, c.end), j % WORKERS, c.param_bytes, 0.0, 0.0, 0.0, 0.0, c.mem_fwd,
                                  c.mem_bwd, c.grad_bytes) for j, c in enumerate(costs)])


def _worker(rank: int, port: int, threads: int, steps: int, out: str, parent: int, inherited: Inherited) -> None:
    """One calibration worker process: every configuration in turn; a step takes as long as the
    slower worker, and rank 0 writes each configuration's fastest step to ``out``.  Signals are
    the launcher's to handle: it ends us, and we end with it (``parent``), in its environment."""
    inherited.adopt()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with tied_to_launcher(parent):
        _calibrate(rank, port, threads, steps, out)


def _calibrate(rank: int, port: int, threads: int, steps: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fastest = {}
        corpus = np.random.default_rng(0).integers(0, 256, CORPUS_TOKENS, dtype=np.uint8)
        for stages, micro_batches in calibration_configs():
            cfg = RunConfig.of(model=MODEL, topology="cpu", cpu_workers=WORKERS, steps=steps, seq_len=SEQ_LEN,
                               micro_batch_size=MICRO_BATCH, micro_batches=micro_batches, recompute="off",
                               precision="fp32", progress=False)
            spec = RunSpec(False, "fp32", (2**31,) * WORKERS, PipelineSetup(_plan(stages, micro_batches)))
            batches = BatchSource(corpus, SEQ_LEN, MICRO_BATCH, micro_batches, cfg.optim.seed)
            parts = build_worker(cfg, spec, GlooTransport(), CpuDevice(check=False), Trace(enabled=False),
                                 (batches, None))
            times = []
            try:
                for k in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    parts.runner.step(k)
                    took = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    times.append(took.item())
            finally:
                parts.close()
            fastest[f"{stages},{micro_batches}"] = min(times[1:])
        dist.barrier()  # both workers are done: the times are complete once written
        if rank == 0:
            written = Path(out).with_suffix(".partial")
            written.write_text(json.dumps(fastest))
            written.replace(out)
    finally:
        dist.destroy_process_group()


class CalibrationRuns:
    """The calibration's two worker processes, started now (over gloo, ``threads`` threads each: a
    rehearsal's workers' share of the cores); :meth:`times` waits for their fastest steps."""

    def __init__(self, threads: int, steps: int = STEPS, retries: int = 1):
        self._threads, self._steps, self._retries = threads, steps, retries
        self._done = contextlib.ExitStack()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp = self._done.enter_context(scratch_dir("mobius-calibration-"))
        self._out = Path(tmp) / "times.json"
        start_worker_server()  # the run's workers are forked from the same server
        try:
            # A signal while they start is handled once they are ours to kill: a worker left running
            # would write into the directory just removed (and print its traceback).
            with signals_deferred():
                # (rank 0 of a torchrun plans: its workers rendezvous afresh)
                with outside_torchrun(), temporary_files_in(tmp):  # torch's error files: ours to remove
                    self._context = mp.start_processes(_worker, args=(port, threads, steps, str(self._out),
                                                                      os.getpid(), Inherited.now()),
                                                       nprocs=WORKERS, start_method="forkserver", join=False)
                self._done.callback(self._kill)
        except BaseException:
            self._done.close()
            raise
        self._times: dict[tuple[int, int], float] | None = None

    def _kill(self) -> None:
        """Done (their times written), interrupted or abandoned: the workers go now, not when they
        finish (multiprocessing would wait), all of them before any is waited for (a worker that
        outlives its peer fails on the lost connection)."""
        for process in self._context.processes:
            if process.is_alive():
                process.kill()
        for process in self._context.processes:
            process.join()

    def times(self) -> dict[tuple[int, int], float]:
        """The fastest step of each calibration configuration (waits for the workers to write them)."""
        if self._times is None:
            try:
                with self._done:
                    self._times = joined(self._context, self._out)
            except mp.ProcessExitedException as err:  # a worker killed before the times were written
                if not (err.signal_name and self._retries):
                    raise
                self._times = CalibrationRuns(self._threads, self._steps, self._retries - 1).times()
        return self._times

    def close(self) -> None:
        self._done.close()


def joined(context: mp.ProcessContext, out: Path) -> dict[tuple[int, int], float]:
    """The times the workers of ``context`` wrote to ``out``, as soon as they are there: rank 0
    writes them (whole, by a rename) only after both workers' last step, so what is left of the
    workers then is their teardown, which their owner kills rather than waits for (most of a second
    of a process group's and an interpreter's shutdown).  Once written, the times are the result,
    whatever a worker does after: one lost before is the run's error.  (Rarely, on a loaded machine,
    a worker has aborted in native code: ``terminate called without an active exception``.)"""
    try:
        while not out.exists() and not context.join(timeout=POLL_S):
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        if not out.exists():
            raise
    found = json.loads(out.read_text())
    return {tuple(int(x) for x in key.split(",")): t for key, t in found.items()}


# Runs started ahead of their use, by threads per worker (:func:`started_early`).
_EARLY: dict[int, CalibrationRuns] = {}


@contextlib.contextmanager
def started_early(threads: int):
    """Within the block the calibration with ``threads`` threads a worker runs in the background, for
    :func:`time_calibration_runs` to take; left unused, it is stopped when the block ends."""
    _EARLY[threads] = runs = CalibrationRuns(threads)
    try:
        yield
    finally:
        _EARLY.pop(threads, None)
        runs.close()


def finish_early() -> None:
    """Waits for the runs started early: what is timed next must not share the cores with them."""
    for runs in _EARLY.values():
        runs.times()


def time_calibration_runs(threads: int, steps: int = STEPS) -> dict[tuple[int, int], float]:
    """The fastest step of each calibration configuration, two worker processes over gloo with
    ``threads`` threads each; those started early are taken when there are (the same ``steps``)."""
    runs = _EARLY.pop(threads, None) if steps == STEPS else None
    return (runs or CalibrationRuns(threads, steps)).times()


def predicted_times(profile: Profile, costs: tuple[float, float, float],
                    configs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """The cost model's step time of each calibration configuration with ``(o, w, h)``."""
    o, w, h = costs
    host = replace(profile.host, micro_batch_s=o, stage_switch_s=w, handoff_s=h)
    topo = cpu_topology(WORKERS)
    out = {}
    for stages, micro_batches in configs:
        _, est = settle(profile, uniform_bounds(profile.n, stages), topo, cross_map(topo, stages), micro_batches,
                        False, True, host)
        out[(stages, micro_batches)] = est.step_s
    return out


def fit_runtime_costs(profile: Profile, measured: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """``(o, w, h)`` >= 0 minimising the squared relative misses of the cost model on the
    calibration runs.  The model is piecewise linear in them: Gauss-Newton steps, each a least
    squares on the model's slopes around the current point, over the subsets of costs left free
    (a cost held at zero is one too small to see); then a coordinate search on a log scale, for
    where a step crosses a change of the critical path."""
    configs = list(measured)
    target = torch.tensor([measured[c] for c in configs], dtype=torch.float64)
    costs = torch.full((3,), 1e-4, dtype=torch.float64)

    seen: dict[tuple[float, ...], torch.Tensor] = {}  # the search comes back to points: each costs 4 settles

    def times(x: torch.Tensor) -> torch.Tensor:
        key = tuple(x.tolist())
        if key not in seen:
            got = predicted_times(profile, key, configs)
            seen[key] = torch.tensor([got[c] for c in configs], dtype=torch.float64)
        return seen[key]

    def miss(x: torch.Tensor) -> float:
        return float(((times(x) / target - 1) ** 2).sum())

    for _ in range(FIT_STEPS):
        base = times(costs)
        deltas = torch.eye(3, dtype=torch.float64) * costs.clamp(min=1e-4) * 0.1
        slopes = torch.stack([(times(costs + d) - base) / d[i] for i, d in enumerate(deltas)], dim=1)
        # Relative misses, linear in the costs around here: (base + slopes (x - costs)) / target - 1.
        a = slopes / target[:, None]
        b = 1 - (base - slopes @ costs) / target
        candidates = []
        for free in range(1, 8):
            keep = [i for i in range(3) if free >> i & 1]
            x = torch.zeros(3, dtype=torch.float64)
            x[keep] = torch.linalg.lstsq(a[:, keep], b[:, None]).solution[:, 0]
            if (x >= 0).all():
                candidates.append(x)
        step = min(candidates, key=miss, default=costs)
        if miss(step) >= miss(costs) * (1 - 1e-3):
            break
        costs = step
    # Where the critical path changes the slopes do not hold: a coordinate search finishes it.
    best, best_miss, factor = costs.tolist(), miss(costs), [2.0, 2.0, 2.0]
    for _ in range(SEARCH_ROUNDS):
        for i in range(3):
            for trial_value in (best[i] * factor[i], best[i] / factor[i], 0.0, 1e-4):
                trial = list(best)
                trial[i] = trial_value
                m = miss(torch.tensor(trial, dtype=torch.float64))
                if m < best_miss:
                    best, best_miss = trial, m
                    break
            else:
                factor[i] = factor[i] ** 0.5
    return tuple(best)


def calibration_bytes() -> int:
    """The calibration model's boundary activation (fp32)."""
    return MICRO_BATCH * SEQ_LEN * get_config(MODEL).hidden * 4


def measure_runtime_costs(workers: int) -> dict[str, float]:
    """``micro_batch_s``, ``stage_switch_s`` and ``handoff_s`` (of :func:`calibration_bytes`) of CPU
    workers with the threads of one of ``workers`` sharing this machine's cores."""
    profile = measure_profile(MODEL, get_config(MODEL), MICRO_BATCH, SEQ_LEN, "fp32", workers=workers)
    o, w, h = fit_runtime_costs(profile, time_calibration_runs(cpu_threads_per_worker(workers)))
    return {"micro_batch_s": o, "stage_switch_s": w, "handoff_s": h}


def measure_handoff(nbytes: int) -> float:
    """Seconds for ``nbytes`` to go from one gloo endpoint to another on this host (the median
    one-way time of a round trip).  Both endpoints live in this process, on two threads; gloo
    moves the bytes over the same loopback sockets as between two worker processes."""
    store = dist.HashStore()
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    on_threads(join, (0, 1))
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

    on_threads(echo, (0, 1))
    return statistics.median(one_way[1:])
