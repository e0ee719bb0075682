"""Plans for a 70B Llama-family model on the commodity presets: full fine-tuning against LoRA, from
``config.json`` alone (analytic profile, bf16, as ``python -m mobius.plan --lora-rank R`` plans).

For each topology and mode: the host memory the stage stores need (``mobius.planning.planner.
host_bytes_needed``) against what the preset states, and, when it fits, the plan's stages and
predicted step time.  Everything here is a planner prediction, not a measurement.

    python scripts/plan_lora.py [--rank 16] [--seq-len 4096] [--micro-batches 8] [--json out.json] [--smoke]

``--smoke``: one topology, 2 micro-batches, the MIP stopped at 4 of HiGHS's limit checks.
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
from mobius.models import build_model  # noqa: E402
from mobius.planning.pipeline import run_plan  # noqa: E402
from mobius.planning.planner import GB, host_bytes_needed  # noqa: E402
from mobius.planning.prepare import resolve_topology  # noqa: E402
from mobius.runtime.inputs import model_config_for  # noqa: E402
from published_models import model_dir  # noqa: E402

TOPOLOGIES = ["8x3090-4+4", "4x4090"]


def row(model_dir: str, topology: str, rank: int, args) -> dict:
    cfg = RunConfig.of(model=model_dir, topology=topology, micro_batch_size=1, micro_batches=args.micro_batches,
                       seq_len=args.seq_len, lora_rank=rank, precision="bf16")
    config = model_config_for(cfg)
    topo = resolve_topology(cfg)
    params = list(build_model(config, device="meta").parameters())
    out = {"topology": topology, "mode": f"LoRA r={rank}" if rank else "full",
           "trained_params": sum(p.numel() for p in params if p.requires_grad),
           "host_gb_needed": host_bytes_needed(config, "bf16") / GB, "host_gb_preset": topo.host_memory_gb}
    try:
        plan = run_plan(resolve_for_plan(cfg, topo), config, profile_how="analytic", effort=args.mip_effort,
                        use_cache=False)
    except InputError as err:
        return {**out, "plan": None, "why": str(err)}
    return {**out, "plan": {"stages": len(plan.bounds), "recompute": plan.recompute, "partitioner": plan.partitioner,
                            "predicted_step_s": plan.predicted_step_s,
                            "tokens_per_s": args.micro_batches * args.seq_len / plan.predicted_step_s}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--mip-effort", type=int, default=None,
                   help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    p.add_argument("--json", default="plan_lora.json")
    p.add_argument("--smoke", action="store_true", help="one topology, 2 micro-batches, 4 limit checks per MIP")
    args = p.parse_args(argv)
    if args.smoke:
        args.mip_effort, args.micro_batches = 4, 2
    with model_dir("Llama-3.1-70B") as tmp:
        rows = [row(tmp, t, r, args) for t in TOPOLOGIES[:1 if args.smoke else None] for r in (0, args.rank)]
    print(f"Llama-3.1-70B (config.json only), bf16, {args.micro_batches} micro-batches of 1x{args.seq_len}; "
          "planner predictions")
    print(f"{'topology':>11} {'mode':>10} {'trained':>9} {'host GB need/have':>18} {'stages':>6} "
          f"{'predicted s/step':>16} {'tokens/s':>9}")
    for r in rows:
        need = f"{r['host_gb_needed']:.0f}/{r['host_gb_preset']:.0f}"
        if r["plan"]:
            pl = r["plan"]
            tail = f"{pl['stages']:>6} {pl['predicted_step_s']:>16.1f} {pl['tokens_per_s']:>9.0f}"
        else:
            tail = f"  refused: {r['why'][:70]}"
        print(f"{r['topology']:>11} {r['mode']:>10} {r['trained_params'] / 1e6:>8.1f}M {need:>18} {tail}")
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
