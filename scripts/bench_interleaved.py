"""Step time of variants of one run, measured on the real runtime, interleaved.

Each round runs ``python -m mobius.train`` once per variant (the common options plus the variant's
own, in turn, so a noisy machine slows every variant alike); the table gives each variant's median
step time (the first two steps of each run, warm-up, excluded) and its ratio to the first.

    python scripts/bench_interleaved.py --variant "lag 0=" --variant "lag 1=--optimizer-lag 1" \\
        [--rounds 3] [--json FILE] -- --model small --steps 12
    python scripts/bench_interleaved.py --smoke   # one round of the lags on the tiny model (seconds)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(options: list[str], metrics: Path) -> list[float]:
    metrics.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "mobius.train", *options, "--metrics", str(metrics), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][2:]


SMOKE = {"variants": ["lag 0=", "lag 1=--optimizer-lag 1"],
         "common": ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "3", "--backend",
                    "single"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", help="NAME=OPTIONS (OPTIONS may be empty)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="bench_interleaved.json")
    p.add_argument("--smoke", action="store_true", help="one round of --optimizer-lag 0 and 1 on the tiny model")
    p.add_argument("common", nargs="*", help="mobius.train options every variant shares (after --)")
    args = p.parse_args(argv)
    if args.smoke:
        args.variant, args.common, args.rounds = SMOKE["variants"], SMOKE["common"], 1
    if not args.variant:
        p.error("give at least one --variant NAME=OPTIONS")
    variants = dict(v.split("=", 1) for v in args.variant)
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="mobius-bench-") as tmp:
        for _ in range(args.rounds):
            for name, own in variants.items():
                times[name] += run(args.common + shlex.split(own), Path(tmp) / "m.jsonl")
    med = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(med.values()))
    print(f"common options: {' '.join(args.common) or '(default run)'}; {args.rounds} rounds")
    print(f"{'variant':>20} {'options':>28} {'median step s':>14} {'steps':>6} {'ratio':>6}")
    for name, own in variants.items():
        print(f"{name:>20} {own or '-':>28} {med[name]:>14.3f} {len(times[name]):>6} {med[name] / first:>6.3f}")
    Path(args.json).write_text(json.dumps({"common": args.common, "variants": variants, "median_step_s": med,
                                           "step_times": times}, indent=1))


if __name__ == "__main__":
    main()
