"""The training loop every backend shares: steps, the metrics file, checkpoints at the right
moments (``--save-every``, ``--stop-after``, a signal, the end), the non-finite-loss stop and the
summary line."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable

from tqdm import tqdm

from mobius.boundary.errors import RunError, shown
from mobius.config import OutputConfig, RunConfig
from mobius.metrics import Evaluation, MetricsWriter, StepMetrics, seconds_text
from mobius.metrics.reporters import open_reports
from mobius.runtime.optim import steps_clipped
from mobius.runtime.plan_check import PlanCheck, PlanSwitch
from mobius.signals import StopRequest


def run_steps(cfg: RunConfig, step_fn: Callable[[int], StepMetrics], header: str, start_step: int = 0,
              save_fn: Callable[[int, dict[str, str]], None] | None = None, stop: StopRequest | None = None,
              agree: Callable[..., tuple[bool, ...]] | None = None, main: bool = True,
              eval_fn: Callable[[int], Evaluation] | None = None, check: PlanCheck | None = None,
              switch: PlanSwitch | None = None, before: list[StepMetrics] | None = None,
              started: float | None = None, tracker_runs: dict[str, str] | None = None,
              settle: Callable[[StepMetrics], StepMetrics] | None = None) -> list[StepMetrics]:
    """Drive ``step_fn`` from ``start_step`` to ``cfg.optim.steps`` with a progress bar, the metrics file,
    evaluation (``eval_fn(steps done)``, every ``--eval-every`` steps and at the end), checkpoints
    (``--save-every``, ``--stop-after``, a signal, the end) and a summary.

    ``agree`` makes every pipeline worker take the same stop/save decision; only ``main`` prints.
    Every worker evaluates at the same steps: the decision depends on the step alone.  ``check``
    compares the first steps with the plan (:mod:`mobius.runtime.plan_check`); ``switch``, asked on
    ``main`` after each step, ends this call at a step boundary for the caller to continue on
    another plan (``--replan``), every worker with it.  ``before``: the steps of the
    run's earlier plan, which the returned history and the summary include; ``started``: when the
    first of them began (``time.perf_counter``), so the summary's wall time counts the switch;
    ``tracker_runs``: the runs of ``--report-to``'s trackers to continue (a resumed checkpoint's),
    updated with the ones logged into, which ``save_fn(done, runs)`` is given for the checkpoint.

    ``settle``: where ``step_fn`` returns before the step's updates are decided (the dispatched
    schedule: the next step starts meanwhile), what completes its metrics; each step is then
    recorded once the next one has been handed out, or before the run evaluates, saves, stops or
    ends.
    """
    if main:
        print(header, flush=True)
    writer = MetricsWriter(cfg.outputs.metrics if main else None, append=start_step > 0)
    board = open_reports(cfg.outputs if main else OutputConfig(), cfg.to_dict(), tracker_runs)
    if tracker_runs is not None:  # for the caller's next call (after a plan switch) to continue them too
        tracker_runs.update(board.runs())
    history: list[StepMetrics] = list(before or ())
    t0 = time.perf_counter() if started is None else started
    steps, save, save_every = cfg.optim.steps, cfg.checkpoint.save, cfg.checkpoint.save_every
    bar = tqdm(range(start_step, steps), disable=not (cfg.outputs.progress and main), unit="step", dynamic_ncols=True,
               file=sys.stdout, initial=start_step, total=steps)

    def record(m: StepMetrics) -> None:
        history.append(settle(m) if settle is not None else m)
        for line in check.after(history) if check is not None and main else ():
            bar.write(line)
        writer.write(history[-1])
        board.write(history[-1])
        bar.set_postfix(postfix(history))

    stopped_at = switched_at = None
    late: StepMetrics | None = None  # the step handed out before this one, not recorded yet
    try:
        for step in bar:
            m = step_fn(step)
            if late is not None:
                record(late)
                late = None
            if not math.isfinite(m.loss) and cfg.optim.precision != "fp16":
                where = f"; the last checkpoint in {cfg.checkpoint.save} is kept" if cfg.checkpoint.save else ""
                raise RunError(f"loss is {m.loss} at step {step}: stopping ({cfg.optim.precision}){where}")
            done = step + 1
            every = cfg.data.eval_every
            evaluates = eval_fn is not None and (done == steps or (every and done % every == 0))
            want_stop = (stop is not None and stop.check()) or (  # a switch's steps count too
                cfg.checkpoint.stop_after is not None and len(history) + 1 >= cfg.checkpoint.stop_after)
            want_save = bool(save) and (want_stop or done == steps or bool(save_every and done % save_every == 0))
            if evaluates:
                evaluation = eval_fn(done)
                m.eval_loss, m.eval_preference = evaluation.loss, evaluation.preference
                m.eval_perplexity = math.exp(min(m.eval_loss, 700.0))
                if main and m.eval_preference is not None:  # a preference loss has no perplexity
                    bar.write(f"eval after step {done}: loss {m.eval_loss:.4f}, reward accuracy "
                              f"{m.eval_preference['rewards/accuracies']:.3f}, margin "
                              f"{m.eval_preference['rewards/margins']:.4f}")
                elif main:
                    bar.write(f"eval after step {done}: loss {m.eval_loss:.4f}, perplexity {m.eval_perplexity:.2f}")
            if settle is None or evaluates or done == steps:
                record(m)
            else:
                late = m
            want_switch = False
            if main and switch is not None and done < steps:
                want_switch, line = switch.ask(done)
                if line:
                    bar.write(line)
            if agree is not None:
                want_stop, want_save, want_switch = agree(want_stop, want_save, want_switch)
            if late is not None and (want_stop or want_save or want_switch):
                record(late)
                late = None
            if want_save and save_fn is not None:
                save_fn(done, board.runs())  # a resume from it continues the trackers' runs
            if want_stop and done < cfg.optim.steps:
                stopped_at = done
                break
            if want_switch:
                switched_at = switch.at = done
                break
    finally:
        bar.close()
        writer.close()
        board.close()
    if switched_at is not None:
        return history  # the run goes on, on another plan
    if main and history:
        print(summary(history, time.perf_counter() - t0, cfg.optim.max_grad_norm), flush=True)
    if main and stopped_at is not None:
        saved = (f"checkpoint saved to {shown(save)}; continue with --resume {shown(save)}" if save
                 else "nothing saved (no --save)")
        print(f"stopped after step {stopped_at} of {cfg.optim.steps}: {saved}", flush=True)
    return history


def postfix(history: list[StepMetrics]) -> dict[str, str]:
    """The progress bar's figures after the last step: loss, the last evaluation, tokens/s (and
    emulated runs' GPU step and tokens/s: the bar's ETA is wall time)."""
    m = history[-1]
    evaluated = [h.eval_loss for h in history if h.eval_loss is not None]
    shown = {"loss": f"{m.loss:.4f}", **({"eval": f"{evaluated[-1]:.4f}"} if evaluated else {}),
             "tok_s": f"{m.tokens / max(m.step_time_s, 1e-9):.0f}"}
    if m.preference is not None:  # a preference run: how often, and by how much, the chosen answer wins
        shown.update(acc=f"{m.preference['rewards/accuracies']:.2f}", margin=f"{m.preference['rewards/margins']:.3f}")
    if m.emulated_step_s is not None:
        shown.update(emulated_step=seconds_text(m.emulated_step_s),
                     emulated_tok_s=f"{m.tokens / m.emulated_step_s:.0f}")
    return shown


def summary(history: list[StepMetrics], wall: float, max_grad_norm: float = 0.0) -> str:
    """The run's last line: its steps, loss, throughput and peak memory (emulated: the GPUs' median
    step); where it clips, how many steps did (each waited for its norm or redid its updates)."""
    tokens = sum(m.tokens for m in history)
    peak = max(m.peak_device_bytes for m in history)
    emulated = [m.emulated_step_s for m in history if m.emulated_step_s is not None]
    on_gpus = ""
    if emulated:  # after the first step (warm-up), as the benchmarks count it
        typical = sorted(emulated[1:] or emulated)[len(emulated[1:] or emulated) // 2]
        on_gpus = f"; emulated GPUs: {seconds_text(typical)}/step (median), {history[-1].tokens / typical:.0f} tokens/s"
    clipped = ""
    if max_grad_norm:
        clipped = f"; {steps_clipped((m.grad_norm for m in history), max_grad_norm)} of {len(history)} steps clipped"
    return (f"done: {len(history)} steps, loss {history[0].loss:.4f} -> {history[-1].loss:.4f}, "
            f"{tokens / wall:.0f} tokens/s, wall {wall:.1f} s, peak device memory {peak / 2**20:.1f} MiB{on_gpus}"
            f"{clipped}")
