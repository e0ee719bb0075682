"""Data-parallel replicas of the pipeline, with the host optimizer sharded across them (ZeRO stage 1:
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).

``--data-parallel D`` runs D copies of the pipeline, each on its own workers (under ``torchrun``,
one node each), each on M/D of the step's M micro-batches.  The workers at one pipeline position
in every replica hold the same stages and form one process group.  Each trained parameter has
one owner among them, chosen to balance what each replica's host updates.  After a stage's
backward its gradients are summed into their owners (``reduce``); each owner steps AdamW on its
parameters only, so each host holds and updates about 1/D of the optimizer state; the updated
weights are broadcast back.  A replica's gradient is a sum over its micro-batches of losses
divided by the whole step's tokens, so the sum over replicas is the reference trainer's gradient;
AdamW is elementwise, so which host updates a parameter changes no number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mobius.metrics import Trace
from mobius.partition.cost import exchanged_bytes
from mobius.runtime.device import Device
from mobius.swap.store import HostStage


@dataclass(frozen=True)
class ReplicaLayout:
    """Replica ``index`` of ``count``, each of ``workers`` pipeline workers.  Process ranks run
    replica by replica: position ``p`` of replica ``d`` is rank ``d * workers + p``."""

    index: int = 0
    count: int = 1
    workers: int = 1

    @classmethod
    def of_rank(cls, rank: int, world: int, count: int) -> "ReplicaLayout":
        return cls(rank // (world // count), count, world // count)

    def rank_of(self, position: int, replica: int | None = None) -> int:
        return (self.index if replica is None else replica) * self.workers + position

    def share(self, micro: list) -> list:
        """This replica's micro-batches of a step's ``micro``: the ``index``-th contiguous 1/count."""
        n = len(micro) // self.count
        return micro[self.index * n:(self.index + 1) * n]


def owners(sizes: dict[str, int], count: int) -> dict[str, int]:
    """Each parameter's owner replica: the largest first, each to the replica with the fewest
    elements so far (ties: the lower index).  A pure function of the names and sizes, so every
    replica computes the same."""
    load = [0] * count
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        replica = min(range(count), key=lambda r: (load[r], r))
        out[name] = replica
        load[replica] += sizes[name]
    return out


class ReplicaGroup:
    """The collectives between this worker and the workers at its pipeline position in the other
    replicas: gradients summed into their owners, updated weights broadcast from them (gloo, on
    host tensors, from the optimizer thread; the main thread's messages use the default group).
    Where the sums and the broadcasts are issued by two threads (the dispatched schedule's), each
    has a group of its own: a group's collectives must come in the same order on every replica."""

    def __init__(self, layout: ReplicaLayout, position: int, group, device: Device, trace: Trace,
                 broadcasts=None):
        self.layout, self.position, self.group, self.device, self.trace = layout, position, group, device, trace
        self.broadcasts = broadcasts or group
        self.owner: dict[str, int] = {}

    @classmethod
    def join(cls, layout: ReplicaLayout, position: int, device: Device, trace: Trace,
             broadcasts_apart: bool = False) -> "ReplicaGroup":
        """Every process of the run calls this, in the same order: one group per pipeline position
        (torch.distributed makes each group with every rank taking part), and a second one for the
        broadcasts where ``broadcasts_apart``."""
        mine = None
        for p in range(layout.workers):
            ranks = [layout.rank_of(p, d) for d in range(layout.count)]
            groups = (dist.new_group(ranks), dist.new_group(ranks) if broadcasts_apart else None)
            if p == position:
                mine = groups
        return cls(layout, position, mine[0], device, trace, mine[1])

    def assign(self, sizes: dict[str, int], aliases: dict[str, str] | None = None) -> None:
        """The owners of this position's trained parameters (``sizes``: elements by name); an alias
        (``{alias: canonical}``: a tied table's second copy, held here too) is its canonical's."""
        aliases = aliases or {}
        self.owner = owners({n: k for n, k in sizes.items() if n not in aliases}, self.layout.count)
        self.owner.update({a: self.owner[c] for a, c in aliases.items() if a in sizes})

    def updates(self, name: str) -> bool:
        """Whether this replica's host updates parameter ``name``."""
        return self.owner[name] == self.layout.index

    def _root(self, name: str) -> int:
        return self.layout.rank_of(self.position, self.owner[name])

    def network_bytes(self, host: HostStage) -> int:
        """What one replica's network carries each way for one collective over stage ``host``."""
        return int(exchanged_bytes(host.master_grad.numel(), self.layout.count))

    def reduce_gradients(self, host: HostStage) -> None:
        """Sum stage ``host``'s master gradients over the replicas into each parameter's owner."""
        t0 = time.perf_counter()
        for name, p in host.trained():
            dist.reduce(p.grad, dst=self._root(name), op=dist.ReduceOp.SUM, group=self.group)
        self.device.network_time(self.network_bytes(host))
        self.trace.span(f"reduce {host.index}", "replicas", t0, time.perf_counter(),
                        bytes=host.master_grad.numel() * 4)

    def sum(self, value: float) -> float:
        """``value`` summed over the replicas (on the sums' group)."""
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return total.item()

    def broadcast_weights(self, host: HostStage) -> None:
        """Every replica's master weights of stage ``host`` as their owners updated them."""
        t0 = time.perf_counter()
        for name, p in host.trained():
            dist.broadcast(p.data, src=self._root(name), group=self.broadcasts)
        self.device.network_time(self.network_bytes(host))
        self.trace.span(f"broadcast {host.index}", "replicas", t0, time.perf_counter(), bytes=host.master.numel() * 4)
