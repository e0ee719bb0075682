"""chunked_dp: the searched configuration for Elixir's GPT-2 models, and step time on this machine.

Part 1 prints, for Elixir's Table 6 models (GPT2-4b/10b/15b/20b, tied embeddings) on ``dgx-a100``
and on one 40 GB A100: the searched chunk size, number of chunks, rCache blocks and the fraction
of chunks kept (with their AdamW) on the device.  Part 2 runs the chunked backend and the reference
trainer here and compares step times (``--cuda``: on this machine's GPUs, with prefetch as built).

    python scripts/bench_chunked.py [--json bench_chunked.json] [--workers 2] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from chunked_dp.chunks import trace_first_use
from chunked_dp.search import search
from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.launcher import launch_chunked
from mobius.models import GPTConfig, get_config
from mobius.reference import ReferenceTrainer
from topology import cpu_topology, load_preset, load_topology
from topology.model import GPU, RootComplex, Topology

ELIXIR_TABLE6 = {"GPT2-4b": (3072, 32, 24), "GPT2-10b": (4096, 48, 32), "GPT2-15b": (8192, 18, 64),
                 "GPT2-20b": (8192, 24, 64)}
ONE_A100 = Topology("1xA100-40GB", 512, [RootComplex(0, 25.0)], [GPU(0, "A100-SXM4-40GB", 40, 312, 0, 25.0)])


def search_table(activation_gb: float) -> list[dict]:
    rows = []
    for name, (h, layers, heads) in ELIXIR_TABLE6.items():
        config = GPTConfig(50257, 1024, layers, h, heads, bias=True, tie_embeddings=True)
        t0 = time.perf_counter()
        trace = trace_first_use(config)
        for topo in (load_preset("dgx-a100"), ONE_A100):
            r = search(trace, topo, activation_bytes=activation_gb * 1e9)
            rows.append({"model": name, "topology": topo.name, "chunk_elements": r.chunk_size, "chunks": r.n_chunks,
                         "rcache_blocks": r.n_block, "device_fraction": r.device_fraction,
                         "search_s": time.perf_counter() - t0})
            print(f"{name:>9} {topo.name:>12} | chunk {r.chunk_size / 1e6:7.1f}M elements x {r.n_chunks:>3} | "
                  f"rCache {r.n_block:>3} blocks | on device {r.device_fraction:5.0%}", flush=True)
    return rows


def median(history) -> float:
    return statistics.median(m.step_time_s for m in history[1:])


def timing(workers: int, cuda: bool, steps: int) -> list[dict]:
    base = dict(model="small", steps=steps, micro_batch_size=4, micro_batches=4, seq_len=128, progress=False,
                precision="bf16" if cuda else "fp32")
    cfg = RunConfig.of(**base, backend="single")
    batches = BatchSource(load_corpus(None), 128, 4, 4, 0)
    ref = ReferenceTrainer(cfg, get_config("small"), batches, torch.device("cuda" if cuda else "cpu"))
    single = median([ref.step(k) for k in range(steps)])
    rows = [{"config": "single", "step_s": single}]
    for offload in ("off", "on"):
        cfg = RunConfig.of(**base, backend="chunked", topology="auto" if cuda else "cpu", cpu_workers=workers,
                           offload=offload)
        topo = load_topology("auto") if cuda else cpu_topology(workers)
        history = launch_chunked(cfg, get_config("small"), topo)
        rows.append({"config": f"chunked {topo.n} worker(s), offload {offload}", "step_s": median(history),
                     "h2d_mb": history[-1].h2d_bytes / 1e6, "peer_mb": history[-1].peer_bytes / 1e6})
    print(f"\nsmall, {base['precision']}, 4x4x128 tokens per step, median of steps 1..{steps - 1}")
    for r in rows:
        print(f"{r['config']:<34} {r['step_s']:7.3f} s  ({r['step_s'] / single - 1:+.0%} vs single)")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bench_chunked.json")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--activation-gb", type=float, default=4.0, help="activation memory per GPU for A.1")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    rows = {"search": search_table(args.activation_gb), "timing": timing(args.workers, args.cuda, args.steps)}
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
