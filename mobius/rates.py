"""``python -m mobius.rates``: the rates a plan is made from, measured on this machine where they
are used and at the sizes they are used, printed as one table.

* **Host AdamW** per worker count: ``w`` processes at once, each with its share of the cores (as
  ``w`` workers' optimizer threads run), each stepping the runtime's own fused AdamW on a
  stage-sized tensor (:data:`~mobius.partition.profile.ADAM_TIMING_NUMEL`, out of cache).  Kept
  where the planner reads a measured host rate (:data:`~mobius.runtime.plan_check.HOST_RATES`),
  so the next plan on this machine uses it.
* On each CUDA GPU: pinned host-to-device and device-to-host copies, alone and with every GPU of
  its root complex copying at once (:mod:`topology.bandwidth`); a dense GEMM, causal attention and
  one of the model's blocks (forward and backward) at the profile's shapes, as TFLOPS and as a
  fraction of the topology's peak; AdamW on the device.  On CPU workers the same code times the
  CPU (no peak to compare with; no copies to time).

Measured once per machine, settings and code (:func:`mobius.planning.prepare.measured_on`), cached and
validated on read; ``--write FILE`` stores the measured topology (copy rates, the host's AdamW as
its memory bandwidth, each GPU's block efficiency) for plans made elsewhere (``mobius.plan
--topology FILE``).
"""

from __future__ import annotations

from mobius.boundary.errors import quiet_interrupts_while_importing

if __name__ == "__main__":
    quiet_interrupts_while_importing()

# ruff: noqa: E402
import json
import math
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from mobius.boundary.cache import Cache, key_of
from mobius.boundary.ownership import check_output_file, output_locks, write_output_file
from mobius.boundary.errors import InputError, exits_cleanly, shown
from mobius.config import OneLineParser
from mobius.models import PRESETS, build_layer
from mobius.models.precision import DTYPES, default_precision
from mobius.partition.profile import (
    ADAM_BYTES_PER_PARAM,
    ADAM_TIMING_NUMEL,
    measure_adam_rate,
    measure_device_adam_rate,
    time_layer,
)
from mobius.planning.prepare import measured_on, this_host_key
from mobius.runtime.device import cpu_threads_per_worker, cuda_available, time_per_call
from mobius.runtime.plan_check import HOST_RATES
from mobius.swap.disk import measure_drive, shares_a_file_system
from topology import Drive, Topology, TopologyError, load_topology
from topology.probe import drive_name

RATES = Cache("rates", "measured rates")
RATES_VERSION = 1  # part of every entry's key: rates measured by older code are measured again
REPEATS = 5


def _one_of(workers: int, barrier, numel: int, repeats: int) -> float:
    """In one of ``workers`` processes, once every process is ready (they share the host's memory
    bandwidth, as workers' optimizer threads do): the profiler's timing of AdamW with one worker's
    share of the cores."""
    barrier.wait()
    return measure_adam_rate(workers, numel, repeats)


def host_adam_rates(workers: int, numel: int = ADAM_TIMING_NUMEL, repeats: int = 3) -> list[float]:
    """Each of ``workers`` processes' AdamW rate (parameters/s) with all of them stepping at once."""
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager:
        barrier = manager.Barrier(workers)
        with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
            return list(pool.map(_one_of, [workers] * workers, [barrier] * workers, [numel] * workers,
                                 [repeats] * workers))


def _warm_time(fn, device: torch.device) -> float:
    """Seconds per call after one untimed call: the first call of a kernel pays for the library's
    set-up (a cuBLAS handle and its heuristics, the attention backend's choice), which once counted
    made an H100's GEMM read 6 TFLOPS."""
    fn()
    return time_per_call(fn, device, REPEATS)


def device_rates(config, micro_batch: int, seq_len: int, precision: str, device: torch.device) -> dict:
    """TFLOPS of a GEMM, causal attention and one block (forward and backward) at the profile's
    shapes on ``device``, and its AdamW rate."""
    dtype, tokens, h = DTYPES[precision], micro_batch * seq_len, config.hidden
    a = torch.randn(tokens, h, device=device, dtype=dtype)
    w = torch.randn(h, 4 * h, device=device, dtype=dtype)
    gemm_s = _warm_time(lambda: a @ w, device)
    heads = config.heads
    q = torch.randn(micro_batch, heads, seq_len, h // heads, device=device, dtype=dtype)
    attention_s = _warm_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device)
    block = 1  # the first transformer block: every block of these models costs the same
    fwd_s, fwd_bwd_s = time_layer(config, block, micro_batch, seq_len, dtype, device, REPEATS, 1)
    flops = build_layer(config, block, seed=0, device="meta").forward_flops(micro_batch, seq_len)
    return {"gemm_tflops": 2 * tokens * h * 4 * h / gemm_s / 1e12,
            # causal: half of the 4 * t^2 * d multiply-adds of the two products, per head
            "attention_tflops": 2 * micro_batch * heads * seq_len ** 2 * (h // heads) / attention_s / 1e12,
            # the block as the analytic profile counts it: backward twice forward
            "block_tflops": 3 * flops / fwd_bwd_s / 1e12, "block_fwd_s": fwd_s, "block_fwd_bwd_s": fwd_bwd_s,
            "adam_params_per_s": measure_device_adam_rate(device)}


def measure(topo: Topology, workers: list[int], model: str, micro_batch: int, seq_len: int, precision: str) -> dict:
    """Every rate of the table (see the module's docstring), as one JSON-able dict."""
    config = PRESETS[model]
    result: dict = {"host_adam": {str(w): host_adam_rates(w) for w in workers}}
    if cuda_available() and not topo.virtual:
        from topology.bandwidth import measure as measure_copies

        result["copies"] = measure_copies(topo)
        result["devices"] = {str(g.index): device_rates(config, micro_batch, seq_len, precision,
                                                        torch.device("cuda", g.index)) for g in topo.gpus}
    else:
        result["devices"] = {"cpu": device_rates(config, micro_batch, seq_len, precision, torch.device("cpu"))}
    return result


def checked(found: dict) -> dict:
    """A cached entry: every leaf a positive finite number."""
    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for k, v in enumerate(node):
                walk(v, f"{where}[{k}]")
        elif isinstance(node, bool) or not isinstance(node, (int, float)) or not (math.isfinite(node) and node > 0):
            raise ValueError(f"{where} is {node!r}, not a rate")

    walk(found, "rates")
    if not found.get("host_adam") or not found.get("devices"):
        raise ValueError("the entry has no host or device rates")
    return found


def table(rates: dict, topo: Topology, model: str, micro_batch: int, seq_len: int, precision: str) -> str:
    rows = [("rate", "measured", "how")]
    for w, each in rates["host_adam"].items():
        threads = cpu_threads_per_worker(int(w))
        rows.append((f"host AdamW, {w} worker{'s at once' if w != '1' else ''}",
                     f"{statistics.median(each) / 1e6:,.0f} M parameters/s" + (" each" if w != "1" else ""),
                     f"the runtime's fused AdamW on {ADAM_TIMING_NUMEL:,} parameters, {threads} "
                     f"thread{'s' if threads > 1 else ''}" + (" each" if w != "1" else "")))
    for gpu, r in rates.get("copies", {}).get("solo", {}).items():
        rows.append((f"pinned copies, GPU {gpu} alone", f"{r['h2d']:.1f} / {r['d2h']:.1f} GB/s",
                     "host-to-device / device-to-host, 256 MiB"))
    for rc, r in rates.get("copies", {}).get("concurrent", {}).items():
        rows.append((f"pinned copies, root complex {rc}, its GPUs at once", f"{r['h2d']:.1f} / {r['d2h']:.1f} GB/s",
                     "summed over its GPUs"))
    shape = f"{micro_batch}x{seq_len} tokens, {precision}"
    for where, r in rates["devices"].items():
        name = "CPU" if where == "cpu" else f"GPU {where}"
        peak = None if where == "cpu" else topo.gpus[int(where)].tflops

        def of_peak(tflops: float) -> str:
            return f"{tflops / peak:.0%} of the topology's {peak:g} TFLOPS" if peak else "no peak to compare with"

        h = PRESETS[model].hidden
        rows += [(f"GEMM, {name}", f"{r['gemm_tflops']:.1f} TFLOPS",
                  f"[{micro_batch * seq_len}x{h}] @ [{h}x{4 * h}] {precision}; {of_peak(r['gemm_tflops'])}"),
                 (f"causal attention, {name}", f"{r['attention_tflops']:.1f} TFLOPS", f"{model}'s heads, {shape}"),
                 (f"{model} block fwd+bwd, {name}", f"{r['block_tflops']:.1f} TFLOPS",
                  f"{shape}; {of_peak(r['block_tflops'])}"),
                 (f"device AdamW, {name}", f"{r['adam_params_per_s'] / 1e6:,.0f} M parameters/s",
                  f"{ADAM_TIMING_NUMEL:,} parameters")]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)


def measured_topology(topo: Topology, rates: dict, micro_batch: int, seq_len: int) -> Topology:
    """``topo`` with what was measured: copy rates, the host's memory bandwidth as its AdamW implies
    (:func:`~mobius.partition.profile.host_adam_rate` inverted, with ``topo.n`` workers), and each
    GPU's block efficiency at these micro-batches (the analytic profile's, anchored there)."""
    each = rates["host_adam"].get(str(topo.n))
    if each:
        topo.host_memory_bandwidth_gbps = round(statistics.median(each) * ADAM_BYTES_PER_PARAM * topo.n / 1e9, 2)
    if "copies" in rates:
        from topology.bandwidth import apply_measurement

        topo = apply_measurement(topo, rates["copies"])
    for g in topo.gpus:
        r = rates["devices"].get(str(g.index))
        if r is not None:
            g.extra["block_efficiency"] = {"tokens": micro_batch * seq_len,
                                           "fraction": round(r["block_tflops"] / g.tflops, 4)}
            g.extra["adam_params_per_s"] = round(r["adam_params_per_s"])
    return topo


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m mobius.rates", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="auto", help="auto (this machine), a preset name, or a topology JSON file")
    p.add_argument("--cpu-workers", type=int, default=2, help="CPU workers of this machine when it has no GPU")
    p.add_argument("--workers", default=None,
                   help="comma-separated worker counts to time the host AdamW with (default: 1 and the topology's)")
    p.add_argument("--model", default="mobius-3b", choices=sorted(PRESETS),
                   help="whose shapes the GEMM, attention and block are timed at")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--precision", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--drive", action="append", default=[], metavar="DIR",
                   help="time the drive under DIR (sequential write and read, as --offload-dir uses it) and record it "
                        "in --write's topology as one of its drives; give it once per drive")
    p.add_argument("--drive-gb", type=float, default=2.0, help="bytes each drive is timed with, in GB")
    p.add_argument("--write", default=None, help="write the measured topology to this (new) file")
    p.add_argument("--no-cache", action="store_true", help="measure again, replacing what is cached")
    return p


def worker_counts(text: str | None, topo: Topology) -> list[int]:
    if text is None:
        return sorted({1, topo.n})
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise InputError(f"--workers must be comma-separated counts, got {text!r}") from None
    if not counts or counts[0] < 1 or counts[-1] > 256:
        raise InputError(f"--workers counts must be between 1 and 256, got {text!r}")
    return counts


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cpu_workers < 1 or args.micro_batch_size < 1 or args.seq_len < 1:
        raise InputError("--cpu-workers, --micro-batch-size and --seq-len must be positive")
    if not 1e-6 <= args.drive_gb <= 1e4:
        raise InputError(f"--drive-gb must be between 1e-6 and 10000, got {args.drive_gb}")
    for directory in args.drive:
        if not Path(directory).is_dir():
            raise InputError(f"--drive {shown(directory)} is not a directory")
    if shares_a_file_system(args.drive):
        raise InputError("two --drive directories are on one file system: give one directory on each drive")
    try:
        topo = load_topology(args.topology, cpu_workers=args.cpu_workers)
    except TopologyError as err:
        raise InputError(str(err)) from None
    if args.write:
        check_output_file("--write", args.write)
    # The file to write is ours to write from the check to the write: no other run of ours writes it
    # meanwhile, and one that appeared there is left alone (write_output_file).
    with output_locks({"--write": args.write} if args.write else {}):
        _measure(args, topo)


def _measure(args, topo: Topology) -> None:
    """The rates measured (or cached), the drives timed, and ``--write``'s topology file written."""
    on_gpus = cuda_available() and not topo.virtual
    precision = args.precision or default_precision(on_gpus)  # the training runs' rule
    config = PRESETS[args.model]
    if args.seq_len > config.context:
        raise InputError(f"--seq-len {args.seq_len} exceeds {args.model}'s context of {config.context}")
    workers = worker_counts(args.workers, topo)
    key = key_of([RATES_VERSION, measured_on(), topo.to_dict(), workers, args.model, args.micro_batch_size,
                  args.seq_len, precision])
    rates = None if args.no_cache else RATES.get(key, checked)
    if rates is None:
        print(f"measuring on {'the GPUs' if on_gpus else 'this CPU'} (once for these settings on this machine "
              "and code; cached) ...", flush=True)
        rates = checked(measure(topo, workers, args.model, args.micro_batch_size, args.seq_len, precision))
        RATES.put(key, rates)
    for w, each in rates["host_adam"].items():  # what the next plan on this machine reads
        HOST_RATES.put(this_host_key(int(w)), {"adam_params_per_s": statistics.median(each)})
    print(table(rates, topo, args.model, args.micro_batch_size, args.seq_len, precision))
    print("the host AdamW rates are kept for the next plans on this machine")
    drives = []
    for k, directory in enumerate(args.drive):
        read, write = measure_drive(directory, int(args.drive_gb * 1e9))
        name = drive_name(os.stat(directory).st_dev) or f"drive{k}"
        drives.append(Drive(name, round(read, 3), round(write, 3)))
        print(f"drive {k}, {name}, under {shown(directory)}: read {read:.2f} GB/s, write {write:.2f} GB/s "
              f"(sequential, {args.drive_gb:g} GB, past the page cache)")
    if args.write:
        measured = measured_topology(topo, rates, args.micro_batch_size, args.seq_len)
        measured.drives = drives or measured.drives
        write_output_file("--write", args.write, json.dumps(measured.to_dict(), indent=2) + "\n")
        print(f"wrote {shown(args.write)}")


if __name__ == "__main__":
    main()
