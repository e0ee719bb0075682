"""MIP vs baseline partitions for the Mobius paper's models on the paper's topologies.

Prints, per (model, topology): MIP solve time, stage count and predicted step time beside the
minimum-stage, maximum-stage and time-balanced baselines (analytic profile, fp16, Table 3
micro-batch sizes, M = number of GPUs micro-batches, cross mapping).  Writes the rows as JSON.

    python scripts/bench_partition.py [--json out.json] [--mip-effort N] [--smoke]

``--smoke``: mobius-3b on topo2+2 alone, the MIP stopped at 4 of HiGHS's limit checks.
"""

from __future__ import annotations

import argparse
import json
import time

from mobius.mapping import cross_map
from mobius.models import get_config
from mobius.models.presets import PAPER_MICRO_BATCH
from mobius.partition.baselines import BASELINES
from mobius.partition.cost import evaluate, machine_for
from mobius.partition.mip import solve_partition
from mobius.partition.profile import analytic_profile
from topology import load_preset

MODELS = ["mobius-3b", "mobius-8b", "mobius-15b", "mobius-51b"]
TOPOLOGIES = ["topo2+2", "8x3090-4+4"]


def run(effort: int | None, models: list[str] = MODELS, topologies: list[str] = TOPOLOGIES) -> list[dict]:
    rows = []
    for topo_name in topologies:
        topo = load_preset(topo_name)
        for model in models:
            profile = analytic_profile(model, get_config(model), PAPER_MICRO_BATCH[model], 512, topo.gpus[0].tflops)
            machine = machine_for(topo, cross_map(topo, 2 * topo.n))
            m = topo.n
            row = {"model": model, "topology": topo_name, "micro_batches": m}
            best_name, best_bounds, best_t = None, None, float("inf")
            for name, fn in BASELINES.items():
                bounds = fn(profile, machine, m)
                t = evaluate(profile, bounds, machine, m).step_s
                row[f"{name}_stages"], row[f"{name}_step_s"] = len(bounds), t
                if t < best_t:
                    best_name, best_bounds, best_t = name, bounds, t
            t0 = time.perf_counter()
            r = solve_partition(profile, machine, m, effort=effort, warm_start=best_bounds)
            row.update(mip_wall_s=time.perf_counter() - t0, mip_solve_s=r.solve_s, mip_status=r.status,
                       mip_gap=r.gap, mip_stages=len(r.bounds), mip_step_s=r.objective_s, best_baseline=best_name,
                       mip_le_best_baseline=r.objective_s <= best_t * (1 + 1e-9))
            rows.append(row)
            print(f"{model:>10} {topo_name:>11} | MIP {r.solve_s:5.2f} s {len(r.bounds):>3} st {r.objective_s:8.3f} s "
                  f"({r.status}, gap {r.gap:.1e}) | min {row['min_stages']:>3} st {row['min_step_s']:8.3f} | "
                  f"max {row['max_stages']:>3} st {row['max_step_s']:8.3f} | "
                  f"balanced {row['balanced_stages']:>3} st {row['balanced_step_s']:8.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bench_partition.json")
    p.add_argument("--mip-effort", type=int, default=None,
                   help="HiGHS's limit checks per solve (default: by the model's size)")
    p.add_argument("--smoke", action="store_true", help="one model on one topology")
    args = p.parse_args(argv)
    print(f"{'model':>10} {'topology':>11} | MIP: solve time, stages, predicted step | baselines: stages, step")
    if args.smoke:
        rows = run(4, MODELS[:1], TOPOLOGIES[:1])
    else:
        rows = run(args.mip_effort)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    slowest = max(r["mip_wall_s"] for r in rows)
    ok = all(r["mip_le_best_baseline"] for r in rows)
    print(f"slowest MIP (wall, incl. model build) {slowest:.2f} s; MIP <= best baseline in every row: {ok}")


if __name__ == "__main__":
    main()
