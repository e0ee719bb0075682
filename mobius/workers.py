"""What every worker process does the same way, whichever backend it runs."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mobius.metrics import Trace, write_trace


def agree(want_stop: bool, want_save: bool) -> tuple[bool, bool]:
    """Every worker stops or saves after the same step: any worker's request counts for all."""
    flags = torch.tensor([float(want_stop), float(want_save)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def share_cpu_cores(world: int) -> None:
    """CPU workers standing in for GPUs split the machine's cores between them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def gather_trace(trace: Trace, path: str | None, rank: int, world: int) -> None:
    """Rank 0 writes every worker's events into one Chrome trace (pid = worker)."""
    events = [None] * world if rank == 0 else None
    dist.gather_object(trace.events, events, dst=0)
    if rank == 0 and path:
        write_trace(path, [e for evs in events for e in evs])
