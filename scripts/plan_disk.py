"""Full fine-tuning past host memory, planned: Mobius's plan with the disk tier beside DeepSpeed
ZeRO-Infinity's step (:func:`mobius.sim.schedules.simulate_zero_infinity`) from the same figures
(the analytic profile of the box's GPUs, its links, its drives, the same host AdamW rate).

Two boxes: Llama-3.1-8B on ``4x4090`` with 64 GB of host memory and one 7 GB/s drive, and
Llama-3.1-70B on ``8x3090-4+4`` with 256 GB and two; bf16, ``--micro-batches`` of 1 x
``--seq-len``.  For each: where the plan puts the state (stages with their moments, master weights
and compute weights on disk), the bytes on the drives, the disk lane's floor, the predicted step
and tokens/s, and ZeRO-Infinity's.  Everything here is a prediction from config.json alone, not a
measurement.

    python scripts/plan_disk.py [--micro-batches 32] [--seq-len 2048] [--json out.json] [--smoke]

``--smoke``: the ``mobius-3b`` preset on ``4x4090`` with 40 GB, 8 micro-batches of 1024, the MIP stopped at 4 of HiGHS's limit checks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from published_models import CONFIGS, model_dir  # noqa: E402

from mobius.backends import resolve_for_plan
from mobius.config import RunConfig  # noqa: E402
from mobius.planning.pipeline import run_plan, update_path  # noqa: E402
from mobius.planning.prepare import get_profile, reserve_cuda_memory, resolve_topology  # noqa: E402
from mobius.runtime.inputs import model_config_for  # noqa: E402
from mobius.runtime.spec import Lane  # noqa: E402
from mobius.sim.schedules import simulate_zero_infinity  # noqa: E402

BOXES = [("Llama-3.1-8B", "4x4090", 64, ("7",)), ("Llama-3.1-70B", "8x3090-4+4", 256, ("7", "7"))]


def row(name: str, topology: str, host_gb: float, drives: tuple[str, ...], args) -> dict:
    with (model_dir(name) if name in CONFIGS else contextlib.nullcontext(name)) as model:
        cfg = RunConfig.of(model=model, topology=topology, micro_batch_size=1, micro_batches=args.micro_batches,
                           seq_len=args.seq_len, precision="bf16", host_mem_gb=host_gb,
                           offload_dir=tuple(f"drive{k}" for k in range(len(drives))), drive_gbps=drives)
        model_config = model_config_for(cfg)
        topo = resolve_topology(cfg)
        with contextlib.redirect_stdout(io.StringIO()):  # the planner's progress lines
            plan = run_plan(resolve_for_plan(cfg, topo), model_config, profile_how="analytic", effort=args.mip_effort)
        profile = get_profile(cfg.model, model_config, reserve_cuda_memory(topo), 1, args.seq_len, "bf16", "analytic",
                              path=update_path(cfg, "bf16", 1))
    zero = simulate_zero_infinity(profile, topo, args.micro_batches, plan.disk_gbps, host_gb * 1e9, recompute=True,
                                  adam_params_per_s=profile.host.adam_params_per_s)
    tokens = args.micro_batches * args.seq_len
    host = [j for j in range(len(plan.bounds)) if j not in plan.resident]
    return {"model": name, "box": topology, "host_gb": host_gb, "drives_gbps": [float(d) for d in drives],
            "stages": len(plan.bounds), "resident": len(plan.resident), "host_stages": len(host),
            "moments_on_disk": len(plan.disk_stages), "masters_on_disk": len(plan.disk_masters),
            "weights_on_disk": len(plan.disk_weights), "disk_gb": plan.disk_bytes / 1e9,
            "disk_floor_s": plan.lane_floor_s.get(Lane.DISK, 0.0), "mobius_step_s": plan.predicted_step_s,
            "mobius_tokens_per_s": tokens / plan.predicted_step_s, "zero_infinity_step_s": zero.step_s,
            "zero_infinity_tokens_per_s": tokens / zero.step_s, "plan": plan.render()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--mip-effort", type=int, default=None,
                   help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    p.add_argument("--plans", action="store_true", help="also print each plan in full")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    boxes = BOXES
    if args.smoke:
        boxes, args.micro_batches, args.seq_len, args.mip_effort = [("mobius-3b", "4x4090", 40.0, ("7",))], 8, 1024, 4
    rows = [row(*box, args) for box in boxes]
    print(f"full fine-tuning, bf16, {args.micro_batches} micro-batches of 1x{args.seq_len} (predictions, "
          "not measurements)")
    print("| model | box | host GB | drives GB/s | stages (resident) | on disk: moments / masters / weights of "
          "host stages | GB on disk | disk floor s | Mobius s/step | tokens/s | ZeRO-Infinity s/step | tokens/s | "
          "Mobius speed-up |")
    print("|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['box']} | {r['host_gb']:g} | {'+'.join(f'{d:g}' for d in r['drives_gbps'])} | "
              f"{r['stages']} ({r['resident']}) | {r['moments_on_disk']} / {r['masters_on_disk']} / "
              f"{r['weights_on_disk']} of {r['host_stages']} | {r['disk_gb']:.1f} | {r['disk_floor_s']:.1f} | "
              f"{r['mobius_step_s']:.1f} | {r['mobius_tokens_per_s']:,.0f} | {r['zero_infinity_step_s']:.1f} | "
              f"{r['zero_infinity_tokens_per_s']:,.0f} | {r['zero_infinity_step_s'] / r['mobius_step_s']:.2f}x |")
    if args.plans:
        for r in rows:
            print(f"\n{r['model']} on {r['box']}:\n{r['plan']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
