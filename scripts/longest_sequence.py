"""The longest sequence each model can train on each server: the largest ``--seq-len`` (a
multiple of 1024, micro-batch 1) for which ``mobius.plan`` finds a plan, from ``config.json``
alone (analytic profile, bf16, recompute as ``mobius.train`` decides).

The models' published ``config.json`` values are written to a temporary directory, so nothing
is downloaded.  The numbers are what the cost model and the planner admit (predictions of the
plan, not measurements on the GPUs).

    python scripts/longest_sequence.py [--json out.json] [--smoke]

``--smoke``: Llama-3.1-8B on one server, sequences up to 8192 tokens, the MIP stopped at 4 of HiGHS's limit checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mobius.backends import resolve_for_plan
from mobius.boundary.errors import InputError  # noqa: E402
from mobius.config import RunConfig  # noqa: E402
from mobius.models import get_config  # noqa: E402
from mobius.planning.pipeline import run_plan  # noqa: E402
from mobius.planning.prepare import resolve_topology  # noqa: E402
from published_models import CONFIGS, model_dir  # noqa: E402

TOPOLOGIES = ["4x4090", "8x3090-4+4"]
STEP = 1024


def plans(model_dir: str, topology: str, seq_len: int, effort: int | None):
    cfg = RunConfig.of(model=model_dir, topology=topology, micro_batch_size=1, seq_len=seq_len)
    try:
        topo = resolve_topology(cfg)
        return run_plan(resolve_for_plan(cfg, topo), get_config(model_dir), profile_how="analytic", effort=effort,
                        use_cache=False)
    except InputError:
        return None


def longest(model_dir: str, topology: str, context: int, effort: int | None = None):
    """Binary search over multiples of STEP: (longest seq that plans, its plan) or (0, None)."""
    lo, hi, best = 0, context // STEP, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = plans(model_dir, topology, mid * STEP, effort)
        if plan is not None:
            lo, best = mid, plan
        else:
            hi = mid - 1
    return lo * STEP, best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="one model on one server, up to 8192 tokens")
    args = ap.parse_args(argv)
    rows = []
    for name in ("Llama-3.1-8B",) if args.smoke else ("Llama-3.1-8B", "Qwen2.5-32B"):
        context = 8192 if args.smoke else CONFIGS[name]["max_position_embeddings"]
        with model_dir(name) as d:
            for topology in TOPOLOGIES[:1] if args.smoke else TOPOLOGIES:
                seq, plan = longest(d, topology, context, 4 if args.smoke else None)
                rows.append({"model": name, "topology": topology, "longest_seq_len": seq, "context": context,
                             "stages": len(plan.bounds) if plan else 0,
                             "recompute": plan.recompute if plan else None,
                             "predicted_step_s": plan.predicted_step_s if plan else None})
                print(f"{name} on {topology}: {seq} tokens", flush=True)
    print("\nLongest trainable sequence (micro-batch 1, 4 micro-batches, bf16; planner predictions)")
    print(f"{'model':<14} {'topology':<12} {'seq len':>8} {'context':>8} {'stages':>6} {'recompute':>9} {'pred. s/step':>12}")
    for r in rows:
        step = f"{r['predicted_step_s']:.1f}" if r["predicted_step_s"] else "-"
        print(f"{r['model']:<14} {r['topology']:<12} {r['longest_seq_len']:>8} {r['context']:>8} {r['stages']:>6} "
              f"{str(r['recompute']):>9} {step:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
