"""chunked_dp: the searched configuration for Elixir's GPT-2 models, and step time on this machine.

Part 1 prints, for Elixir's Table 6 models (GPT2-4b/10b/15b/20b, tied embeddings) on ``dgx-a100``
and on one 40 GB A100: the searched chunk size, number of chunks, rCache blocks and the fraction
of chunks kept (with their AdamW) on the device.  Part 2 runs the chunked backend and the reference
trainer here and compares step times (``--cuda``: on this machine's GPUs, with prefetch as built).
Part 3 (``--emulate TOPOLOGY``, instead of parts 1 and 2) runs the chunked engine and the pipeline
on that emulated box, both at one dilation (the larger either needs), for each ``--gpu-mem-gb``:
each backend's predicted and measured emulated step, and chunked over pipeline.

    python scripts/bench_chunked.py [--json bench_chunked.json] [--workers 2] [--cuda]
    python scripts/bench_chunked.py --emulate 1xh100 [--gpu-mem-gb 0.3 0.5] [--steps 3]
    python scripts/bench_chunked.py --smoke     # seconds: one Table 6 model, the ``tiny`` model timed

``--smoke``: part 1 for GPT2-4b alone, part 2 on the ``tiny`` model (2 steps of 2x2x32 tokens,
offload on only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from chunked_dp.chunks import trace_first_use
from chunked_dp.prepare import prepare_chunked
from chunked_dp.search import search
from mobius.backends import resolve
from mobius.backends.chunked import launch_chunked
from mobius.config import RunConfig, parse_train_args
from mobius.data import BatchSource, load_corpus
from mobius.models import GPTConfig, get_config
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.prepare import resolve_topology
from mobius.reference import ReferenceTrainer
from mobius.runtime.inputs import check_model_input
from topology import cpu_topology, load_preset, load_topology
from topology.model import GPU, RootComplex, Topology

ELIXIR_TABLE6 = {"GPT2-4b": (3072, 32, 24), "GPT2-10b": (4096, 48, 32), "GPT2-15b": (8192, 18, 64),
                 "GPT2-20b": (8192, 24, 64)}
ONE_A100 = Topology("1xA100-40GB", 512, [RootComplex(0, 25.0)], [GPU(0, "A100-SXM4-40GB", 40, 312, 0, 25.0)])


def search_table(activation_gb: float, models: list[str] = list(ELIXIR_TABLE6)) -> list[dict]:
    rows = []
    for name in models:
        h, layers, heads = ELIXIR_TABLE6[name]
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


def timing(workers: int, cuda: bool, steps: int, model: str = "small", shape: tuple[int, int, int] = (4, 4, 128),
           offloads: tuple[str, ...] = ("off", "on")) -> list[dict]:
    micro_batch, micro_batches, seq_len = shape
    base = dict(model=model, steps=steps, micro_batch_size=micro_batch, micro_batches=micro_batches, seq_len=seq_len,
                progress=False, precision="bf16" if cuda else "fp32")
    cfg = RunConfig.of(**base, backend="single")
    batches = BatchSource(load_corpus(None), seq_len, micro_batch, micro_batches, 0)
    ref = ReferenceTrainer(cfg, get_config(model), batches, torch.device("cuda" if cuda else "cpu"))
    single = median([ref.step(k) for k in range(steps)])
    rows = [{"config": "single", "step_s": single}]
    for offload in offloads:
        cfg = RunConfig.of(**base, backend="chunked", topology="auto" if cuda else "cpu", cpu_workers=workers,
                           offload=offload)
        topo = load_topology("auto") if cuda else cpu_topology(workers)
        history = launch_chunked(resolve(cfg, topo, "chunked"), get_config(model))
        rows.append({"config": f"chunked {topo.n} worker(s), offload {offload}", "step_s": median(history),
                     "h2d_mb": history[-1].h2d_bytes / 1e6, "peer_mb": history[-1].peer_bytes / 1e6})
    print(f"\n{model}, {base['precision']}, {micro_batches}x{micro_batch}x{seq_len} tokens per step, "
          f"median of steps 1..{steps - 1}")
    for r in rows:
        print(f"{r['config']:<34} {r['step_s']:7.3f} s  ({r['step_s'] / single - 1:+.0%} vs single)")
    return rows


EMULATED = "--model small --steps {steps} --gpu-mem-gb {mem} --emulate --backend {backend} --topology {topology}"


def emulated(topology: str, memories: list[float], steps: int) -> list[dict]:
    """Per memory budget: the chunked engine and the pipeline on one emulated ``topology``, each
    predicted (its own model: the plan, or the chunked setup's lanes) and measured (the median
    emulated step after the first), both at the dilation the slower-to-emulate of the two needs."""
    rows = []
    for mem in memories:
        options = {b: EMULATED.format(steps=steps, mem=mem, backend=b, topology=topology) for b in ("chunked", "pipeline")}
        predicted, factor = {}, 0.0
        for backend, line in options.items():
            cfg = parse_train_args(shlex.split(line))
            topo, model = resolve_topology(cfg), check_model_input(cfg)
            if backend == "chunked":
                spec = prepare_chunked(resolve(cfg, topo, "chunked"), model)
                predicted[backend] = spec.predicted_step_s()
            else:
                spec, plan = prepare_pipeline(resolve(cfg, topo, "pipeline"), model)
                predicted[backend] = plan.predicted_step_s
            factor = max(factor, spec.emulation.factor)
        measured = {}
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            for backend, line in options.items():
                subprocess.run([sys.executable, "-m", "mobius.train", *shlex.split(line), "--dilation", str(factor),
                                "--metrics", str(metrics), "--no-progress"], check=True, stdout=subprocess.DEVNULL)
                steps_s = [json.loads(r)["emulated_step_s"] for r in metrics.read_text().splitlines()]
                measured[backend] = statistics.median(steps_s[1:])
                metrics.unlink()
        row = {"gpu_mem_gb": mem, "dilation": factor,
               **{f"{b}_{k}_s": v for k, d in (("predicted", predicted), ("measured", measured)) for b, v in d.items()}}
        rows.append(row)
        print(f"{topology} at {mem} GB, 1/{factor:.0f}: chunked predicted {predicted['chunked'] * 1e3:.2f} ms, measured "
              f"{measured['chunked'] * 1e3:.2f} | pipeline predicted {predicted['pipeline'] * 1e3:.2f}, measured "
              f"{measured['pipeline'] * 1e3:.2f} | chunked / pipeline: predicted "
              f"{predicted['chunked'] / predicted['pipeline']:.2f}x, measured {measured['chunked'] / measured['pipeline']:.2f}x",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bench_chunked.json")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--activation-gb", type=float, default=4.0, help="activation memory per GPU for A.1")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--emulate", metavar="TOPOLOGY", help="part 3 only: chunked against the pipeline on this emulated box")
    p.add_argument("--gpu-mem-gb", type=float, nargs="+", default=[0.3, 0.5], help="part 3's memory budgets")
    p.add_argument("--smoke", action="store_true", help="GPT2-4b searched, the tiny model timed")
    args = p.parse_args(argv)
    if args.smoke:
        rows = {"search": search_table(args.activation_gb, ["GPT2-4b"]),
                "timing": timing(args.workers, args.cuda, 2, "tiny", (2, 2, 32), ("on",))}
    elif args.emulate:
        rows = {"emulated": emulated(args.emulate, args.gpu_mem_gb, args.steps)}
    else:
        rows = {"search": search_table(args.activation_gb), "timing": timing(args.workers, args.cuda, args.steps)}
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
