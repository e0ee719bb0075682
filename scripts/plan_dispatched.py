"""The bound schedule beside the dispatched one (:mod:`mobius.sim.dispatched`), predicted for
Llama-3.1-8B (or ``--model``) on 1, 2, 4 and 8 of ``8x4090-4+4``'s GPUs (half under each root
complex where there are two or more), ``--micro-batches`` of 1 x ``--seq-len``, bf16.

For every GPU count: the bound plan's predicted step (its cost model, the partition MIP's figure)
and the simulator's step for the same plan; the dispatched schedule's simulated step with the
shape its search found (stage counts, kept tail, the kept stages resident on their GPUs, the
head's layers and GPUs, whether the MIP's partitions or time-balanced ones won) and the steps of
the search without the MIP and with a head's stage of the head alone; the bound schedule's
speed-up over its own one-GPU step (simulated), the dispatched one's over the fastest one-GPU step
of either.  The bound simulation swaps every stage: where the
bound plan keeps stages resident on their GPUs (updated there, its "resident" column; without
--optimizer-lag), the plan's own figure is the bound schedule's, and the dispatched schedule is
compared with that.  Everything here is a prediction from config.json alone (analytic profile),
not a measurement.

    python scripts/plan_dispatched.py [--micro-batches 16] [--seq-len 2048] [--optimizer-lag 1]
                                      [--json out.json] [--smoke]

``--smoke``: 1 and 2 GPUs, GPT-2, 4 micro-batches of 128, the MIP stopped at 4 of HiGHS's limit checks.
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
from mobius.boundary.janitor import scratch_dir  # noqa: E402
from mobius.config import RunConfig  # noqa: E402
from mobius.planning.pipeline import run_plan, update_path  # noqa: E402
from mobius.planning.prepare import get_profile, reserve_cuda_memory, resolve_topology  # noqa: E402
from mobius.runtime.inputs import model_config_for  # noqa: E402
from mobius.planning.dispatched import plan_dispatched  # noqa: E402
from mobius.sim.schedules import simulate_mobius  # noqa: E402

BOX = Path(__file__).resolve().parents[1] / "topology" / "presets" / "8x4090-4+4.json"


def box_of(gpus: int, directory: str) -> str:
    """A topology file of ``gpus`` of the box's GPUs, split evenly between its root complexes."""
    box = json.loads(BOX.read_text())
    under = [[g for g in box["gpus"] if g["root_complex"] == rc["id"]] for rc in box["root_complexes"]]
    per = [gpus - gpus // 2, gpus // 2] if gpus > 1 else [1, 0]
    chosen = [g for rc, k in zip(under, per) for g in rc[:k]]
    box["gpus"] = [{**g, "index": i} for i, g in enumerate(chosen)]
    box["root_complexes"] = [rc for rc, k in zip(box["root_complexes"], per) if k]
    box["name"] = f"{gpus} of 8x4090-4+4"
    path = Path(directory) / f"{gpus}.json"
    path.write_text(json.dumps(box))
    return str(path)


def row(model: str, gpus: int, directory: str, args, without_mip: bool = True) -> dict:
    """One GPU count's predictions; ``without_mip``: the dispatched search without the MIP, and
    with a head's stage of one layer, too."""
    cfg = RunConfig.of(model=model, topology=box_of(gpus, directory), micro_batch_size=1,
                       micro_batches=args.micro_batches, seq_len=args.seq_len, precision="bf16",
                       optimizer_lag=args.optimizer_lag, recompute=args.recompute)
    model_config = model_config_for(cfg)
    topo = resolve_topology(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # the planner's progress lines
        plan = run_plan(resolve_for_plan(cfg, topo), model_config, profile_how="analytic", effort=args.mip_effort)
    reserved = reserve_cuda_memory(topo)
    profile = get_profile(cfg.model, model_config, reserved, 1, args.seq_len, "bf16", "analytic",
                          path=update_path(cfg, "bf16", 1))
    bound = simulate_mobius(profile, plan.bounds, reserved, plan.order, args.micro_batches, plan.recompute,
                            optimizer_lag=args.optimizer_lag, kept=tuple(plan.kept))
    dispatched = plan_dispatched(profile, reserved, plan.order, args.micro_batches, optimizer_lag=args.optimizer_lag)
    balanced = plan_dispatched(profile, reserved, plan.order, args.micro_batches, optimizer_lag=args.optimizer_lag,
                               mip_shapes=0) if without_mip else None
    shallow = plan_dispatched(profile, reserved, plan.order, args.micro_batches, optimizer_lag=args.optimizer_lag,
                              deep_head=False) if without_mip else None
    return {"gpus": gpus, "bound_predicted_s": plan.modelled_step_s, "bound_simulated_s": bound.step_s,
            "bound_stages": len(plan.bounds), "bound_resident": len(plan.resident),
            "dispatched_simulated_s": dispatched.step_s if dispatched else None,
            "dispatched_stages": [len(dispatched.forward), len(dispatched.backward)] if dispatched else None,
            "dispatched_kept": dispatched.kept if dispatched else None,
            "dispatched_head_gpus": dispatched.head_gpus if dispatched else None,
            "dispatched_head_layers": dispatched.head_layers if dispatched else None,
            "dispatched_resident": len(dispatched.resident) if dispatched else None,
            "dispatched_partitioned_by": dispatched.partitioned_by if dispatched else None,
            "time_balanced_only_s": balanced.step_s if balanced else None,
            "one_layer_head_s": shallow.step_s if shallow else None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Llama-3.1-8B",
                   help="a published config (scripts/published_models.py) or a preset")
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--mip-effort", type=int, default=None,
                   help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    p.add_argument("--optimizer-lag", type=int, choices=(0, 1), default=0,
                   help="1: each step's host AdamW runs on while the next step computes, in both schedules")
    p.add_argument("--recompute", choices=("auto", "on"), default="auto",
                   help="the bound plan's recomputation: where memory forces it (auto) or on every stage (on)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    counts = (1, 2, 4, 8)
    if args.smoke:
        args.model, args.micro_batches, args.seq_len, args.mip_effort, counts = "gpt2", 4, 128, 4, (1, 2)
    with scratch_dir("mobius-boxes-") as directory, (model_dir(args.model) if args.model in CONFIGS
                                                    else contextlib.nullcontext(args.model)) as model:
        rows = [row(model, g, directory, args) for g in counts]
    one = rows[0]
    fastest_one = min(s for s in (one["bound_predicted_s"], one["bound_simulated_s"], one["dispatched_simulated_s"])
                      if s)
    print(f"{args.model}, {args.micro_batches} micro-batches of 1x{args.seq_len}, bf16, optimizer lag "
          f"{args.optimizer_lag}, GPUs of 8x4090-4+4 (predictions, not measurements)")
    print("| GPUs | bound: plan s | resident | bound: sim s | speed-up | dispatched: sim s | speed-up | stages F/B "
          "| kept | resident | head layers | head GPUs | partitions | time-balanced only s | one-layer head s "
          "| dispatched/bound plan |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        d = r["dispatched_simulated_s"]
        print(f"| {r['gpus']} | {r['bound_predicted_s']:.2f} | {r['bound_resident']} | {r['bound_simulated_s']:.2f} | "
              f"{one['bound_simulated_s'] / r['bound_simulated_s']:.2f}x | "
              + (f"{d:.2f} | {fastest_one / d:.2f}x | {r['dispatched_stages'][0]}/{r['dispatched_stages'][1]} | "
                 f"{r['dispatched_kept']} | {r['dispatched_resident']} | {r['dispatched_head_layers']} | "
                 f"{r['dispatched_head_gpus']} | {r['dispatched_partitioned_by']} | {r['time_balanced_only_s']:.2f} | "
                 f"{r['one_layer_head_s']:.2f} | {d / r['bound_predicted_s']:.3f} |"
                 if d else "does not fit | | | | | | | | | | |"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
