"""A run that checks its own prediction.

After the warm-up step and :data:`STEPS` more, the pipeline compares what it measured with what its
plan predicted: the step, the compute lane (the busiest worker's micro-batch passes: what a layer
profile timed wrongly throws off) and the host AdamW lane (the busiest worker's parameters at the
rate its optimizer threads measured; the lane a host rate timed wrongly throws off most, and the one
a plan's choices of recomputation, residency and stage count hang on).  What is off by more than
:data:`TOLERANCE` is named in one line; the host's measured AdamW rate is kept (:data:`HOST_RATES`)
for the next plan on this machine to use instead of the one it was planned with, and a layer
profile that made the compute slower than it runs is forgotten when the run ends
(:data:`PROFILES`), to be measured again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from mobius.boundary.cache import Cache, key_of
from mobius.metrics import StepMetrics, seconds_text
from mobius.runtime.optim import steps_clipped
from mobius.runtime.spec import Lane, PipelineSetup, Plan, RunSpec, StepPrediction

STEPS = 3  # measured steps compared, after the warm-up step
TOLERANCE = 0.2
# A rate is kept only from a worker that updates this many parameters a step: below it the AdamW
# calls' fixed costs, not the bytes, set the time, and the rate says nothing about larger stages.
MIN_PARAMS_KEPT = 2**22

HOST_RATES = Cache("host", "measured host rate")
# Measured layer profiles, by their settings and this machine (mobius.planning.prepare): here beside the
# host's rate because a run that finds its profile wrong forgets it.
PROFILES = Cache("profiles", "profile")


def host_rate_key(machine: str, workers: int) -> str:
    """The cache entry of the host AdamW rate measured on ``machine`` (its description) with
    ``workers`` workers sharing its cores."""
    return key_of(["host AdamW", machine, workers])


def predicted_compute_s(plan: Plan) -> float:
    """The busiest worker's compute in a step, as planned: its stages' forward and backward (the
    recomputed forward in it) for each of its micro-batches."""
    per_worker: dict[int, float] = {}
    for st in plan.stages:
        per_worker[st.gpu] = per_worker.get(st.gpu, 0.0) + plan.micro_batches * (st.fwd_ms + st.bwd_ms) / 1e3
    return max(per_worker.values(), default=0.0)


class PlanCheck:
    """Compares the run's first steps on ``plan`` (those after ``history[first]``, the plan's
    warm-up step) with ``plan`` once; ``keep_rate(params_per_s)`` is called with the hosts'
    measured AdamW rate when that lane is off.  Afterwards ``measured_step_s`` is the step measured
    (on the emulated GPUs, when emulating), ``off`` the lanes found off, and ``stale_profile`` says
    that the layer profile the plan came from is to be measured again (forgotten when the run ends,
    not during it: a re-plan mid-run must not profile)."""

    def __init__(self, plan: Plan, keep_rate: Callable[[float], None], first: int = 0,
                 predicted: StepPrediction | None = None, max_grad_norm: float = 0.0):
        """``predicted``: the steps the run was predicted to take, where they are not the plan's
        (the dispatched schedule's: its lanes are not the plan's either, and its metrics leave them
        out); ``max_grad_norm``: the run's clipping (a prediction is of steps that do not clip;
        where the updates start before the norm it also states the steps that clip and those after
        them, :meth:`~mobius.runtime.spec.StepPrediction.step_of`)."""
        self.plan, self.keep_rate, self.first = plan, keep_rate, first
        self.max_grad_norm = max_grad_norm
        self.predicted = predicted or plan.steps()
        self.done = False
        self.stale_profile = False
        self.measured_step_s: float | None = None
        self.off: list[str] = []  # "step", and the lanes off their prediction

    @classmethod
    def of(cls, setup: PipelineSetup, keep_rate: Callable[[float], None], max_grad_norm: float,
           first: int = 0) -> "PlanCheck":
        """The check of a pipeline run on ``setup`` against the predictions of the schedule that
        runs (those of steps that clip, and of the steps after them, among them)."""
        return cls(setup.plan, keep_rate, first, setup.predicted(), max_grad_norm)

    def after(self, history: list[StepMetrics]) -> list[str]:
        """The lines to print once ``history`` (this run's steps so far) holds enough steps."""
        if self.done or len(history) < self.first + 1 + STEPS:
            return []
        self.done = True
        measured = history[self.first + 1:self.first + 1 + STEPS]
        lines = []
        step = statistics.median(m.emulated_step_s if m.emulated_step_s is not None else m.step_time_s
                                 for m in measured)
        self.measured_step_s = step
        # Whether each step clipped, from the warm-up step on (the first measured step waits for its
        # norm if that one clipped).
        clips = [steps_clipped([m.grad_norm], self.max_grad_norm) > 0
                 for m in history[self.first:self.first + 1 + STEPS]]
        predicted_step = self.predicted.step_s
        if self.predicted.clipping and any(clips):
            predicted_step = self.predicted.median_step_of(clips)
        if _off(step, predicted_step):
            self.off.append("step")
            clipped = sum(clips[1:])
            note = ""
            if clipped:
                note = (f"; {clipped} of those {STEPS} steps clipped (" + (
                    "predicted as steps that redo their updates, and the steps after them as waiting for their norm)"
                    if self.predicted.clipping else
                    "the plan is of steps that do not: one that clips waits for its norm or redoes its updates)"))
            lines.append(f"plan check: step {seconds_text(step)} measured, {seconds_text(predicted_step)} "
                         f"predicted ({step / predicted_step:.2f}x){note}")
        computed = [m.compute_s for m in measured if m.compute_s is not None]
        compute, planned_compute = (statistics.median(computed) if computed else None), predicted_compute_s(self.plan)
        compute_line = ""
        if compute is not None and _off(compute, planned_compute):
            self.off.append(Lane.COMPUTE)
            compute_line = (f"plan check: compute {seconds_text(compute)} measured, {seconds_text(planned_compute)} "
                            f"predicted ({compute / planned_compute:.2f}x)")
            lines.append(compute_line)
        rates = [m.host_adam_params_per_s for m in measured if m.host_adam_params_per_s]
        predicted = self.plan.host_adam_s()
        # The lane is the busiest worker's parameters at the rate measured: a step's own seconds of
        # AdamW are not at hand under the lag, where the updates of one step run during the next
        # (a step's window held one to three updates of a worker with two stages).
        rate = statistics.median(rates) if rates else 0.0
        planned = self.plan.host_costs.get("adam_params_per_s", 0.0)
        lane = predicted * planned / rate if rate else 0.0
        if lane and self.plan.data_parallel == 1 and _off(lane, predicted):
            self.off.append(Lane.HOST_ADAM)
            # An emulated host's update lasts the time its rate gives, whatever the parameter count.
            kept = predicted * planned >= MIN_PARAMS_KEPT or measured[0].emulated_step_s is not None
            lines.append(f"plan check: host AdamW {seconds_text(lane)} measured, "
                         f"{seconds_text(predicted)} predicted ({rate / 1e6:,.0f} M parameters/s measured, "
                         f"{planned / 1e6:,.0f} M planned); " + (
                             "the next plan for this host uses the measured rate" if kept else
                             "too few parameters a step to take it for the host's rate"))
            if kept:
                self.keep_rate(rate)
        # Compute faster than planned: the layers were timed slower than this machine runs them (a
        # busy moment while profiling), and a cached profile would keep every later plan wrong.
        # Slower than planned says nothing of the kind: the machine may be busy now.
        if compute_line and compute < planned_compute:
            self.stale_profile = True
            lines[lines.index(compute_line)] += ("; the layers ran faster than their cached profile says: the next "
                                                 "run measures them again")
        return lines


def _off(measured: float, predicted: float) -> bool:
    return predicted > 0 and abs(measured / predicted - 1) > TOLERANCE


@dataclass
class PlanSwitch:
    """``--replan auto``: once :class:`PlanCheck` found a lane off, ``decide(measured step, steps
    left)`` (rank 0's; :mod:`mobius.planning.replan`) plans again with the rates the run measured
    and says whether switching pays: (the new plan or None, the line that says why).  The training loop asks
    :meth:`ask` after each step on rank 0 and, when every worker has agreed, sets ``at``: the
    step boundary where the run goes on with ``spec`` (broadcast by rank 0).  One switch a run at
    most: a second plan check on the new plan does not re-plan again, so plans cannot oscillate."""

    check: PlanCheck | None  # rank 0's; None on the others
    decide: Callable[[float, int], tuple[RunSpec | None, str]] | None
    steps: int  # the step this run ends at
    spec: RunSpec | None = None
    at: int | None = None
    asked: bool = False

    def ask(self, done: int) -> tuple[bool, str]:
        """(switch after ``done`` steps?, the line to print) once the check has found the host AdamW
        lane off: the rate the run measured is what a new plan can be made from here and now (a
        wrong layer profile is measured again by the next run, not mid-run)."""
        check = self.check
        if self.decide is None or check is None or Lane.HOST_ADAM not in check.off or self.asked:
            return False, ""
        self.asked = True
        self.spec, line = self.decide(check.measured_step_s, self.steps - done)
        return self.spec is not None, line
