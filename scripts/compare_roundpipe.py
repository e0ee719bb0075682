"""Our plans beside RoundPipe's published figures, at RoundPipe's settings: Llama-3.1-8B (or
``--model GPT-OSS-20B``) full fine-tuning on 1, 2, 4 and 8 GPUs of ``8x4090-4+4`` (two root complexes of four RTX 4090s),
sequences of 2048, 256 micro-batches of 1 a step (524,288 tokens), fp16 with fp16 accumulation,
the one-step-stale optimizer (``--optimizer-lag 1``), ``--schedule auto``; and without the lag with
clipping at 1.0 (a Hugging Face model's default), beside RoundPipe's synchronous optimizer.

The 4090's efficiency is set (``block_efficiency`` of each GPU, in the topology file this script
writes) so that our one-GPU prediction equals RoundPipe's measured one-GPU figure (3,142 tok/s):
the comparison is then of how the step scales and what each plan's floor is, not of the model
code's speed.  ``--fraction F`` sets the efficiency instead of calibrating it.  Every number of
ours here is a prediction from config.json (analytic profile), not a measurement; RoundPipe's are
its artifact's (``exp/raw-data.csv``, 2026).

    python scripts/compare_roundpipe.py [--gpus 1 2 4 8] [--micro-batches 256] [--json out.json]
    python scripts/compare_roundpipe.py --model GPT-OSS-20B --gpus 8 --fraction 0.5607   # Llama's calibration
    python scripts/compare_roundpipe.py --smoke      # GPT-2, 1 and 2 GPUs, 8 micro-batches of 1x256
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_dispatched import box_of  # noqa: E402
from published_models import CONFIGS, model_dir  # noqa: E402

from mobius.backends import resolve_for_plan
from mobius.boundary.janitor import scratch_dir  # noqa: E402
from mobius.config import RunConfig  # noqa: E402
from mobius.planning.pipeline import choose_schedule, run_plan  # noqa: E402
from mobius.runtime.inputs import model_config_for  # noqa: E402

# RoundPipe (2026), exp/raw-data.csv: full fine-tuning on 8x RTX 4090, sequences of 2048, tok/s by
# GPU count; with its optimizer one step stale, and (Llama) synchronous.
ROUNDPIPE = {"Llama-3.1-8B": {1: 3142.0, 8: 24275.0}, "GPT-OSS-20B": {8: 18122.0}}
ROUNDPIPE_SYNCHRONOUS = {"Llama-3.1-8B": {8: 18888.0}}
CALIBRATION_TOKENS = 2048  # the block efficiency is stated at one micro-batch of 1x2048


def with_efficiency(box: str, fraction: float) -> str:
    """The topology file ``box`` with every GPU's block efficiency set to ``fraction``."""
    topo = json.loads(Path(box).read_text())
    for g in topo["gpus"]:
        g["block_efficiency"] = {"tokens": CALIBRATION_TOKENS, "fraction": fraction}
    Path(box).write_text(json.dumps(topo))
    return box


def predict(model: str, box: str, args, lag: int) -> dict:
    """What ``mobius.plan --schedule auto`` predicts on ``box``: the step that runs, its tokens/s,
    the bound plan's floor (its lanes' first-principles work), the floor of the step that runs (the
    bound plan's, or what the dispatched plan's busiest GPU computes a step) and how long planning
    took."""
    clip = 0.0 if lag else 1.0  # with the lag RoundPipe does not clip; without it, a Hugging Face run does
    cfg = RunConfig.of(model=model, topology=box, micro_batch_size=1, micro_batches=args.micro_batches,
                       seq_len=args.seq_len, precision="fp16", fp16_accumulation=True, optimizer_lag=lag,
                       max_grad_norm=clip, schedule="auto")
    model_config = model_config_for(cfg)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the planner's progress lines
        decided = resolve_for_plan(cfg)
        plan = run_plan(decided, model_config, profile_how="analytic", effort=args.mip_effort)
        choice = choose_schedule(decided, model_config, plan, "analytic")
    step = choice.dispatched.step_s if choice.shape is not None else (choice.bound_step_s or plan.predicted_step_s)
    floor = max(plan.lane_floor_s.values())
    own = choice.dispatched.result.compute_s if choice.shape is not None else floor
    tokens = args.micro_batches * args.seq_len
    return {"gpus": decided.topology.n, "lag": lag, "schedule": "dispatched" if choice.shape is not None else "bound",
            "step_s": step, "tokens_per_s": tokens / step, "bound_floor_s": floor, "floor_s": own,
            "head": [choice.dispatched.head_layers, choice.dispatched.head_gpus] if choice.shape is not None else None,
            "planning_s": time.perf_counter() - t0}


def calibrated(model: str, directory: str, args, one_gpu: float) -> float:
    """The block efficiency at which one GPU's predicted tokens/s is RoundPipe's measured
    ``one_gpu`` (a few secant steps on the fraction: compute-bound, tokens/s grows with it)."""
    fraction = 0.5
    for _ in range(args.calibration_rounds):
        got = predict(model, with_efficiency(box_of(1, directory), fraction), args, lag=1)["tokens_per_s"]
        if abs(got / one_gpu - 1) < 0.002:
            break
        fraction = min(1.0, fraction * one_gpu / got)
    return fraction


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Llama-3.1-8B", help="a published config (scripts/published_models.py)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--micro-batches", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=None, help="the 4090's block efficiency (default: calibrated)")
    p.add_argument("--calibration-rounds", type=int, default=4)
    p.add_argument("--mip-effort", type=int, default=None,
                   help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.gpus, args.micro_batches, args.seq_len = "gpt2", [1, 2], 8, 256
        args.mip_effort, args.calibration_rounds = 4, 1
    figures = "Llama-3.1-8B" if args.smoke else args.model  # the smoke's GPT-2 rows exercise Llama's columns
    published, synchronous = ROUNDPIPE.get(figures, {}), ROUNDPIPE_SYNCHRONOUS.get(figures, {})
    one_gpu = published.get(1)
    if args.fraction is None and one_gpu is None:
        p.error(f"RoundPipe published no one-GPU figure for {args.model} to calibrate on: give --fraction "
                "(the 4090's efficiency calibrated on Llama-3.1-8B, say)")
    with scratch_dir("mobius-roundpipe-") as directory, (model_dir(args.model) if args.model in CONFIGS
                                                         else contextlib.nullcontext(args.model)) as model:
        fraction = args.fraction if args.fraction is not None else calibrated(model, directory, args, one_gpu)
        rows = [predict(model, with_efficiency(box_of(g, directory), fraction), args, lag)
                for lag in (1, 0) for g in args.gpus]
    one = {r["lag"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1}
    print(f"{args.model}, {args.micro_batches} micro-batches of 1x{args.seq_len}, fp16 with fp16 accumulation, "
          f"GPUs of 8x4090-4+4 at block efficiency {fraction:.4f} ({'given' if args.fraction else 'calibrated'}); "
          "ours: predictions, not measurements")
    print("| optimizer | GPUs | schedule | step s | tok/s | speed-up | bound plan's floor s | its floor s | step/floor "
          "| RoundPipe tok/s | ours/RoundPipe | head's layers/GPUs | planned in s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        theirs = (published if r["lag"] else synchronous).get(r["gpus"])
        r["roundpipe_tokens_per_s"] = theirs
        speedup = f"{r['tokens_per_s'] / one[r['lag']]:.2f}x" if r["lag"] in one else "-"
        versus = f"{theirs:,.0f} | {r['tokens_per_s'] / theirs:.3f}" if theirs else "- | -"
        print(f"| {'lag 1' if r['lag'] else 'lag 0, clip 1.0'} | {r['gpus']} | {r['schedule']} | {r['step_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {speedup} | {r['bound_floor_s']:.2f} | {r['floor_s']:.2f} | "
              f"{r['step_s'] / r['floor_s']:.3f} | {versus} | {'/'.join(map(str, r['head'] or ['-']))} | "
              f"{r['planning_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"fraction": fraction, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
