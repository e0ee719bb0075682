"""What data-parallel replicas save each node, measured: D replicas of the pipeline on this
machine's CPU workers (each replica standing for a node), against one.

Per replica (= per node): the parameters its hosts' AdamW updates per step and their CPU seconds,
summed over its workers' ``AdamW`` spans in the run's trace (``params``, ``cpu_s``; predicted: 1/D
of one replica's).  Here every replica's workers share this machine's cores and memory bandwidth,
which stretches each one's AdamW (memory-bound) beyond what separate nodes would see: the
parameters are the clean measure, the seconds an upper bound, and the resident set of its
worker processes while steps run (median of 0.2 s samples) per parameter of the model (predicted
to fall by AdamW's 8 bytes x (1 - 1/D): each host keeps the moments of its share only).  The RSS
also holds each worker's torch runtime and its stand-in device memory, whose peak is printed
beside it.  Give ``--device-optimizer off`` so that no variant
keeps AdamW state in its (stand-in) device memory.  The losses of every variant are printed beside each other: they must
agree (the tests hold them to the reference trainer within 1e-5).

With ``--cores-per-node K`` each variant runs on K cores per replica, so that each node's workers
(and their thread counts) have the same cores at every D, as separate nodes would; the memory bus
is still this machine's.

    python scripts/bench_replicas.py [--replicas 1 2] [--cores-per-node K] [--json FILE] -- <mobius.train options>
    python scripts/bench_replicas.py --smoke    # two replicas of the tiny model, 2 steps (seconds)
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
    """Resident bytes of every worker of the run ``root`` launched, by rank.  The workers are the
    processes multiprocessing spawned under it; the elastic launcher starts them in rank order, so
    their process ids sort as their ranks (their ``RANK`` is set after they start, out of
    ``/proc/PID/environ``'s sight)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                children[int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    workers, todo = [], list(children[root])
    while todo:
        pid = todo.pop()
        todo += children[pid]
        try:
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                workers.append((pid, int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE))
        except (OSError, ValueError, IndexError):
            continue
    return {rank: rss for rank, (_, rss) in enumerate(sorted(workers))}


def run(options: list[str], replicas: int, workers: int, tmp: Path, cores_per_node: int | None) -> dict:
    metrics, trace = tmp / f"m{replicas}.jsonl", tmp / f"t{replicas}.json"
    # CPU workers keep freed memory, as CUDA's caching allocator does; off here, so their RSS is what
    # they hold (see scripts/measure_host_memory.py).
    env = {**os.environ, "MOBIUS_KEEP_FREED_MEMORY": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "mobius.train", *options, "--data-parallel", str(replicas),
                             "--metrics", str(metrics), "--trace", str(trace), "--no-progress"],
                            stdout=subprocess.DEVNULL, env=env,
                            preexec_fn=None if cores_per_node is None else
                            lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:replicas * cores_per_node]))
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
    adam, updated = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("AdamW "):
            adam[int(e["pid"]) // workers] += e["args"]["cpu_s"]
            updated[int(e["pid"]) // workers] += e["args"]["params"]
    steps = len(history)
    device = workers * max(m["peak_device_bytes"] for m in history)  # the stand-in GPUs' memory, in the RSS too
    return {"replicas": replicas, "losses": [m["loss"] for m in history],
            "step_s": statistics.median(m["step_time_s"] for m in history[1:] or history),
            "adam_s_per_step": [adam[r] / steps for r in range(replicas)],
            "adam_params_per_step": [updated[r] / steps for r in range(replicas)],
            "rss_bytes": [statistics.median(samples[r]) for r in range(replicas)] if samples else [],
            "device_peak_bytes": device,
            "rss_samples": min((len(s) for s in samples.values()), default=0)}


SMOKE = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2", "--topology", "cpu",
         "--device-optimizer", "off"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cores-per-node", type=int, default=None, metavar="K",
                   help="run each variant on K cores per replica (the first D*K cores of this process's), so "
                        "that a node's optimizer has the same cores at every D; default: every variant on all")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="two replicas of the tiny model, 2 steps")
    p.add_argument("train", nargs="*", help="mobius.train options (after --), CPU workers")
    args = p.parse_args(argv)
    if args.smoke:
        args.train, args.replicas = SMOKE, [2]
    if not args.train:
        p.error("give the mobius.train options after --")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mobius.config import parse_train_args
    from mobius.models import build_model
    from mobius.runtime.inputs import model_config_for

    cfg = parse_train_args(args.train)
    if args.cores_per_node is not None and not 0 < max(args.replicas) * args.cores_per_node <= len(
            os.sched_getaffinity(0)):
        raise SystemExit(f"--cores-per-node {args.cores_per_node} x {max(args.replicas)} replicas is more than "
                         f"this process's {len(os.sched_getaffinity(0))} cores")
    n_params = build_model(model_config_for(cfg), device="meta").num_parameters()
    with tempfile.TemporaryDirectory(prefix="mobius-replicas-") as tmp:
        rows = [run(args.train, d, cfg.cpu_workers, Path(tmp), args.cores_per_node) for d in args.replicas]
    base = rows[0]
    cores = f", {args.cores_per_node} cores per replica" if args.cores_per_node else ""
    print(f"{' '.join(args.train)}: {n_params / 1e6:.1f}M parameters, {cfg.cpu_workers} CPU workers per replica{cores}")
    print(f"{'D':>2} {'AdamW params/node':>17} {'x':>5} {'AdamW CPU s/node':>16} {'x':>5} {'predicted':>9} "
          f"{'RSS GB/node':>11} {'device GB':>9} {'B/param':>8} {'drop':>6} {'predicted':>9} {'step s':>7}  losses")
    for r in rows:
        adam = statistics.mean(r["adam_s_per_step"])
        rss = statistics.mean(r["rss_bytes"]) if r["rss_bytes"] else float("nan")
        base_rss = statistics.mean(base["rss_bytes"]) if base["rss_bytes"] else float("nan")
        drop = (base_rss - rss) / n_params
        predicted_drop = 8 * (1 / base["replicas"] - 1 / r["replicas"])
        params = statistics.mean(r["adam_params_per_step"])
        r.update(adam_ratio=adam / statistics.mean(base["adam_s_per_step"]), rss_bytes_per_param=rss / n_params,
                 params_ratio=params / statistics.mean(base["adam_params_per_step"]),
                 rss_drop_bytes_per_param=drop, predicted_drop_bytes_per_param=predicted_drop)
        print(f"{r['replicas']:>2} {params / 1e6:>16.1f}M {r['params_ratio']:>5.2f} {adam:>16.3f} "
              f"{r['adam_ratio']:>5.2f} "
              f"{base['replicas'] / r['replicas']:>9.2f} "
              f"{rss / 1e9:>11.2f} {r['device_peak_bytes'] / 1e9:>9.2f} "
              f"{rss / n_params:>8.2f} {drop:>6.2f} {predicted_drop:>9.2f} {r['step_s']:>7.2f}  "
              + " ".join(f"{x:.6f}" for x in r["losses"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"options": args.train, "parameters": n_params, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
