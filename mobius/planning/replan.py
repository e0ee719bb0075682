"""``--replan auto``: a run that finds its plan wrong plans again, mid-run, with what it measured.

The plan check (:mod:`mobius.runtime.plan_check`) compares the first steps with the plan and keeps
the host AdamW rate it measured where that lane was off.  :class:`Replanner` is then asked, on
rank 0 and at a step boundary, to make the plan the run would have been given had that rate been
known from the start (the same decisions as :func:`mobius.planning.pipeline.prepare_pipeline`, which now
reads the measured rate) and to weigh it: the switch is made only when the new plan's predicted
step, over the steps left, saves more than the switch costs (about what the run's own start did:
its workers' time to their first step).  The old plan is judged by its measured step, not by its
prediction: that is what the check found wrong.

The workers carry the training state across through a checkpoint (:func:`mobius.runtime.worker.switch_plans`),
so the losses are those of a run planned right from the start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mobius.metrics import seconds_text
from mobius.models import GPTConfig
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.prepare import Decided
from mobius.runtime.spec import RunSpec


@dataclass(frozen=True)
class Replanner:
    """What planning the run again needs; pickled into every worker's payload, called on rank 0."""

    decided: Decided
    model_config: GPTConfig

    def __call__(self, spec: RunSpec, measured_step_s: float, steps_left: int,
                 switch_s: float) -> tuple[RunSpec | None, str]:
        new, plan = prepare_pipeline(self.decided, self.model_config)
        # The emulated box and its clock stay as they are: the dilation holds for every plan of the
        # model (mobius.planning.pipeline.emulation_for), and the links' shared counters are the run's.
        new = replace(new, emulation=spec.emulation)
        if plan.same_choices(spec.setup.plan):
            return None, (f"replan: the plan made with the measured rates is the one running "
                          f"(predicted {seconds_text(plan.predicted_step_s)}/step now); kept")
        saved_s = (measured_step_s - plan.predicted_step_s) * steps_left
        weighed = (f"{seconds_text(measured_step_s)}/step measured, {seconds_text(plan.predicted_step_s)} predicted "
                   f"for {plan.shape()}: {seconds_text(saved_s)} saved over {steps_left} steps, the switch costs "
                   f"about {seconds_text(switch_s)}")
        if saved_s <= switch_s:
            return None, f"replan: {weighed}; kept"
        return new, f"replan: {weighed}; switching"
