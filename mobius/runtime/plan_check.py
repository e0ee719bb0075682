"""A run that checks its own prediction.

After the warm-up step and :data:`STEPS` more, the pipeline compares what it measured with what its
plan predicted: the step, and the host AdamW lane (the busiest worker's optimizer thread; the lane
a host rate timed wrongly throws off most, and the one a plan's choices of recomputation,
residency and stage count hang on).  What is off by more than :data:`TOLERANCE` is named in one
line, and the host's measured AdamW rate is kept (:data:`HOST_RATES`) for the next plan on this
machine to use instead of the one it was planned with.
"""

from __future__ import annotations

import statistics
from typing import Callable

from mobius.cache import Cache, key_of
from mobius.metrics import StepMetrics, seconds_text
from mobius.models.precision import element_bytes
from mobius.runtime.spec import Plan

STEPS = 3  # measured steps compared, after the warm-up step
TOLERANCE = 0.2
# A rate is kept only from a worker that updates this many parameters a step: below it the AdamW
# calls' fixed costs, not the bytes, set the time, and the rate says nothing about larger stages.
MIN_PARAMS_KEPT = 2**22

HOST_RATES = Cache("host", "measured host rate")


def host_rate_key(machine: str, workers: int) -> str:
    """The cache entry of the host AdamW rate measured on ``machine`` (its description) with
    ``workers`` workers sharing its cores."""
    return key_of(["host AdamW", machine, workers])


def predicted_host_adam_s(plan: Plan) -> float:
    """The busiest worker's host AdamW seconds in a step, as planned: the parameters of its stages
    that swap (resident ones are updated on their GPU) at the rate the plan assumed."""
    rate = plan.host_costs.get("adam_params_per_s", 0.0)
    if not rate:
        return 0.0
    per_worker: dict[int, float] = {}
    for st in plan.stages:
        if st.index not in plan.resident:
            per_worker[st.gpu] = per_worker.get(st.gpu, 0.0) + st.grad_bytes / element_bytes(plan.precision) / rate
    return max(per_worker.values(), default=0.0)


class PlanCheck:
    """Compares the run's first steps with ``plan`` once; ``keep_rate(params_per_s)`` is called
    with the hosts' measured AdamW rate when that lane is off."""

    def __init__(self, plan: Plan, keep_rate: Callable[[float], None]):
        self.plan, self.keep_rate = plan, keep_rate
        self.done = False

    def after(self, history: list[StepMetrics]) -> list[str]:
        """The lines to print once ``history`` (this run's steps so far) holds enough steps."""
        if self.done or len(history) < 1 + STEPS:
            return []
        self.done = True
        measured = history[1:1 + STEPS]
        lines = []
        step = statistics.median(m.emulated_step_s if m.emulated_step_s is not None else m.step_time_s
                                 for m in measured)
        if _off(step, self.plan.predicted_step_s):
            lines.append(f"plan check: step {seconds_text(step)} measured, {seconds_text(self.plan.predicted_step_s)} "
                         f"predicted ({step / self.plan.predicted_step_s:.2f}x)")
        adam = [m.host_adam_s for m in measured if m.host_adam_s is not None]
        rates = [m.host_adam_params_per_s for m in measured if m.host_adam_params_per_s]
        predicted = predicted_host_adam_s(self.plan)
        if adam and rates and predicted and self.plan.data_parallel == 1 and _off(statistics.median(adam), predicted):
            rate, planned = statistics.median(rates), self.plan.host_costs["adam_params_per_s"]
            kept = predicted * planned >= MIN_PARAMS_KEPT
            lines.append(f"plan check: host AdamW {seconds_text(statistics.median(adam))} measured, "
                         f"{seconds_text(predicted)} predicted ({rate / 1e6:,.0f} M parameters/s measured, "
                         f"{planned / 1e6:,.0f} M planned); " + (
                             "the next plan on this machine uses the measured rate" if kept else
                             "too few parameters a step to take it for the host's rate"))
            if kept:
                self.keep_rate(rate)
        return lines


def _off(measured: float, predicted: float) -> bool:
    return predicted > 0 and abs(measured / predicted - 1) > TOLERANCE
