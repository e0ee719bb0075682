"""The paper's effects in the real runtime: emulated PCIe boxes on CPU workers (``--emulate``).

Each row is one configuration, three step times in emulated milliseconds:

* predicted: the cost model the MIP optimises (``plan.modelled_step_s``);
* simulated: the discrete-event simulator on the same plan (:func:`mobius.sim.simulate_mobius`);
* measured: ``python -m mobius.train --emulate`` on this machine, the mean ``emulated_step_s`` of
  its steps after the first (warm-up) and before the last (which no next step overlaps): a steady
  state of overlapping steps can alternate between a shorter and a longer step.  A rehearsal's, in
  real time and noisier, is the median of its steps after the first.

The ``rehearsal`` table is the plain CPU rehearsal (``--topology auto``, no emulation): the CPU's
own measured profile predicts the CPU workers' ``step_time_s``; each row also prints what the
model predicts without the runtime's own costs (:mod:`mobius.stages.calibrate`), which the many
small stages row is made to show.

Every emulated row of a table runs at one dilation (``--dilation``, the largest any of its rows
needs), so the variants it compares are measured under the same conditions.

Every stage swaps (``--device-optimizer off``), as in the paper and the simulator.  Tables:
prefetch on/off; cross vs sequential mapping on ``8x3090-4+4`` and ``topo2+2``; ``--optimizer-lag``
0/1; clipping on and off, in both schedules; recomputation where memory forces it against on every stage; the bound
schedule against the dispatched one (``--schedule``; its rows' stages are forward/backward, and its
prediction is its simulation); the dispatched one with a kept tail beside recomputing stages and a
split head; one box of ``8x3090-4+4`` against two as data-parallel replicas over 25 GbE; MIP vs
min-stage vs max-stage vs balanced partitions on ``topo2+2`` for a small-block and a large-block
configuration.  Prints the tables and the gains (predicted vs measured), writes JSON.

    python scripts/bench_emulated.py [--steps 3] [--only TABLE] [--match ROW] [--json bench_emulated.json]
    python scripts/bench_emulated.py --smoke    # one row: the tiny model on topo2+2, 2 steps (seconds)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from mobius.backends import resolve
from mobius.boundary.errors import InputError
from mobius.config import parse_train_args
from mobius.models import get_config
from mobius.partition.cost import settle
from mobius.planning.pipeline import clipping_waits, layers_timed_how, prepare_pipeline, update_path
from mobius.planning.planner import MAPPINGS, replica_profile
from mobius.planning.prepare import get_profile, resolve_topology
from mobius.runtime.inputs import check_model_input
from mobius.runtime.optim import steps_clipped
from mobius.runtime.spec import StepPrediction
from mobius.sim.schedules import simulate_mobius

BOX = "--topology 8x3090-4+4 --model small --gpu-mem-gb 0.05"
PAIR = "--topology topo2+2 --model small --gpu-mem-gb 0.05"
ROOMIER_BOX, ROOMIER_PAIR = (f"--topology {t} --model small --gpu-mem-gb 0.12" for t in ("8x3090-4+4", "topo2+2"))
SMALL_BLOCKS = "--topology topo2+2 --model small --gpu-mem-gb 0.1 --micro-batch-size 8"
LARGE_BLOCKS = "--topology topo2+2 --model gpt2 --gpu-mem-gb 0.8 --micro-batch-size 2"
PARTITIONERS = ("mip", "min", "max", "balanced")
REPLICA_BOX = "--topology 8x3090-4+4 --model tiny8 --gpu-mem-gb 0.05"

REHEARSAL = "--topology auto"  # the default run (model small, 2 CPU workers), at least 8 steps
# Layers that cost little, in many stages and micro-batches: the runtime's own work is much of the step.
MANY_SMALL_STAGES = "--topology auto --model tiny8 --stages 10 --micro-batches 8 --micro-batch-size 2 --seq-len 64"

TABLES: dict[str, list[tuple[str, str]]] = {
    "rehearsal": [("CPU rehearsal (default run)", REHEARSAL), ("CPU rehearsal, small stages", MANY_SMALL_STAGES)],
    "prefetch": [("topo2+2 prefetch on", PAIR), ("topo2+2 prefetch off", f"{PAIR} --no-prefetch"),
                 ("8x3090-4+4 prefetch on", BOX), ("8x3090-4+4 prefetch off", f"{BOX} --no-prefetch")],
    "mapping": [("8x3090-4+4 cross", BOX), ("8x3090-4+4 sequential", f"{BOX} --mapping sequential"),
                ("topo2+2 cross", PAIR), ("topo2+2 sequential", f"{PAIR} --mapping sequential")],
    "lag": [("8x3090-4+4 lag 0", BOX), ("8x3090-4+4 lag 1", f"{BOX} --optimizer-lag 1")],
    # Clipping: without a lag the host updates start before the step's norm (a step that clips is redone).
    # At 1.0 the small model's steps all clip (after the first, each waits for its norm); at 100 none
    # does (after the first, the updates start before the norm and are kept); at 50 the first six
    # steps' norms (53, 8, 95, 21, 6, 5) have the third redo its updates.
    "clip": [("8x3090-4+4 no clipping", f"{BOX} --max-grad-norm 0"),
             ("8x3090-4+4 clipped at 1.0", f"{BOX} --max-grad-norm 1.0"),
             ("8x3090-4+4 clipped at 100", f"{BOX} --max-grad-norm 100"),
             ("8x3090-4+4 clipped at 50", f"{BOX} --max-grad-norm 50"),
             ("topo2+2 no clipping", f"{PAIR} --max-grad-norm 0"),
             ("topo2+2 clipped at 1.0", f"{PAIR} --max-grad-norm 1.0"),
             ("8x3090-4+4 dispatched no clipping", f"{BOX} --schedule dispatched --max-grad-norm 0"),
             ("8x3090-4+4 dispatched clipped at 1.0", f"{BOX} --schedule dispatched --max-grad-norm 1.0"),
             ("8x3090-4+4 dispatched clipped at 50", f"{BOX} --schedule dispatched --max-grad-norm 50")],
    # The step's micro-batches on one box, and on two over 25 GbE, each box updating half of the
    # parameters (the network is most of their step).  A small model: 16 workers share this
    # machine's cores, so the dilation is high and an emulated millisecond lasts 20 wall seconds.
    "replicas": [("1 x 8x3090-4+4", REPLICA_BOX),
                 ("2 x 8x3090-4+4 over 25gbe", f"{REPLICA_BOX} --data-parallel 2 --network 25gbe")],
    # Each stage bound to one GPU for the step, against each stage's forward and backward handed to
    # the GPUs in turn (forward and backward partitions of their own); with the lag, steps overlap.
    "schedule": [("8x3090-4+4 bound lag 1", f"{BOX} --optimizer-lag 1"),
                 ("8x3090-4+4 dispatched lag 1", f"{BOX} --optimizer-lag 1 --schedule dispatched"),
                 ("topo2+2 bound lag 1", f"{PAIR} --optimizer-lag 1"),
                 ("topo2+2 dispatched lag 1", f"{PAIR} --optimizer-lag 1 --schedule dispatched")],
    # Recomputation only where memory forces it (the stages whose activations fit keep them), against
    # recomputation on every stage: memory enough for some stages' activations, not all.
    "recompute": [("8x3090-4+4 recompute where forced", f"{ROOMIER_BOX} --recompute auto"),
                  ("8x3090-4+4 recompute on", f"{ROOMIER_BOX} --recompute on"),
                  ("topo2+2 recompute where forced", f"{ROOMIER_PAIR} --recompute auto"),
                  ("topo2+2 recompute on", f"{ROOMIER_PAIR} --recompute on")],
    # The dispatched schedule with memory for some stages' activations: its last forward stages keep
    # theirs (their backward runs where they ran) beside stages that recompute (8x3090-4+4 at 0.1 GB:
    # 13 stages, 8 kept, the head's micro-batches on 2 GPUs; topo2+2: 9, 4 kept); and at 0.06 GB
    # the head's micro-batches split over 4 GPUs, nothing kept (5 forward, 7 backward stages).
    "kept": [("8x3090-4+4 dispatched, kept tail, split head",
              f"{ROOMIER_BOX.replace('0.12', '0.1')} --optimizer-lag 1 --schedule dispatched"),
             ("8x3090-4+4 dispatched, head on 4 GPUs",
              f"{ROOMIER_BOX.replace('0.12', '0.06')} --optimizer-lag 1 --schedule dispatched"),
             ("topo2+2 dispatched, kept tail", f"{ROOMIER_PAIR} --optimizer-lag 1 --schedule dispatched")],
    "partition": [(f"small blocks {p}", f"{SMALL_BLOCKS} --partitioner {p}") for p in PARTITIONERS]
    + [(f"large blocks {p}", f"{LARGE_BLOCKS} --partitioner {p}") for p in PARTITIONERS],
}
# (table, faster row, slower row): the gains the runtime must show as the cost model predicts them.
GAINS = [("prefetch", "topo2+2 prefetch on", "topo2+2 prefetch off"),
         ("prefetch", "8x3090-4+4 prefetch on", "8x3090-4+4 prefetch off"),
         ("mapping", "8x3090-4+4 cross", "8x3090-4+4 sequential"),
         ("mapping", "topo2+2 cross", "topo2+2 sequential"),
         ("lag", "8x3090-4+4 lag 1", "8x3090-4+4 lag 0"),
         ("schedule", "8x3090-4+4 dispatched lag 1", "8x3090-4+4 bound lag 1"),
         ("schedule", "topo2+2 dispatched lag 1", "topo2+2 bound lag 1"),
         ("recompute", "8x3090-4+4 recompute where forced", "8x3090-4+4 recompute on"),
         ("recompute", "topo2+2 recompute where forced", "topo2+2 recompute on")]


def rehearsal(options: str) -> bool:
    """A plain CPU rehearsal (no emulation): real time, noisier, so more steps."""
    return "--topology auto" in options


def command(options: str, steps: int) -> list[str]:
    # Every stage swaps and is updated on the host, as the simulator's Mobius does (what each table
    # compares is that machinery: prefetching, mapping, partitions, the optimizer's lag).
    options = f"{options} --device-optimizer off"
    if rehearsal(options):
        return [*shlex.split(options), "--steps", str(max(steps, 8))]
    return [*shlex.split(options), "--emulate", "--steps", str(steps)]


def predict(options: str, steps: int) -> tuple[dict, StepPrediction | None]:
    """The plan's predicted and simulated step times, and the dilation the run will use; and the
    predicted steps of the schedule that runs where they include the steps that clip (None
    otherwise)."""
    cfg = parse_train_args(command(options, steps))
    topo = resolve_topology(cfg)
    spec, plan = prepare_pipeline(resolve(cfg, topo, "pipeline"), check_model_input(cfg))
    factor = spec.emulation.factor if spec.emulation else 1
    predicted = spec.setup.predicted()
    clipping = predicted if predicted.clipping else None
    if spec.setup.dispatched is not None:  # its prediction is its simulation (mobius.sim.dispatched)
        shape = spec.setup.dispatched
        row = {"stages": f"{len(shape.forward)}/{len(shape.backward)}", "predicted_s": predicted.step_s,
               "simulated_s": predicted.step_s, "factor": factor}
        return _with_clipping(row, cfg, clipping), clipping
    profile = get_profile(cfg.model, get_config(cfg.model), topo, cfg.batch.micro_batch_size, cfg.batch.seq_len,
                          plan.precision, layers_timed_how(cfg),
                          path=update_path(cfg, plan.precision, plan.data_parallel))
    profile = replica_profile(profile, topo, plan.data_parallel)  # its host's updates cross the network
    sim = simulate_mobius(profile, plan.bounds, topo, plan.order, plan.micro_batches, plan.recompute,
                          optimizer_lag=cfg.optim.optimizer_lag, prefetch=plan.prefetch, kept=tuple(plan.kept),
                          clip=clipping_waits(cfg, plan.precision, plan.data_parallel), resident=tuple(plan.resident),
                          device_adam_params_per_s=plan.device_adam_params_per_s).step_s
    # The same plan, timed as if the runtime cost nothing beyond the layers, copies and AdamW.
    layers_only = replace(profile.host, handoff_s=0.0, micro_batch_s=0.0, stage_switch_s=0.0)
    _, est = settle(profile, plan.bounds, topo, MAPPINGS[plan.mapping](topo, len(plan.bounds)), plan.micro_batches,
                    plan.recompute, plan.prefetch, layers_only, cfg.optim.optimizer_lag, resident=tuple(plan.resident),
                    kept=tuple(plan.kept))
    row = {"stages": len(plan.bounds), "predicted_s": plan.modelled_step_s, "simulated_s": sim,
           "predicted_without_runtime_costs_s": est.step_s, "factor": factor}
    return _with_clipping(row, cfg, clipping), clipping


def _with_clipping(row: dict, cfg, clipping: StepPrediction | None) -> dict:
    """Where the updates start before clipping's norm, the predicted steps that differ beside."""
    if clipping is not None:
        row.update(max_grad_norm=cfg.optim.max_grad_norm, clipped_step_s=clipping.clipped_step_s,
                   waiting_step_s=clipping.waiting_step_s, plan_step_s=clipping.step_s)
    return row


def steady_step_s(steps: list[float], real_time: bool) -> float:
    """The measured step (module docstring): the median after the first in real time, else the
    mean of those between the first and the last (the one after the first where that is all)."""
    if real_time:
        return statistics.median(steps[1:])
    return statistics.mean(steps[1:-1] if len(steps) > 2 else steps[1:])


def measure(options: str, steps: int, metrics: Path) -> tuple[list[float], list[float | None]]:
    """Each step's time (emulated, or real in a rehearsal) and its gradient norm (where it clips)."""
    metrics.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "mobius.train", *command(options, steps), "--metrics", str(metrics),
                    "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    key = "step_time_s" if rehearsal(options) else "emulated_step_s"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [m[key] for m in lines], [m.get("grad_norm") for m in lines]


SMOKE_TABLES = {"smoke": [("topo2+2 tiny", "--topology topo2+2 --model tiny --gpu-mem-gb 0.05 --seq-len 32 "
                                           "--micro-batch-size 2")]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3,
                   help="steps per run; the first is warm-up, the last drains (emulated rows)")
    p.add_argument("--only", choices=tuple(TABLES), action="append", help="run only these tables")
    p.add_argument("--match", action="append", help="run only the rows whose name contains this")
    p.add_argument("--json", default="bench_emulated.json")
    p.add_argument("--smoke", action="store_true", help="one row, the tiny model on topo2+2, 2 steps")
    args = p.parse_args(argv)
    tables = SMOKE_TABLES if args.smoke else TABLES
    if args.smoke:
        args.steps, args.only = 2, None
    results: dict[str, dict] = {}
    measured: dict[str, tuple] = {}  # by options: a row that repeats another's run reuses it
    with tempfile.TemporaryDirectory(prefix="mobius-bench-") as tmp:
        for table in args.only or tables:
            print(f"\n{table}")
            print(f"{'configuration':<28} {'stages':>6} {'1/F':>6} {'predicted ms':>12} {'simulated ms':>12} "
                  f"{'measured ms':>11} {'pred/meas':>9}")
            predicted, clipping = {}, {}
            for name, options in tables[table]:
                if args.match and not any(m in name for m in args.match):
                    continue
                try:
                    predicted[name], clipping[name] = predict(options, args.steps)
                except InputError as err:  # e.g. a partition with fewer stages than GPUs
                    print(f"{name:<28} not run: {err}", flush=True)
            # One dilation for the rows of a table: variants compared are measured under one factor.
            factor = max((row["factor"] for row in predicted.values()), default=1)
            for name, options in tables[table]:
                if name not in predicted:
                    continue
                row = predicted[name]
                if not rehearsal(options):
                    options, row["factor"] = f"{options} --dilation {factor:g}", factor
                if options not in measured:
                    measured[options] = measure(options, args.steps, Path(tmp) / "metrics.jsonl")
                steps, norms = measured[options]
                row.update(measured_s=steady_step_s(steps, rehearsal(options)), steps_s=steps, options=options)
                row["error"] = row["predicted_s"] / row["measured_s"] - 1
                results[name] = row
                print(f"{name:<28} {row['stages']:>6} {row['factor']:>6g} {row['predicted_s'] * 1e3:>12.2f} "
                      f"{row['simulated_s'] * 1e3:>12.2f} {row['measured_s'] * 1e3:>11.2f} {row['error']:>+9.1%}",
                      flush=True)
                if clipping[name] is not None:
                    row["grad_norms"] = norms
                    row["plan_of_each_step_s"] = clipping[name].median_step_of(
                        [steps_clipped([n], row["max_grad_norm"]) > 0 for n in norms])
                    print(f"{'':<28} the plan's step of each measured step (keeping, redoing or waiting): "
                          f"{row['plan_of_each_step_s'] * 1e3:.2f} ms "
                          f"({row['plan_of_each_step_s'] / row['measured_s'] - 1:+.1%})", flush=True)
                if rehearsal(options):
                    print(f"{'':<28} predicted without the runtime's own costs: "
                          f"{row['predicted_without_runtime_costs_s'] * 1e3:.2f} ms "
                          f"({row['predicted_without_runtime_costs_s'] / row['measured_s'] - 1:+.1%})", flush=True)
    gains = []
    for _, fast, slow in GAINS:
        if fast in results and slow in results:
            g = {"faster": fast, "slower": slow,
                 "predicted_gain": 1 - results[fast]["predicted_s"] / results[slow]["predicted_s"],
                 "simulated_gain": 1 - results[fast]["simulated_s"] / results[slow]["simulated_s"],
                 "measured_gain": 1 - results[fast]["measured_s"] / results[slow]["measured_s"]}
            gains.append(g)
            print(f"gain of {fast} over {slow}: predicted {g['predicted_gain']:+.1%}, simulated "
                  f"{g['simulated_gain']:+.1%}, measured {g['measured_gain']:+.1%}")
    for prefix in ("small blocks", "large blocks"):
        rows = {k.split()[-1]: v for k, v in results.items() if k.startswith(prefix)}
        if rows:
            by_pred = sorted(rows, key=lambda k: rows[k]["predicted_s"])
            by_meas = sorted(rows, key=lambda k: rows[k]["measured_s"])
            print(f"{prefix}: predicted ranking {by_pred}, measured ranking {by_meas}")
    if results:
        worst = max(results, key=lambda k: abs(results[k]["error"]))
        print(f"worst prediction: {worst} {results[worst]['error']:+.1%}")
    Path(args.json).write_text(json.dumps({"rows": results, "gains": gains}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
