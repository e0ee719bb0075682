"""Step time with and without ``--optimizer-lag 1``, measured on the real runtime, interleaved.

Each round runs ``python -m mobius.train`` once per lag (same options, alternating, so a noisy
machine slows both alike); the table gives the median step time (the first two steps, warm-up,
excluded) per lag and the ratio.

    python scripts/bench_optimizer_lag.py [--model small] [--rounds 3] [--steps 12] [--json FILE] [-- train options]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(lag: int, args, extra: list[str], out: Path) -> list[float]:
    metrics = out / f"lag{lag}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mobius.train", "--model", args.model, "--steps", str(args.steps),
           "--optimizer-lag", str(lag), "--metrics", str(metrics), "--no-progress", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", default="bench_optimizer_lag.json")
    p.add_argument("extra", nargs="*", help="further mobius.train options (after --)")
    args = p.parse_args()
    times: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="mobius-bench-lag-") as tmp:
        for _ in range(args.rounds):
            for lag in (0, 1):
                times[lag] += run(lag, args, args.extra, Path(tmp))
    med = {lag: statistics.median(t) for lag, t in times.items()}
    print(f"model {args.model}, {args.rounds} rounds x {args.steps} steps, options {' '.join(args.extra) or '(default)'}")
    print(f"{'optimizer lag':>14} {'median step s':>14} {'steps':>6}")
    for lag in (0, 1):
        print(f"{lag:>14} {med[lag]:>14.3f} {len(times[lag]):>6}")
    print(f"lag 1 / lag 0 step time: {med[1] / med[0]:.3f}")
    Path(args.json).write_text(json.dumps({"model": args.model, "options": args.extra, "median_step_s": med,
                                           "step_times": times, "ratio": med[1] / med[0]}, indent=1))


if __name__ == "__main__":
    main()
