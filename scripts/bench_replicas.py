"""What data-parallel replicas save each node, measured: D replicas of the pipeline on this
machine's CPU workers (each replica standing for a node), against one.

Per replica (= per node): the host AdamW seconds per step, summed over its workers' ``AdamW``
spans in the run's trace (predicted: 1/D of one replica's), and the resident set of its worker
processes while steps run (median of 0.2 s samples, grouped by each process's ``RANK``), per
parameter of the model (predicted to fall by AdamW's 8 bytes x (1 - 1/D): each host keeps the
moments of its share only).  The losses of every variant are printed beside each other: they must
agree (the tests hold them to the reference trainer within 1e-5).

    python scripts/bench_replicas.py [--replicas 1 2] [--json FILE] -- <mobius.train options>
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
from collections import defaultdict
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def ranked_rss(root: int) -> dict[int, int]:
    """Resident bytes of every descendant of ``root`` that is a worker (has ``RANK``), by rank."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                children[int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = {}, list(children[root])
    while todo:
        pid = todo.pop()
        todo += children[pid]
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env and "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
            out[int(env["RANK"])] = rss
    return out


def run(options: list[str], replicas: int, workers: int, tmp: Path) -> dict:
    metrics, trace = tmp / f"m{replicas}.jsonl", tmp / f"t{replicas}.json"
    # CPU workers keep freed memory, as CUDA's caching allocator does; off here, so their RSS is what
    # they hold (see scripts/measure_host_memory.py).
    env = {**os.environ, "MOBIUS_KEEP_FREED_MEMORY": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "mobius.train", *options, "--data-parallel", str(replicas),
                             "--metrics", str(metrics), "--trace", str(trace), "--no-progress"],
                            stdout=subprocess.DEVNULL, env=env)
    samples: dict[int, list[int]] = defaultdict(list)
    while proc.poll() is None:
        if metrics.is_file() and metrics.stat().st_size:
            by_rank = ranked_rss(proc.pid)
            if len(by_rank) == replicas * workers:
                for replica in range(replicas):
                    samples[replica].append(sum(by_rank[replica * workers + p] for p in range(workers)))
        time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"the run with --data-parallel {replicas} failed (exit {proc.returncode})")
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    adam = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("AdamW "):
            adam[int(e["pid"]) // workers] += e["dur"] / 1e6
    steps = len(history)
    return {"replicas": replicas, "losses": [m["loss"] for m in history],
            "step_s": statistics.median(m["step_time_s"] for m in history[1:]) if steps > 1 else history[0]["step_time_s"],
            "adam_s_per_step": [adam[r] / steps for r in range(replicas)],
            "rss_bytes": [statistics.median(samples[r]) for r in range(replicas)] if samples else [],
            "rss_samples": min((len(s) for s in samples.values()), default=0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", default=None)
    p.add_argument("train", nargs="+", help="mobius.train options (after --), CPU workers")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mobius.config import parse_train_args
    from mobius.models import build_model
    from mobius.runtime.inputs import model_config_for

    cfg = parse_train_args(args.train)
    n_params = build_model(model_config_for(cfg), device="meta").num_parameters()
    with tempfile.TemporaryDirectory(prefix="mobius-replicas-") as tmp:
        rows = [run(args.train, d, cfg.cpu_workers, Path(tmp)) for d in args.replicas]
    base = rows[0]
    print(f"{' '.join(args.train)}: {n_params / 1e6:.1f}M parameters, {cfg.cpu_workers} CPU workers per replica")
    print(f"{'D':>2} {'AdamW s/step/node':>18} {'x of D=' + str(base['replicas']):>9} {'predicted':>9} "
          f"{'RSS GB/node':>11} {'B/param':>8} {'drop':>6} {'predicted':>9} {'step s':>7}  losses")
    for r in rows:
        adam = statistics.mean(r["adam_s_per_step"])
        rss = statistics.mean(r["rss_bytes"]) if r["rss_bytes"] else float("nan")
        base_rss = statistics.mean(base["rss_bytes"]) if base["rss_bytes"] else float("nan")
        drop = (base_rss - rss) / n_params
        predicted_drop = 8 * (1 / base["replicas"] - 1 / r["replicas"])
        r.update(adam_ratio=adam / statistics.mean(base["adam_s_per_step"]), rss_bytes_per_param=rss / n_params,
                 rss_drop_bytes_per_param=drop, predicted_drop_bytes_per_param=predicted_drop)
        print(f"{r['replicas']:>2} {adam:>18.3f} {r['adam_ratio']:>9.2f} {base['replicas'] / r['replicas']:>9.2f} "
              f"{rss / 1e9:>11.2f} {rss / n_params:>8.2f} {drop:>6.2f} {predicted_drop:>9.2f} {r['step_s']:>7.2f}  "
              + " ".join(f"{x:.6f}" for x in r["losses"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"options": args.train, "parameters": n_params, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
