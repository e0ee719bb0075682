"""Device memory accounting and traffic counters.

The per-device budget (``--gpu-mem-gb``, or a CPU worker's budget) is enforced by this accountant,
not by the allocator, so CPU workers standing in for GPUs obey the same limit a GPU would.

Two kinds of users share it:

* compute (stage parameters being used, gradients, activations): :meth:`allocate` never waits; an
  allocation past the budget is an error naming what did not fit;
* the prefetcher: :meth:`reserve_for_prefetch` waits until the bytes fit *beside the compute
  reservation* of the stage now running (its expected working memory, from the plan), so a
  prefetch never takes memory the current stage will need: this is the plan's
  ``P_j <= G - W_{j-N}`` (constraint 5) enforced at run time.
"""

from __future__ import annotations

import threading
from typing import Callable
from collections.abc import Iterable
from dataclasses import dataclass

import torch


class DeviceBudgetError(RuntimeError):
    """The accounted device memory would exceed the budget."""


class DeviceMemory:
    def __init__(self, budget_bytes: int, device_name: str = "device"):
        self.budget = int(budget_bytes)
        self.device_name = device_name
        self.used = 0
        self.peak = 0
        self.compute_reserve = 0  # bytes the running stage may still allocate
        self.phase = 0  # bumped by every set_compute_reserve: which stage-phase is computing
        self._compute_used = 0
        self.compute_peak_since_reserve = 0
        self.leaving = 0  # bytes an in-flight job (gradient offload) is about to free
        self._cond = threading.Condition()

    def _headroom(self) -> int:
        outstanding = max(0, self.compute_reserve - self._compute_used)
        return self.budget - self.used - outstanding

    def allocate(self, nbytes: int, what: str, for_good: bool = False) -> int:
        """Take ``nbytes`` for compute; returns the phase to hand back to :meth:`free`.  With
        ``for_good`` (a resident stage's gradients and optimizer state) the bytes are held for the
        run, not counted as the running stage's working memory."""
        with self._cond:
            # Gradients being offloaded leave on their own: wait for them rather than fail.
            while self.used + nbytes > self.budget and self.leaving > 0:
                self._cond.wait(timeout=0.5)
            if self.used + nbytes > self.budget:
                raise DeviceBudgetError(
                    f"{self.device_name}: {what} needs {nbytes / 2**20:.1f} MiB but only "
                    f"{(self.budget - self.used) / 2**20:.1f} MiB of the {self.budget / 2**20:.1f} MiB budget is free; "
                    f"the running stage uses {self._compute_used / 2**20:.2f} MiB of the "
                    f"{self.compute_reserve / 2**20:.2f} MiB its plan reserved (raise --gpu-mem-gb or use more stages)")
            self.used += nbytes
            if not for_good:
                self._compute_used += nbytes
                self.compute_peak_since_reserve = max(self.compute_peak_since_reserve, self._compute_used)
            self.peak = max(self.peak, self.used)
            return self.phase

    def will_free(self, nbytes: int) -> None:
        """Announce that a background job will free ``nbytes`` without needing compute to progress."""
        with self._cond:
            self.leaving += nbytes

    def free(self, nbytes: int, phase: int | None = None, announced: bool = False) -> None:
        """Return bytes.  Only bytes allocated in the running phase count against its reservation;
        a gradient freed by the offload thread belongs to a phase that has already ended."""
        with self._cond:
            self.used -= nbytes
            if announced:
                self.leaving -= nbytes
            if phase is not None and phase == self.phase:
                self._compute_used = max(0, self._compute_used - nbytes)
            self._cond.notify_all()

    def set_compute_reserve(self, nbytes: int) -> None:
        """Start of a stage's phase: hold back its expected working memory from prefetching."""
        with self._cond:
            self.compute_reserve = int(nbytes)
            self.phase += 1
            self._compute_used = 0
            self.compute_peak_since_reserve = 0
            self._cond.notify_all()

    def reserve_for_prefetch(self, nbytes: int, cancelled: threading.Event | None = None,
                             before_waiting: Callable[[], None] | None = None) -> None:
        """Block until ``nbytes`` fit beside the compute reservation, then take them;
        ``before_waiting`` is called once if they do not fit yet."""
        with self._cond:
            if before_waiting is not None and self._headroom() < nbytes:
                before_waiting()
            while self._headroom() < nbytes:
                if cancelled is not None and cancelled.is_set():
                    raise DeviceBudgetError(f"{self.device_name}: prefetch cancelled")
                if self.used == 0 and nbytes > self.budget:
                    raise DeviceBudgetError(f"{self.device_name}: a {nbytes / 2**20:.1f} MiB tensor exceeds the "
                                            f"{self.budget / 2**20:.1f} MiB budget")
                self._cond.wait(timeout=0.5)
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def reset_peak(self) -> None:
        with self._cond:
            self.peak = self.used


class SavedStorages:
    """What autograd saves for backward, in bytes: each storage once, however often it is saved,
    and never the storage of the modules' own weights.  A linear layer saves its weight for
    backward as ``weight.t()``, a view of the weight (of the stage's flat buffer, at run time): those
    bytes are the stage's parameters, already accounted, and counting them again as activations
    doubled a GPT-2 block's saved bytes per micro-batch.  The profiler and the runtime both count
    this way, so plan and runtime agree, and with analytic profiles
    (:meth:`mobius.models.gpt.Block.working_bytes`)."""

    def __init__(self, modules: Iterable[torch.nn.Module] = ()):
        self._seen = {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}

    def new_bytes(self, t: torch.Tensor) -> int:
        """The bytes ``t`` adds to what is saved (0: its storage is a weight or already counted)."""
        storage = t.untyped_storage()
        if storage.data_ptr() in self._seen:
            return 0
        self._seen.add(storage.data_ptr())
        return storage.nbytes()


@dataclass
class Traffic:
    """Bytes moved in one step by one worker."""

    h2d: int = 0
    d2h: int = 0
    peer: int = 0

    def reset(self) -> None:
        self.h2d = self.d2h = self.peer = 0
