"""Emulated GPUs for CPU workers (``--emulate``): a rehearsal of a PCIe box this machine lacks, in
which the effects Mobius exists for (root-complex contention, prefetching, the partition) show in
the real runtime, not only in the cost model.

Each CPU worker stands for one GPU of the topology.  Time is *dilated* by one factor ``F`` for the
whole run: an emulated second lasts ``F`` wall seconds, so the real CPU work (which is much slower
than the GPU's) fits inside the emulated GPU time, and a step's wall time divided by ``F`` is the
emulated step time.

* Compute of a micro-batch on a stage lasts at least the GPU's profiled time (:meth:`compute_span`);
  a stage's AdamW update on the host at least its parameters over the emulated host's rate, the one
  its topology states (:meth:`host_update_span`), whatever rate the plan assumed: a plan made on a
  wrong rate shows here as it would on the box.
* A host<->device copy moves its bytes at the emulated link's rate, a fluid model recomputed every
  few milliseconds: the transfers of one direction under one root complex share its host bandwidth
  equally, *across worker processes*, and a GPU's own link caps its transfers (shared between its
  concurrent transfers of that direction).  The active transfers are counted in a small shared
  file, one slot per (worker, direction), written only by the worker that owns it.
* With data-parallel replicas (``--data-parallel D``) the workers emulate D such boxes, replica by
  replica, each box's root complexes its own.  What the replicas exchange (the gradients summed
  into their owners, the weights broadcast back: :mod:`mobius.stages.replicas`) crosses the box's
  network, shared by the box's workers' exchanges in flight, after the real collective.

Real tensors still flow: the losses equal an unemulated run's.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

DIRECTIONS = ("h2d", "d2h", "net", "disk-read", "disk-write")  # "net": a box's network to the other boxes
SLICE_S = 0.002  # wall seconds between re-reads of the sharing (the fluid model's time step)


@dataclass(frozen=True)
class EmulationSpec:
    """What every worker needs to emulate its GPU; part of the run's spec."""

    topology: str
    factor: float  # wall seconds per emulated second
    link_bps: tuple[float, ...]  # per worker (GPU): its own link, bytes per emulated second
    root_complex: tuple[int, ...]  # per worker: the root complex it hangs off
    rc_bps: dict  # root complex id (str) -> its host bandwidth, bytes per emulated second
    counters: str  # the shared file of active-transfer counters (made by the launcher)
    how: str = ""  # how the factor was decided (mobius.planning.pipeline.emulation_for)
    floor: float = 0.0  # the least factor this machine allows the run: its busiest worker's CPU work fits a step
    replicas: int = 1  # boxes emulated, each with the GPUs above: worker w of box d is rank d * len(link_bps) + w
    network: str = ""  # between the boxes (replicas > 1)
    network_bps: float = 0.0  # each box's link to it, bytes per emulated second each way
    host_adam_params_per_s: float = float("inf")  # one worker's optimizer thread on the emulated host
    disk_bps: tuple[float, float] = (float("inf"), float("inf"))  # the box's drives, read and write (--offload-dir)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EmulationSpec":
        return cls(**{**d, "link_bps": tuple(d["link_bps"]), "root_complex": tuple(d["root_complex"]),
                      "disk_bps": tuple(d.get("disk_bps", (float("inf"), float("inf"))))})

    def header(self, predicted_step_s: float, steps: int) -> str:
        """What the run emulates, at which factor, and the wall time that implies."""
        wall = self.factor * predicted_step_s
        boxes = f"{self.replicas} x {self.topology} over {self.network}" if self.replicas > 1 else self.topology
        return (f"emulating {boxes} at 1/{self.factor:g} speed ({self.how}; about {_duration(wall)} of wall "
                f"time a step, {_duration(wall * steps)} for {steps} steps)")


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def create_counters(path: str, workers: int) -> None:
    """The zeroed shared counter file (the launcher makes it in a temporary directory of its own)."""
    with open(path, "wb") as f:
        f.write(bytes(4 * workers * len(DIRECTIONS)))


class EmulatedLinks:
    """One worker's emulated GPU: its link, its root complex, its box's network and the clock
    dilation."""

    def __init__(self, spec: EmulationSpec, rank: int):
        self.spec, self.rank, self.factor = spec, rank, spec.factor
        n = len(spec.link_bps)
        self._counts = torch.from_file(spec.counters, shared=True, size=n * spec.replicas * len(DIRECTIONS),
                                       dtype=torch.int32)
        box, gpu = divmod(rank, n)
        rc = spec.root_complex[gpu]
        box_workers = [box * n + w for w in range(n)]
        self._peers = {"h2d": [r for r in box_workers if spec.root_complex[r % n] == rc]}
        self._peers["d2h"] = self._peers["h2d"]
        self._peers["net"] = self._peers["disk-read"] = self._peers["disk-write"] = box_workers  # the box's own
        self._cap = {"h2d": spec.link_bps[gpu], "d2h": spec.link_bps[gpu], "net": float("inf"),
                     "disk-read": float("inf"), "disk-write": float("inf")}
        self._shared = {"h2d": float(spec.rc_bps[str(rc)]), "d2h": float(spec.rc_bps[str(rc)]),
                        "net": spec.network_bps, "disk-read": spec.disk_bps[0], "disk-write": spec.disk_bps[1]}
        self._lock = threading.Lock()  # this worker's streams share its slots
        self._thread = threading.local()  # wall seconds this thread spent in transfers

    def _slot(self, worker: int, direction: str) -> int:
        return worker * len(DIRECTIONS) + DIRECTIONS.index(direction)

    def rate(self, direction: str) -> float:
        """Bytes per emulated second a transfer of ours gets now."""
        mine = max(1, int(self._counts[self._slot(self.rank, direction)]))
        sharing = max(1, sum(int(self._counts[self._slot(w, direction)]) for w in self._peers[direction]))
        return min(self._cap[direction] / mine, self._shared[direction] / sharing)

    def transfer(self, nbytes: int, direction: str, copy) -> None:
        """Run ``copy()`` (the real copy) and return when ``nbytes`` would have crossed the link."""
        slot = self._slot(self.rank, direction)
        began = time.perf_counter()
        with self._lock:
            self._counts[slot] += 1
        try:
            last, rate = time.perf_counter(), self.rate(direction)
            copy()
            remaining = float(nbytes)
            while True:  # each slice at the rate the sharing gave at its start
                now = time.perf_counter()
                remaining -= rate * (now - last) / self.factor
                last = now
                if remaining <= 0:
                    return
                rate = self.rate(direction)
                time.sleep(min(remaining / rate * self.factor, SLICE_S))
        finally:
            with self._lock:
                self._counts[slot] -= 1
            self._thread.in_transfers = self._in_transfers() + time.perf_counter() - began

    def exchange(self, nbytes: int) -> None:
        """Return when ``nbytes`` would have crossed the box's network (a collective between the
        replicas has just run for real: its wait for the slowest replica is not network time)."""
        self.transfer(nbytes, "net", lambda: None)

    def disk(self, nbytes: int, write: bool, io) -> None:
        """Run ``io()`` (the real read or write of the disk tier) and return when ``nbytes`` would
        have crossed the box's drives, which all its workers share."""
        self.transfer(nbytes, "disk-write" if write else "disk-read", io)

    def _in_transfers(self) -> float:
        return getattr(self._thread, "in_transfers", 0.0)

    def host_update_span(self, params: int):
        """A host AdamW update of ``params`` parameters lasts at least the emulated host's time."""
        return self.compute_span(params / self.spec.host_adam_params_per_s)

    @contextmanager
    def compute_span(self, emulated_s: float):
        """The body's compute lasts at least ``emulated_s`` of the emulated GPU's time; copies the
        body issues on the compute stream (an input's host -> device) come on top, as on a GPU."""
        start, copies = time.perf_counter(), self._in_transfers()
        yield
        left = start + (self._in_transfers() - copies) + emulated_s * self.factor - time.perf_counter()
        if left > 0:
            time.sleep(left)
