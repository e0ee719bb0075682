"""``python -m mobius.plan``: profile (or the analytic model) -> partition -> cross map, printed
as a stages table with the predicted step time, without training."""

from __future__ import annotations

from mobius.boundary.errors import quiet_interrupts_while_importing

if __name__ == "__main__":
    quiet_interrupts_while_importing()

# The imports below take seconds; the guard above must come first.
# ruff: noqa: E402
import contextlib
import json
import math
import sys
import time

from mobius.boundary.errors import InputError, exits_cleanly
from mobius.config import DefaultsHelp, OneLineParser, RunConfig, add_options, resolve_max_grad_norm
from mobius.partition.highs import SAFETY_TIME_LIMIT_S
from mobius.backends import resolve_for_plan
from mobius.planning.pipeline import ScheduleChoice, choose_schedule, run_plan
from mobius.runtime.inputs import check_seq_len, model_config_for
from mobius.stages.dispatch import check_dispatched


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m mobius.plan", description=__doc__, formatter_class=DefaultsHelp)
    add_options(p, plans_only=True)
    p.add_argument("--profile", choices=("auto", "measure", "analytic"), default="auto",
                   help="measure layers on this machine or compute them from the topology's GPUs "
                        "(auto: measure when the topology is this machine; with --emulate always analytic, as the run)")
    p.add_argument("--mip-effort", type=int, default=None,
                   help="how far the partition MIP searches, in HiGHS's limit checks (a count of its own "
                        "progress, so one command gives one plan on a quiet or a busy machine); more finds "
                        "plans as good or better, in longer (default: 100 for small models down to 4 for the "
                        "largest, a search of seconds)")
    p.add_argument("--time-limit", type=float, default=SAFETY_TIME_LIMIT_S,
                   help="a safety net for each MIP, in seconds: a solve it stops says so, and that plan can "
                        "differ with the machine's load")
    p.add_argument("--baselines", action="store_true", help="also print the baselines' predicted step times")
    p.add_argument("--no-cache", action="store_true",
                   help="measure the layers and solve the partition again, replacing what is cached")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    resolve_max_grad_norm(args)
    cfg = RunConfig.from_dict(vars(args))
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise InputError(f"--time-limit must be a positive finite number, got {args.time_limit}")
    if args.profile == "measure" and cfg.emulation.enabled:
        raise InputError("--profile measure with --emulate: an emulated box is planned from its GPUs' figures, "
                         "as its run emulates them; leave --profile out")
    if args.mip_effort is not None and args.mip_effort < 1:
        raise InputError(f"--mip-effort must be at least 1, got {args.mip_effort}")
    started = time.perf_counter()
    dispatching = cfg.pipeline.schedule != "bound"
    if cfg.pipeline.schedule == "dispatched":  # what it does not run, refused before anything is planned
        check_dispatched(cfg)
    model_config = model_config_for(cfg)
    check_seq_len(cfg, model_config)
    # With --json, stdout is the JSON alone: what probing and planning say on the way goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        decided = resolve_for_plan(cfg)  # a profile measured here is measured with fp16 accumulation where asked
        plan = run_plan(decided, model_config, profile_how=args.profile, effort=args.mip_effort,
                        time_limit_s=args.time_limit, use_cache=not args.no_cache, with_baselines=args.baselines)
        if dispatching:
            print(f"predicting the dispatched schedule on {decided.topology.n} workers", flush=True)
            choice = choose_schedule(decided, model_config, plan, args.profile)
    if args.json:
        out = plan.to_dict()
        if dispatching:
            dispatched = choice.dispatched
            out["dispatched"] = None if dispatched is None else {
                "step_s": dispatched.step_s, "forward": dispatched.forward, "backward": dispatched.backward,
                "kept": dispatched.kept, "head_gpus": dispatched.head_gpus, "order": dispatched.order,
                "resident": dispatched.resident, "partitioned_by": dispatched.partitioned_by,
                "waiting_step_s": dispatched.waiting_step_s, "clipped_step_s": dispatched.clipped_step_s}
            out["schedule"] = {"runs": "dispatched" if choice.shape is not None else "bound", "why": choice.why,
                               "bound_step_s": choice.bound_step_s, "bound_how": choice.bound_how}
            if choice.shape is not None:  # the steps of the schedule that runs; the bound plan's beside them
                for key, value in (("predicted_step_s", dispatched.step_s), ("waiting_step_s", dispatched.waiting_step_s),
                                   ("clipped_step_s", dispatched.clipped_step_s)):
                    out[f"bound_{key}"], out[key] = out[key], value
        out["planning_s"] = time.perf_counter() - started
        print(json.dumps(out, indent=1))
        return
    print(plan.render())
    if dispatching:
        batch = cfg.batch
        print(dispatched_summary(choice, batch.micro_batches * batch.micro_batch_size * batch.seq_len))
        print(f"schedule: {choice.why}")
    print(f"planned in {time.perf_counter() - started:.1f} s")


def dispatched_summary(choice: ScheduleChoice, tokens: int) -> str:
    """One line: the dispatched schedule's simulated step beside the bound plan's it was compared
    with, and which is faster."""
    head, dispatched = "dispatched schedule: ", choice.dispatched
    if dispatched is None:
        return head + "not predicted"
    bound = f"the bound plan's {choice.bound_how} {choice.bound_step_s * 1e3:.1f} ms"
    ratio = dispatched.step_s / choice.bound_step_s
    verdict = f"{1 - ratio:.0%} shorter than {bound}" if ratio < 1 else f"{bound} is faster ({ratio:.2f}x)"
    return (head + f"simulated {dispatched.step_s * 1e3:.1f} ms a step ({tokens / dispatched.step_s:,.0f} tokens/s), "
            f"{len(dispatched.forward)} forward and {len(dispatched.backward)} backward stages "
            f"({dispatched.partitioned_by}), the last "
            f"{dispatched.kept} kept where they ran"
            + (f" ({len(dispatched.resident)} resident, updated on their GPUs)" if dispatched.resident else "")
            + f", the head's micro-batches on {dispatched.head_gpus} GPU{'s' if dispatched.head_gpus > 1 else ''}: "
            f"{verdict}" + (f"\ndispatched clipping: {dispatched.steps().clipping_text()}"
                            if dispatched.steps().clipping else ""))


if __name__ == "__main__":
    main()
