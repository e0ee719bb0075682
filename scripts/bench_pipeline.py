"""Pipeline vs the single-device reference: step time and host<->device traffic.

For ``small`` in bf16 (mixed precision, as in the paper): the reference trainer, the pipeline on
1 worker and on 2 workers with >= 4 stages.  Traffic is host->device plus device->host bytes per
step divided by the model's fp32 parameter bytes (the paper's "model size"; its Eq. 1 predicts
about 1.5 with recomputation, and it measured 1.8 for Mobius and 7.3 for DeepSpeed).

    python scripts/bench_pipeline.py [--steps 6] [--stages 4] [--json bench_pipeline.json] [--cuda] [--smoke]

``--smoke``: the ``tiny`` model, 2 steps of 2x2x32 tokens, the reference and 2 workers only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mobius.backends import resolve
from mobius.backends.pipeline import launch_pipeline
from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.models import build_model, get_config
from mobius.reference import ReferenceTrainer


def median_step(history) -> float:
    times = [m.step_time_s for m in history[1:]] or [history[0].step_time_s]  # step 0 warms up
    return statistics.median(times)


def run_single(cfg: RunConfig, device: torch.device) -> dict:
    model_config = get_config(cfg.model)
    b = cfg.batch
    batches = BatchSource(load_corpus(cfg.data.path), b.seq_len, b.micro_batch_size, b.micro_batches, cfg.optim.seed)
    trainer = ReferenceTrainer(cfg, model_config, batches, device)
    history = [trainer.step(k) for k in range(cfg.optim.steps)]
    return {"history": history}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--cuda", action="store_true", help="run on this machine's GPUs (topology auto)")
    p.add_argument("--json", default="bench_pipeline.json")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, the reference and 2 workers")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.micro_batches, args.micro_batch_size, args.seq_len = "tiny", 2, 2, 2, 32
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("error: --cuda given but CUDA is not available")

    base = dict(model=args.model, steps=args.steps, micro_batches=args.micro_batches, seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size, precision=args.precision, progress=False)
    fp32_model_bytes = build_model(get_config(args.model), device="meta").num_parameters() * 4
    rows = []
    device = torch.device("cuda" if args.cuda else "cpu")
    t0 = time.perf_counter()
    single = run_single(RunConfig.of(**base, backend="single"), device)
    single_step = median_step(single["history"])
    rows.append({"config": f"single ({device.type})", "step_s": single_step, "traffic_ratio": None})
    # (workers, recompute): recomputation is what Eq. 1 assumes; without it (the default whenever the
    # activations fit) a lone worker does the reference's arithmetic and shows the swap overhead.
    runs = [(1, "off"), (1, "on")] if args.cuda else [(1, "off"), (1, "on"), (2, "on")]
    if args.smoke:
        runs = runs[-1:]
    for workers, recompute in runs:
        cfg = RunConfig.of(**base, backend="pipeline", topology="auto" if args.cuda else "cpu", cpu_workers=workers,
                           stages=args.stages, recompute=recompute)
        history = launch_pipeline(resolve(cfg, backend="pipeline"), get_config(args.model))
        steady = history[1:] or history
        traffic = statistics.mean(m.h2d_bytes + m.d2h_bytes for m in steady)
        rows.append({"config": f"pipeline {workers}w {args.stages}st recompute {recompute}",
                     "step_s": median_step(history),
                     "h2d_bytes": statistics.mean(m.h2d_bytes for m in steady),
                     "d2h_bytes": statistics.mean(m.d2h_bytes for m in steady),
                     "peer_bytes": statistics.mean(m.peer_bytes for m in steady),
                     "traffic_ratio": traffic / fp32_model_bytes,
                     "peak_device_bytes": max(m.peak_device_bytes for m in history)})
    print(f"\nmodel {args.model} ({fp32_model_bytes / 1e6:.1f} MB fp32), {args.precision}, "
          f"{args.micro_batches}x{args.micro_batch_size}x{args.seq_len} tokens/step, "
          f"median of steps 1..{args.steps - 1}")
    print(f"{'config':<34} {'step s':>8} {'vs single':>10} {'h2d MB':>8} {'d2h MB':>8} {'peer MB':>8} "
          f"{'traffic/model':>14}")
    for r in rows:
        r["overhead_vs_single"] = r["step_s"] / single_step - 1
        ratio = f"{r['traffic_ratio']:.2f}" if r["traffic_ratio"] is not None else "-"
        print(f"{r['config']:<34} {r['step_s']:>8.3f} {r['overhead_vs_single']:>+10.1%} "
              f"{r.get('h2d_bytes', 0) / 1e6:>8.1f} {r.get('d2h_bytes', 0) / 1e6:>8.1f} "
              f"{r.get('peer_bytes', 0) / 1e6:>8.1f} {ratio:>14}")
    with open(args.json, "w") as f:
        json.dump({"device": device.type, "args": vars(args), "rows": rows,
                   "wall_s": time.perf_counter() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
