"""CPU AdamW throughput on the same tensors: ours (``mobius.runtime.optim.make_adamw``) against torch's
per-tensor loop (``foreach=False``, what Mobius used before), torch's ``foreach`` and DeepSpeed's
``DeepSpeedCPUAdam`` (when ``deepspeed`` imports; its CPU op compiles on first use, minutes).

The 100% line is the memory-bandwidth bound: AdamW reads weight, gradient and both moments and
writes weight and moments back, 28 bytes per fp32 parameter; the bandwidth is measured here with
a three-stream ``add`` over buffers far larger than the caches.  Implementations alternate within
each repeat, so a noisy machine slows them alike.

    python scripts/bench_optimizer.py [--params 64e6] [--threads 1 2] [--json out.json] [--smoke]

``--smoke``: 1M parameters, one thread, one repeat, DeepSpeed left out (its op compiles for minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mobius.runtime.optim import UpdateRule, make_adamw  # noqa: E402

RULE = UpdateRule(lr=1e-3)  # the betas, epsilon and weight decay every system below gets

BYTES_PER_PARAM = 28


def tensors(n_params: int, n_tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    sizes = [n_params // n_tensors] * n_tensors
    params = []
    for k, size in enumerate(sizes):
        shape = (size // 256, 256) if k % 4 else (size,)  # matrices (decayed) and vectors
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g) * 1e-3
        params.append(p)
    return params


def torch_adamw(params, **kwargs):
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": RULE.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=RULE.lr, betas=RULE.betas, eps=RULE.eps, **kwargs)


def deepspeed_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return DeepSpeedCPUAdam([{"params": decay, "weight_decay": RULE.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=RULE.lr, betas=RULE.betas, eps=RULE.eps,
                            adamw_mode=True)


IMPLEMENTATIONS = {
    "mobius (make_adamw)": lambda ps: make_adamw([(str(i), p) for i, p in enumerate(ps)], RULE),
    "torch loop (foreach=False, before)": lambda ps: torch_adamw(ps, foreach=False),
    "torch foreach": lambda ps: torch_adamw(ps, foreach=True),
    "torch fused": lambda ps: torch_adamw(ps, fused=True),
    "DeepSpeedCPUAdam": deepspeed_adam,
}


def memory_bandwidth(n: int = 64 * 2**20, repeats: int = 7) -> float:
    """The machine's memory bandwidth in bytes per second: the best of ``a += b`` (two reads, one
    write back to lines just read, AdamW's access pattern) over 256 MiB buffers, with every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    a, b = torch.rand(n), torch.rand(n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b, alpha=1e-9)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return 3 * 4 * n / best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=64e6, help="parameters updated per step (past the caches)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="1M parameters, one thread, one repeat, no DeepSpeed")
    args = ap.parse_args(argv)
    implementations = dict(IMPLEMENTATIONS)
    if args.smoke:
        args.params, args.threads, args.steps, args.repeats = 1e6, [1], 1, 1
        del implementations["DeepSpeedCPUAdam"]
    n = int(args.params)

    available = {}
    for name, make in implementations.items():
        try:
            make(tensors(1024, 2))
            available[name] = make
        except Exception as err:  # deepspeed missing, or its op failed to build
            print(f"skipping {name}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")

    bandwidth = memory_bandwidth(2**20, 2) if args.smoke else memory_bandwidth()
    bound = bandwidth / BYTES_PER_PARAM
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        states = {name: (lambda ps: (ps, make(ps)))(tensors(n, args.tensors)) for name, make in available.items()}
        for _, opt in states.values():
            opt.step()  # allocate the moments outside the timing
        times: dict[str, list[float]] = {name: [] for name in states}
        for _ in range(args.repeats):
            for name, (_, opt) in states.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    opt.step()
                times[name].append((time.perf_counter() - t0) / args.steps)
        loop = n / statistics.median(times["torch loop (foreach=False, before)"])
        ds = n / statistics.median(times["DeepSpeedCPUAdam"]) if "DeepSpeedCPUAdam" in times else None
        for name, ts in times.items():
            rate = n / statistics.median(ts)
            rows.append({"threads": threads, "implementation": name, "params_per_s": rate,
                         "vs_loop": rate / loop, "vs_deepspeed": rate / ds if ds else None,
                         "of_bandwidth_bound": rate / bound, "bound_params_per_s": bound})

    print(f"\nCPU AdamW, {n / 1e6:.1f}M fp32 parameters in {args.tensors} tensors, median of {args.repeats} "
          f"repeats x {args.steps} steps; bound = memory bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (measured) / {BYTES_PER_PARAM} B per parameter = {bound / 1e6:.0f} Mparams/s")
    print(f"{'threads':>7}  {'implementation':<36} {'Mparams/s':>10} {'x loop':>7} {'x DeepSpeed':>11} {'% of bound':>10}")
    for r in rows:
        vs_ds = f"{r['vs_deepspeed']:.2f}" if r["vs_deepspeed"] else "-"
        print(f"{r['threads']:>7}  {r['implementation']:<36} {r['params_per_s'] / 1e6:>10.0f} {r['vs_loop']:>7.2f} "
              f"{vs_ds:>11} {100 * r['of_bandwidth_bound']:>9.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
