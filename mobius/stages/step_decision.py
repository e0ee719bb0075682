"""What a step's host updates decide together, one record for both schedules (the bound one's
:class:`~mobius.stages.host_optimizer.HostOptimizer`, the dispatched one's
:class:`~mobius.stages.piece_updates.PieceUpdates`): fp16's overflow vote moves the loss scale, the
step's global norm sets what clipping multiplies every gradient by, and the updates that started
before the two were known are kept, taken back (a step the vote skips), or taken back and redone
clipped.

Where updates may start before their decision (:func:`~mobius.runtime.optim.updates_speculate`),
they do so only after a step that neither clipped nor overflowed: a run clips in stretches, so a
step after one that clipped (and the run's first: taken back from moments that were zero, its
clipped redo would keep the rounding of gradients many times its own) waits for its decision.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from mobius.runtime.device import Device
from mobius.runtime.optim import (
    DynamicLossScaler, UpdateRule, clip_coefficient, rollback_params, undo_adamw_step, unscaled_squares,
    updates_speculate)


class StepDecisions:
    """The decisions of a run's steps on one host, and the updates each step made before its own."""

    def __init__(self, rule: UpdateRule, lag: int, scaler: DynamicLossScaler, replicated: bool):
        self.rule, self.scaler = rule, scaler
        self._may_speculate = updates_speculate(rule.max_grad_norm, lag, scaler.enabled, replicated)
        self.speculating = False  # whether this step's updates start before its decision
        # this step's updates made before its decision: key -> their squares (None: a gradient not finite)
        self.speculated: dict[int, float | None] = {}
        self._lock = threading.Lock()
        self.speculated_steps: list[int] = []  # steps whose updates started before their decision
        self.redone_steps: list[int] = []  # those of them that clipped or overflowed: their updates taken back

    def update_first(self, key: int, optimizer: torch.optim.Optimizer, unscale: float | None) -> bool:
        """Before the step's decision, the update of ``key``'s ``optimizer``: its gradients unscaled
        by ``unscale`` (fp16's loss scale, or None) and their squares taken first.  Returns whether
        it may step now: not where a gradient is not finite (the vote will skip the step)."""
        found = unscaled_squares(optimizer, unscale)
        with self._lock:
            self.speculated[key] = found
        return found is not None

    def updated_first(self, key: int) -> bool:
        """Whether ``key``'s update this step was made before the step's decision."""
        with self._lock:
            return key in self.speculated

    def stands(self, key: int, optimizer: torch.optim.Optimizer, keep: bool, device: Device) -> bool:
        """With the step's decision (``keep``: it neither clipped nor overflowed), the update
        ``key`` made before it: True where it stands as it is (kept, or never made), its gradients
        let go; else it is taken back and the caller redoes it as decided."""
        with self._lock:
            applied = self.speculated.pop(key) is not None
        if not applied or keep:
            optimizer.zero_grad(set_to_none=True)
            return True
        with device.host_update_span(rollback_params(optimizer)):
            undo_adamw_step(optimizer)
        return False

    def goes_ahead(self, key: int, optimizer: torch.optim.Optimizer, speculative: bool, unscale: float | None,
                   keep: bool, device: Device) -> bool:
        """Whether ``key``'s update is made now: ``speculative``, before the step's decision, unless
        a gradient is not finite (:meth:`update_first`, with ``unscale``); with the decision
        (``keep``: it neither clipped nor overflowed), unless the update made before it stands
        (:meth:`stands`).  The one branch of both schedules' update passes."""
        if speculative:
            return self.update_first(key, optimizer, unscale)
        return not self.updated_first(key) or not self.stands(key, optimizer, keep, device)

    def decide(self, step: int, overflow: bool, waited_squares: Callable[[], float],
               sum_all: Callable[[float], float] = float) -> tuple[float, float | None]:
        """Step ``step``'s decision, once its vote found ``overflow`` (any non-finite gradient, on
        any host): the loss scale moves, and where it clips and did not overflow, the global norm
        from ``waited_squares()`` (the unscaled squares of the gradients whose updates waited) and
        the squares of those that did not, summed over the hosts by ``sum_all``.  Returns the
        coefficient every gradient is clipped by and the norm (None where it is not taken)."""
        if self.scaler.enabled:
            self.scaler.update(overflow)
        clip, norm = 1.0, None
        if self.rule.max_grad_norm and not overflow:
            with self._lock:
                first = sum(self.speculated.values())
            total = sum_all(waited_squares() + first)
            norm, clip = total ** 0.5, clip_coefficient(total, self.rule.max_grad_norm)
        with self._lock:
            if self.speculated:
                self.speculated_steps.append(step)
                if overflow or clip < 1.0:
                    self.redone_steps.append(step)
        self.speculating = not overflow and clip == 1.0 and self._may_speculate
        return clip, norm
