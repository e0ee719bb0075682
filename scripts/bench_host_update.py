"""A 16-bit host update of one stage, as the runtime ran it before and as one pass
(``mobius.runtime.optim.host_update``): the bf16 gradients made fp32, fused AdamW on the fp32
master, the bf16 compute copy refreshed.

* ``unfused``: the three one after the other over the whole stage, each through memory: the
  conversion (2 bytes read, 4 written a parameter), AdamW (28), the refresh (4 read, 2 written): 40.
* ``one pass``: chunk by chunk, the chunk's fp32 gradient and weights still in the cache for the next
  part: 28 bytes a parameter, AdamW's own.

Both update the same values (the script checks the bits); implementations alternate within each
repeat, so a noisy machine slows them alike.  The bound is the machine's memory bandwidth (``a +=
b`` on every core) over the bytes each moves.

    python scripts/bench_host_update.py [--params 64e6] [--threads 1 2] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optimizer import memory_bandwidth  # noqa: E402

from mobius.runtime.optim import UpdateRule, host_update, make_adamw  # noqa: E402

RULE = UpdateRule(lr=1e-3, weight_decay=0.01)
BYTES = {"unfused": 40, "one pass": 28}


class Stage:
    """A stage's flat host buffers (fp32 master and its gradient, bf16 staging and compute copy)
    with matrices and vectors viewing the master, and its AdamW."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.master = torch.randn(n, generator=g)
        self.master_grad = torch.zeros(n)
        self.staging = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
        self.compute = torch.empty(n, dtype=torch.bfloat16)
        sizes = [n // 8] * 7 + [n - 7 * (n // 8)]
        named, at = [], 0
        for k, size in enumerate(sizes):
            shape = (size // 256, 256) if k % 4 and size % 256 == 0 else (size,)
            named.append((str(k), torch.nn.Parameter(self.master[at:at + size].view(shape))))
            at += size
        self.params = [p for _, p in named]
        self.optimizer = make_adamw(named, RULE)

    def unfused(self) -> None:
        self.master_grad.copy_(self.staging)
        at = 0
        for p in self.params:
            p.grad = self.master_grad[at:at + p.numel()].view(p.shape)
            at += p.numel()
        self.optimizer.step()
        self.compute.copy_(self.master)

    def one_pass(self) -> None:
        host_update(self.optimizer, self.master, self.compute, (self.staging,))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=64e6, help="parameters of the stage (past the caches)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=3, help="timed updates per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="2M parameters, one thread, one repeat")
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.threads, args.steps, args.repeats = 2e6, [1], 1, 1
    n = int(args.params)
    bandwidth = memory_bandwidth(2**20, 2) if args.smoke else memory_bandwidth()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        stages = {"unfused": Stage(n), "one pass": Stage(n)}
        run = {"unfused": stages["unfused"].unfused, "one pass": stages["one pass"].one_pass}
        for name in run:
            run[name]()  # the moments made outside the timing
        a, b = stages["unfused"], stages["one pass"]
        if not (torch.equal(a.master, b.master) and torch.equal(a.compute, b.compute)):
            raise SystemExit("the one pass did not give the unfused update's bits")
        times: dict[str, list[float]] = {name: [] for name in run}
        for _ in range(args.repeats):
            for name, update in run.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    update()
                times[name].append((time.perf_counter() - t0) / args.steps)
        unfused_s = statistics.median(times["unfused"])
        for name, ts in times.items():
            s = statistics.median(ts)
            rows.append({"update": name, "threads": threads, "params": n, "ms": s * 1e3,
                         "M_params_per_s": n / s / 1e6, "bytes_per_param": BYTES[name],
                         "of_bound": n / s / (bandwidth / BYTES[name]), "speedup": unfused_s / s})
    print(f"{n / 1e6:.1f}M parameters, bf16 gradients and compute copy, fp32 master; memory bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s")
    print(f"{'update':<10} {'threads':>7} {'ms':>9} {'M params/s':>11} {'B/param':>8} {'of bound':>9} {'vs unfused':>11}")
    for r in rows:
        print(f"{r['update']:<10} {r['threads']:>7} {r['ms']:>9.1f} {r['M_params_per_s']:>11,.0f} "
              f"{r['bytes_per_param']:>8} {r['of_bound']:>8.0%} {r['speedup']:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"memory_bandwidth_Bps": bandwidth, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
