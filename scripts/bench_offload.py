"""The disk tier's overlap: one optimizer step of S stages with AdamW's moments (``--masters``: and
the master weights) on disk (``mobius.swap.disk``, as ``--offload-dir`` runs it, block by block)
against its three lanes measured alone on the same blocks: reading every stage's state, writing it,
and the host's AdamW with the state in memory.  Overlapped, the step takes about the longest lane,
not their sum.

    python scripts/bench_offload.py [--dir DIR[,DIR...]] [--stages 8] [--params 8e6] [--repeats 3] [--json out.json]
                                    [--masters] [--smoke]

``DIR`` (default: a new directory under the system's temporary one) should be on the drive to
measure; several, one on each drive, stripe the state over them as ``--offload-dir`` does.  Before
every read the files' pages are dropped from the page cache (``posix_fadvise``), so reads come from
the drive; writes end with ``fsync``, so they reach it.  ``--smoke``: 2 stages of 1M parameters, one
repeat.

``--compare-io``: instead, the same bytes written (then ``fsync``) and read back sequentially in
16 MB requests through the page cache (as the tier does) and with ``O_DIRECT`` (past it), with 1, 4
and 8 requests in flight: the measurement the tier's choice of buffered I/O rests on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mobius.runtime.optim import UpdateRule, make_adamw  # noqa: E402
from mobius.swap.disk import DiskState, block_params  # noqa: E402
from mobius.swap.store import HostStage, Slot  # noqa: E402


def drop_cache(disk: DiskState) -> None:
    for fds in disk.fds.values():
        for fd in fds:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def host_stage(s: int, params: int, g: torch.Generator, master_on_disk: bool) -> HostStage:
    """A stage of one ``params``-element weight (its master flat), with AdamW and gradients (fp32:
    the compute copy is the master, or with the master on disk a copy of its own)."""
    master, grads = torch.randn(params, generator=g), torch.randn(params, generator=g)
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(master.view(params // 1024, 1024))
    compute = master.clone() if master_on_disk else master
    host = HostStage(s, [s], torch.nn.ModuleList([holder]), make_adamw([("w", holder.w)], UpdateRule(lr=1e-3)),
                     torch.empty(0), master, grads, [compute], grads, [Slot(0, params, (params // 1024, 1024))],
                     ["w"], master_on_disk=master_on_disk)
    host.attach_master_grads()
    return host


def transfers(disk: DiskState, call) -> float:
    """Seconds to read (or write and flush) every block of every stage alone, as the tier moves them
    (its own block transfer: the lane without the update)."""
    t0 = time.perf_counter()
    for s, blocks in disk.blocks.items():
        for b in blocks:
            disk._move(call, s, b, torch.zeros(disk.fields(s) * b.count))
    if call is os.pwritev:
        for fds in disk.fds.values():
            for fd in fds:
                os.fsync(fd)
    return time.perf_counter() - t0


def one_repeat(directories: list[Path], stages: int, params: int, seed: int, masters: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    hosts = {s: host_stage(s, params, g, masters) for s in range(stages)}
    disk = DiskState(directories, 0, masters=list(hosts) if masters else (), block=block_params(params))
    for host in hosts.values() if masters else ():
        disk.park(host)
    disk.attach(hosts)

    def update(s: int) -> None:
        disk.update(s, 1e-3, None, 1.0, hosts[s].compute_buffers[0] if masters else None)

    try:
        for s in range(stages):  # the first update makes the moments; they go to disk
            update(s)
        disk.finish_writes()
        drop_cache(disk)
        read_s = transfers(disk, os.preadv)  # the read lane alone: the same blocks, the same requests
        for s in range(stages):
            disk.loaded(s)
            hosts[s].attach_master_grads()  # a master read back has none
        t0 = time.perf_counter()
        for s in range(stages):  # the AdamW lane alone, the state in memory
            hosts[s].optimizer.step()
        adam_s = time.perf_counter() - t0
        for s in range(stages):
            disk.unload(s)
        drop_cache(disk)
        write_s = transfers(disk, os.pwritev)  # the write lane alone (made durable)
        drop_cache(disk)
        t0 = time.perf_counter()
        for s in reversed(range(stages)):  # the step: each stage's blocks read ahead, updated, written behind
            update(s)
        disk.finish_writes()
        drop_cache(disk)
        step_s = time.perf_counter() - t0
    finally:
        disk.close()
    return {"read_s": read_s, "write_s": write_s, "adam_s": adam_s, "step_s": step_s}


def compare_io(directory: Path, nbytes: int, request: int = 16 * 2**20) -> list[dict]:
    """Sequential write (with ``fsync``) and read of ``nbytes`` in ``request``-sized requests, buffered
    and ``O_DIRECT`` (where the file system has it), at 1, 4 and 8 requests in flight, through a file
    of our own in ``directory`` (after one untimed pass: the first file written on a quiet drive was
    the slowest)."""
    buffers = [mmap.mmap(-1, request) for _ in range(8)]  # page-aligned, as O_DIRECT needs
    for b in buffers:
        b.write(os.urandom(request))
    offsets = range(0, nbytes, request)

    def one(direct: bool, depth: int) -> dict | None:
        path = directory / f".mobius-io-{os.getpid()}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
        except OSError:  # a file system without O_DIRECT (an older tmpfs): no row
            path.unlink(missing_ok=True)
            return None
        try:
            with ThreadPoolExecutor(depth) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda o: os.pwritev(fd, [buffers[o // request % 8]], o), offsets))
                os.fsync(fd)
                write_s = time.perf_counter() - t0
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                list(pool.map(lambda o: os.preadv(fd, [buffers[o // request % 8]], o), offsets))
                read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
            path.unlink()
        return {"io": "O_DIRECT" if direct else "buffered", "in_flight": depth,
                "write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9}

    one(False, 1)
    return [row for direct in (False, True) for depth in (1, 4, 8) if (row := one(direct, depth)) is not None]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=lambda text: [Path(d) for d in text.split(",")], default=[None],
                   help="one directory on each drive to measure, comma-separated")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--params", type=float, default=8e6, help="parameters a stage")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--masters", action="store_true", help="the master weights on disk too (12 bytes a parameter)")
    p.add_argument("--compare-io", action="store_true", help="buffered against O_DIRECT, the bytes of --stages")
    args = p.parse_args(argv)
    if args.smoke:
        args.stages, args.params, args.repeats = 2, 1e6, 1
    if args.compare_io:
        nbytes = int(args.stages * args.params * 8) // (16 * 2**20) * (16 * 2**20) or 16 * 2**20
        with tempfile.TemporaryDirectory(prefix="mobius-io-", dir=args.dir[0]) as d:
            rows = [compare_io(Path(d), nbytes) for _ in range(args.repeats)]
        print(f"{nbytes / 1e9:.2f} GB written then read in 16 MB requests, median of {args.repeats}:")
        print(f"{'I/O':>9} {'in flight':>9} {'write':>11} {'read':>11}")
        median = []
        for k, row in enumerate(rows[0]):
            w = statistics.median(r[k]["write_gbps"] for r in rows)
            rd = statistics.median(r[k]["read_gbps"] for r in rows)
            median.append({**row, "write_gbps": w, "read_gbps": rd})
            print(f"{row['io']:>9} {row['in_flight']:>9} {w:>6.2f} GB/s {rd:>6.2f} GB/s")
        if args.json:
            args.json.write_text(json.dumps({"bytes": nbytes, "repeats": rows, "median": median}, indent=1))
        return
    params = int(args.params) // 1024 * 1024
    rows = []
    for r in range(args.repeats):
        with contextlib.ExitStack() as made:
            dirs = [Path(made.enter_context(tempfile.TemporaryDirectory(prefix="mobius-offload-", dir=d)))
                    for d in args.dir]
            rows.append(one_repeat(dirs, args.stages, params, r, args.masters))
    median = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    bound = max(median["read_s"], median["write_s"], median["adam_s"])
    state_gb = args.stages * params * (12 if args.masters else 8) / 1e9
    print(f"{args.stages} stages of {params / 1e6:.1f}M parameters, {state_gb:.2f} GB of "
          f"{'master weights and moments' if args.masters else 'moments'} over "
          f"{len(args.dir)} director{'y' if len(args.dir) == 1 else 'ies'}, median of {args.repeats}:")
    # One drive reads and writes through one queue: their sum is its lane where they cannot overlap.
    shared = median["read_s"] + median["write_s"]
    print(f"{'read':>8} {'write':>8} {'AdamW':>8} {'step':>8} {'step / longest lane':>20} "
          f"{'step / (read + write)':>22}")
    print(f"{median['read_s']:>7.3f}s {median['write_s']:>7.3f}s {median['adam_s']:>7.3f}s {median['step_s']:>7.3f}s "
          f"{median['step_s'] / bound:>20.2f} {median['step_s'] / shared:>22.2f}")
    if args.json:
        args.json.write_text(json.dumps({"stages": args.stages, "params": params, "repeats": rows, "median": median,
                                         "step_over_longest_lane": median["step_s"] / bound,
                                         "step_over_read_plus_write": median["step_s"] / shared}, indent=1))


if __name__ == "__main__":
    main()
