"""Scaling past one box: Llama-3.1-8B on 1, 2 and 4 boxes of 8x RTX 4090 (``8x4090-4+4``), one
pipeline replica per box, the host AdamW sharded across them (ZeRO-1), for a fixed step of tokens
(``--micro-batches`` of 1 x ``--seq-len``, split between the replicas), over each network.

For every row: the plan's predicted step (its cost model, the partition MIP's figure), the
simulator's step for the same partition (``mobius.sim``, the host lane at the rate the replicas'
updates run), tokens/s, the speed-up over one box, and the network's share: the seconds of
gradient sums and weight broadcasts the node's link must carry per step, over the predicted step.
Everything here is a prediction from config.json alone (analytic profile, bf16), not a measurement.

    python scripts/plan_replicas.py [--micro-batches 64] [--seq-len 2048] [--json out.json] [--smoke]

``--smoke``: 1 and 2 boxes over one network, 8 micro-batches, the MIP stopped at 4 of HiGHS's limit checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from published_models import model_dir  # noqa: E402

from mobius.backends import resolve_for_plan
from mobius.config import RunConfig  # noqa: E402
from mobius.planning.pipeline import run_plan, update_path  # noqa: E402
from mobius.planning.planner import replica_profile  # noqa: E402
from mobius.planning.prepare import get_profile, resolve_topology  # noqa: E402
from mobius.runtime.inputs import model_config_for  # noqa: E402
from mobius.sim import simulate_mobius  # noqa: E402

TOPOLOGY = "8x4090-4+4"
NETWORKS = ("25gbe", "100gbe", "ib-hdr")


def row(model_dir: str, boxes: int, network: str, args) -> dict:
    cfg = RunConfig.of(model=model_dir, topology=TOPOLOGY, micro_batch_size=1, micro_batches=args.micro_batches,
                       seq_len=args.seq_len, precision="bf16", data_parallel=boxes, network=network)
    topo = resolve_topology(cfg)
    plan = run_plan(resolve_for_plan(cfg, topo), model_config_for(cfg), profile_how="analytic", effort=args.mip_effort)
    profile = get_profile(cfg.model, model_config_for(cfg), topo, 1, args.seq_len, "bf16", "analytic",
                          path=update_path(cfg, "bf16", boxes))
    sim = simulate_mobius(replica_profile(profile, topo, boxes), plan.bounds, topo, plan.order, plan.micro_batches,
                          plan.recompute, kept=tuple(plan.kept))
    tokens = args.micro_batches * args.seq_len
    network_s = plan.lane_floor_s.get("network", 0.0)
    return {"boxes": boxes, "network": topo.network.name, "micro_batches_per_box": plan.micro_batches,
            "stages": len(plan.bounds), "recompute": plan.recompute, "predicted_step_s": plan.modelled_step_s,
            "simulated_step_s": sim.step_s, "tokens_per_s": tokens / plan.modelled_step_s,
            "network_s": network_s, "network_share": network_s / plan.modelled_step_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batches", type=int, default=64, help="micro-batches of one sequence per step, all boxes")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--mip-effort", type=int, default=None,
                    help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="1 and 2 boxes over one network, 8 micro-batches")
    args = ap.parse_args(argv)
    networks, boxes_of = NETWORKS, (1, 2, 4)
    if args.smoke:
        networks, boxes_of = NETWORKS[-1:], (1, 2)
        args.micro_batches, args.mip_effort = 8, 4
    with model_dir("Llama-3.1-8B") as tmp:
        rows = [row(tmp, boxes, network, args) for network in networks for boxes in boxes_of]
    tokens = args.micro_batches * args.seq_len
    print(f"Llama-3.1-8B, {TOPOLOGY} per box, {tokens:,} tokens per step ({args.micro_batches} x 1 x {args.seq_len}), "
          "bf16; predictions, not measurements")
    print(f"{'network':>26} {'boxes':>5} {'mb/box':>6} {'stages':>6} {'plan s':>8} {'sim s':>8} {'tok/s':>8} "
          f"{'speed-up':>8} {'network s':>9} {'share':>6}")
    for r in rows:
        one = next(o for o in rows if o["network"] == r["network"] and o["boxes"] == 1)
        r["speedup"] = one["predicted_step_s"] / r["predicted_step_s"]
        print(f"{r['network']:>26} {r['boxes']:>5} {r['micro_batches_per_box']:>6} {r['stages']:>6} "
              f"{r['predicted_step_s']:>8.2f} {r['simulated_step_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['speedup']:>7.2f}x {r['network_s']:>9.2f} {r['network_share']:>5.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens_per_step": tokens, "topology": TOPOLOGY, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
