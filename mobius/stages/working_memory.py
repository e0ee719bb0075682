"""The device memory a running stage works in, as context managers over :class:`DeviceMemory`.

* :meth:`WorkingMemory.stage_pass`: while a stage computes a pass (forward or backward), the
  working memory the plan expects it to need is held back from the prefetcher, so the next
  stage's weights never take memory the running stage will need (the plan's ``P_j <= G -
  W_{j-N}``, enforced at run time); at the end the memory it really used is remembered, and the
  next step reserves at least that.
* :meth:`WorkingMemory.saved_activations`: what autograd saves while a forward runs is accounted,
  each storage once however often it is saved and never the stage's weights
  (:class:`~mobius.swap.memory.SavedStorages`, as the profiler counts, so plan and runtime agree),
  in a :class:`Ledger` released when backward has consumed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch

from mobius.runtime.spec import Plan
from mobius.swap.memory import DeviceMemory, SavedStorages


class Ledger:
    """Bytes autograd holds for one micro-batch's backward: (bytes, phase) per saved storage."""

    def __init__(self):
        self.entries: list[tuple[int, int]] = []


class WorkingMemory:
    # Headroom over the plan's working-memory estimate: the bytes autograd saves vary by a few
    # percent from run to run, and a prefetch must never take what the running stage will need.
    RESERVE_MARGIN = 1.10

    def __init__(self, memory: DeviceMemory, plan: Plan):
        self.memory, self.plan = memory, plan
        self._seen: dict[tuple[int, bool], int] = {}  # (stage, backward) -> most working memory used

    def idle(self) -> None:
        """Nothing computes (e.g. while waiting for a stage): a prefetch may use everything free."""
        self.memory.set_compute_reserve(0)

    @contextmanager
    def stage_pass(self, s: int, backward: bool):
        sp = self.plan.stages[s]
        planned = (sp.mem_bwd_bytes if backward else sp.mem_fwd_bytes) - sp.param_bytes
        self.memory.set_compute_reserve(max(int(planned * self.RESERVE_MARGIN), self._seen.get((s, backward), 0)))
        try:
            yield
        finally:
            used = self.memory.compute_peak_since_reserve
            self._seen[(s, backward)] = max(self._seen.get((s, backward), 0), used)

    @contextmanager
    def saved_activations(self, layers: Iterable[torch.nn.Module]):
        """Within: what autograd saves while ``layers`` run is accounted in the yielded :class:`Ledger`."""
        ledger = Ledger()
        memory = self.memory
        saved = SavedStorages(layers)

        def pack(t: torch.Tensor):
            nbytes = saved.new_bytes(t)
            if nbytes:
                ledger.entries.append((nbytes, memory.allocate(nbytes, "saved activations")))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield ledger

    def release(self, ledger: Ledger) -> None:
        for n, phase in ledger.entries:
            self.memory.free(n, phase)
        ledger.entries.clear()

    def allocate(self, t: torch.Tensor, what: str) -> int:
        """Account a tensor the running stage made; returns its phase for :meth:`free`."""
        return self.memory.allocate(t.numel() * t.element_size(), what)

    def free(self, t: torch.Tensor, phase: int | None = None) -> None:
        """Free a tensor allocated in ``phase`` (default: the running one)."""
        self.memory.free(t.numel() * t.element_size(), self.memory.phase if phase is None else phase)
