"""Calibrate the simulator against the real runtime on this machine.

Runs the pipeline (as ``bench_pipeline.py`` does: ``small``, bf16, 4 stages, 4x4x128 tokens),
then feeds the simulator what this machine measures: the per-layer profile (with the threads a
worker gets), the host<->"device" copy bandwidth of a CPU worker (memcpy), and CPU AdamW speed.
Prints measured and predicted step times.

    python scripts/calibrate_sim.py [--workers 1] [--recompute on] [--json calibrate.json] [--smoke]

``--smoke``: the ``tiny`` model, 2 stages, 2 steps of 2x2x32 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from mobius.backends import resolve
from mobius.backends.pipeline import launch_pipeline
from mobius.config import RunConfig
from mobius.models import get_config
from mobius.partition.profile import measure_profile
from mobius.runtime.optim import UpdateRule, make_adamw
from mobius.runtime.spec import Plan
from mobius.sim import simulate_mobius
from topology.presets import cpu_topology


def memcpy_gbps(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def adamw_params_per_s(n: int = 4_000_000) -> float:
    p = torch.nn.Parameter(torch.randn(n // 1000, 1000))
    p.grad = torch.randn_like(p)
    opt = make_adamw([("w", p)], UpdateRule(lr=1e-3))
    opt.step()
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    return 3 * p.numel() / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--recompute", default="on", choices=("on", "off"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="calibrate.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 stages, 2 steps")
    args = ap.parse_args(argv)
    model, micro_batches, micro_batch, seq_len = "small", 4, 4, 128
    if args.smoke:
        model, micro_batches, micro_batch, seq_len = "tiny", 2, 2, 32
        args.stages, args.steps = 2, 2
    cfg = RunConfig.of(model=model, steps=args.steps, micro_batches=micro_batches, micro_batch_size=micro_batch,
                       seq_len=seq_len, precision="bf16",
                       backend="pipeline", topology="cpu", cpu_workers=args.workers, stages=args.stages,
                       recompute=args.recompute, progress=False, device_optimizer="off")  # the simulator's Mobius
    history = launch_pipeline(resolve(cfg, backend="pipeline"), get_config(model))
    measured = statistics.median(m.step_time_s for m in history[1:])

    threads = max(1, (os.cpu_count() or 1) // args.workers)
    torch.set_num_threads(threads)
    profile = measure_profile(model, get_config(model), micro_batch, seq_len, "bf16", repeats=3)
    bw = memcpy_gbps(2**20 if args.smoke else 256 * 2**20)
    adam = adamw_params_per_s(10**5 if args.smoke else 4_000_000)
    topo = cpu_topology(args.workers)
    for g in topo.gpus:
        g.link_bandwidth_gbps = bw
    topo.root_complexes[0].host_bandwidth_gbps = bw  # one memory system: shared like a root complex
    from mobius.planning.planner import make_plan

    plan: Plan = make_plan(model, get_config(model), topo, micro_batch, micro_batches, seq_len, "bf16",
                           recompute=args.recompute == "on", stages=args.stages, profile=profile, use_cache=False,
                           device_optimizer=False)
    sim = simulate_mobius(profile, plan.bounds, topo, plan.order, micro_batches, recompute=args.recompute == "on",
                          adam_params_per_s=adam)
    err = sim.step_s / measured - 1
    print(f"workers {args.workers}, {args.stages} stages, recompute {args.recompute}: measured step {measured:.3f} s, "
          f"simulated {sim.step_s:.3f} s ({err:+.1%}); inputs: memcpy {bw:.1f} GB/s, AdamW {adam / 1e6:.0f} M params/s, "
          f"{threads} thread(s) per worker")
    with open(args.json, "w") as f:
        json.dump({"measured_step_s": measured, "simulated_step_s": sim.step_s, "relative_error": err,
                   "memcpy_gbps": bw, "adamw_params_per_s": adam, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
