"""What every worker process does the same way, whichever backend it runs."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mobius.metrics import Trace, write_trace
from mobius.runtime.device import cpu_threads_per_worker
from mobius.signals import StopRequest

PARENT_POLL_S = 0.5


@contextlib.contextmanager
def tied_to_launcher(payload: dict | None = None):
    """A worker must not outlive the process that started it, however that one dies (SIGKILL
    included): when this process is re-parented it kills itself.  The launcher is
    ``payload["launcher_pid"]``, not whoever is our parent by the time this runs: a launcher killed
    while we imported torch must not leave us running.  (Its temporary directories are the
    launcher's watcher's to remove: :mod:`mobius.janitor`.)"""
    parent = (payload or {}).get("launcher_pid") or os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mobius-parent-watch", daemon=True).start()
    yield


def install_stop(payload: dict) -> StopRequest:
    """This worker's stop request; from now on a signal stops training after a step, so the
    launcher is told that training has started."""
    stop = StopRequest(payload.get("stop_file"), announce=False).install()
    if payload.get("started_file"):
        Path(payload["started_file"]).touch()
    return stop


def agree(want_stop: bool, want_save: bool) -> tuple[bool, bool]:
    """Every worker stops or saves after the same step: any worker's request counts for all."""
    flags = torch.tensor([float(want_stop), float(want_save)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def share_cpu_cores(world: int) -> None:
    """The workers of one machine split its cores between them (CPU workers compute there, GPU
    workers step their optimizer there)."""
    torch.set_num_threads(cpu_threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", world))))


def gather_trace(trace: Trace, path: str | None, rank: int, world: int) -> None:
    """Rank 0 writes every worker's events into one Chrome trace (pid = worker)."""
    events = [None] * world if rank == 0 else None
    dist.gather_object(trace.collect(), events, dst=0)
    if rank == 0 and path:
        write_trace(path, [e for evs in events for e in evs])
