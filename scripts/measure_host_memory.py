"""Host memory of a real run: the resident set (RSS) of the training process and all its workers,
sampled every 0.2 s, per parameter of the model.

The number reported is the median of the samples taken while steps run (after the first step's
metrics line appears), divided by the model's parameter count; the peak is printed too.  It
includes everything a process holds: the stage stores, torch's own runtime (a few hundred MB per
process), activations and the data.

    python scripts/measure_host_memory.py [--json FILE] -- <mobius.train options>
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


def tree_rss(root: int) -> int:
    """Bytes resident in ``root`` and every descendant process."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
        todo += children.get(pid, [])
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="host_memory.json")
    p.add_argument("train", nargs="+", help="mobius.train options (after --)")
    args = p.parse_args()
    from mobius.config import parse_train_args
    from mobius.models import build_model
    from mobius.runtime.inputs import model_config_for

    cfg = parse_train_args(args.train)
    n_params = build_model(model_config_for(cfg), device="meta").num_parameters()
    with tempfile.TemporaryDirectory(prefix="mobius-mem-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "mobius.train", *args.train, "--metrics", str(metrics),
                                 "--no-progress"], stdout=subprocess.DEVNULL)
        during, peak = [], 0
        while proc.poll() is None:
            rss = tree_rss(proc.pid)
            peak = max(peak, rss)
            if metrics.is_file() and metrics.stat().st_size:
                during.append(rss)
            time.sleep(0.2)
        if proc.returncode:
            raise SystemExit(f"the run failed (exit {proc.returncode})")
    median = statistics.median(during) if during else float("nan")
    print(f"{' '.join(args.train)}: {n_params / 1e6:.1f}M parameters")
    print(f"RSS while training (median of {len(during)} samples): {median / 1e9:.2f} GB = "
          f"{median / n_params:.2f} bytes/parameter; peak {peak / 1e9:.2f} GB = {peak / n_params:.2f} bytes/parameter")
    Path(args.json).write_text(json.dumps({"options": args.train, "parameters": n_params, "rss_median_bytes": median,
                                           "rss_peak_bytes": peak, "samples": len(during)}, indent=1))


if __name__ == "__main__":
    main()
