"""Host memory of a real run: the resident set (RSS) of the training process and all its workers,
sampled every 0.2 s, per parameter of the model.

The number reported is the median of the samples taken while steps run (after the first step's
metrics line appears), divided by the model's parameter count; the peak is printed too.  It
includes everything a process holds: the stage stores, torch's own runtime (a few hundred MB per
process), activations and the data, and on CPU workers their stand-in "device" memory (reported
apart, from the run's peak_device_bytes).  The workers run with ``MOBIUS_KEEP_FREED_MEMORY=0``:
their policy of keeping freed memory in the heap (which mimics the CUDA caching allocator) would
otherwise keep freed stand-in device slabs in the RSS.

    python scripts/measure_host_memory.py [--json FILE] -- <mobius.train options>
    python scripts/measure_host_memory.py --smoke    # the tiny model on 2 CPU workers, 3 steps (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss(root: int) -> tuple[int, int]:
    """Bytes resident in ``root`` and every descendant process, and in the descendants alone (the
    workers)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, workers, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            rss = 0
        total += rss
        workers += rss if pid != root else 0
        todo += children.get(pid, [])
    return total, workers


SMOKE = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "3", "--topology", "cpu"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="host_memory.json")
    p.add_argument("--smoke", action="store_true", help="the tiny model on 2 CPU workers, 3 steps")
    p.add_argument("train", nargs="*", help="mobius.train options (after --)")
    args = p.parse_args(argv)
    if args.smoke:
        args.train = SMOKE
    if not args.train:
        p.error("give the mobius.train options after --")
    from mobius.config import parse_train_args
    from mobius.models import build_model
    from mobius.runtime.inputs import model_config_for

    cfg = parse_train_args(args.train)
    n_params = build_model(model_config_for(cfg), device="meta").num_parameters()
    with tempfile.TemporaryDirectory(prefix="mobius-mem-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        # CPU workers keep freed memory in their heap, as the CUDA caching allocator keeps device
        # memory; here their stand-in device slabs would stay in the RSS after being freed, so
        # the policy is off and only the device memory in use is in the RSS.
        env = {**os.environ, "MOBIUS_KEEP_FREED_MEMORY": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "mobius.train", *args.train, "--metrics", str(metrics),
                                 "--no-progress"], stdout=subprocess.DEVNULL, env=env)
        during, during_workers, peak = [], [], 0
        while proc.poll() is None:
            rss, workers = tree_rss(proc.pid)
            peak = max(peak, rss)
            if metrics.is_file() and metrics.stat().st_size:
                during.append(rss)
                during_workers.append(workers)
            time.sleep(0.2)
        if proc.returncode:
            raise SystemExit(f"the run failed (exit {proc.returncode})")
        device_peak = max(json.loads(line)["peak_device_bytes"] for line in metrics.read_text().splitlines())
    median = statistics.median(during) if during else float("nan")
    median_workers = statistics.median(during_workers) if during_workers else float("nan")
    print(f"{' '.join(args.train)}: {n_params / 1e6:.1f}M parameters")
    print(f"RSS while training (median of {len(during)} samples): workers {median_workers / 1e9:.2f} GB = "
          f"{median_workers / n_params:.2f} bytes/parameter; with the launching process {median / 1e9:.2f} GB = "
          f"{median / n_params:.2f} bytes/parameter; peak of all {peak / 1e9:.2f} GB")
    # CPU workers stand in for GPUs: their "device" memory is host memory and sits in their RSS.
    workers = cfg.cpu_workers
    host_side = median_workers - workers * device_peak
    print(f"of which device memory of the {workers} CPU workers: at most {workers} x {device_peak / 1e9:.2f} GB; "
          f"host side at least {host_side / 1e9:.2f} GB = {host_side / n_params:.2f} bytes/parameter")
    Path(args.json).write_text(json.dumps({"options": args.train, "parameters": n_params, "rss_median_bytes": median,
                                           "rss_workers_median_bytes": median_workers, "rss_peak_bytes": peak, "device_peak_bytes_per_worker": device_peak,
                                           "samples": len(during)}, indent=1))


if __name__ == "__main__":
    main()
