"""Opt-in bandwidth probe (CUDA only): pinned host<->device GB/s per GPU, alone and with every GPU
of its root complex copying at once.  ``python -m topology --measure --write FILE`` stores the
result in a topology file (``link_bandwidth_gbps`` from the solo runs, each root complex's
``host_bandwidth_gbps`` from the concurrent aggregate).
"""

from __future__ import annotations

import threading

from topology.model import Topology


def _copy_gbps(device: int, nbytes: int, repeats: int, direction: str, barrier: threading.Barrier | None) -> float:
    import torch

    torch.cuda.set_device(device)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    stream = torch.cuda.Stream(device)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
    stream.synchronize()
    if barrier is not None:
        barrier.wait()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def measure(topo: Topology, nbytes: int = 256 * 2**20, repeats: int = 8) -> dict:
    """{"solo": {gpu: {"h2d", "d2h"}}, "concurrent": {rc: {"h2d", "d2h"} aggregate GB/s}}."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the bandwidth probe needs CUDA")
    solo = {g.index: {d: _copy_gbps(g.index, nbytes, repeats, d, None) for d in ("h2d", "d2h")} for g in topo.gpus}
    concurrent = {}
    for rc, members in topo.groups().items():
        result = {}
        for d in ("h2d", "d2h"):
            rates = [0.0] * len(members)
            barrier = threading.Barrier(len(members))

            def run(k: int, gpu: int) -> None:
                rates[k] = _copy_gbps(gpu, nbytes, repeats, d, barrier)

            threads = [threading.Thread(target=run, args=(k, g)) for k, g in enumerate(members)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            result[d] = sum(rates)
        concurrent[rc] = result
    return {"solo": solo, "concurrent": concurrent}


def apply_measurement(topo: Topology, result: dict) -> Topology:
    for g in topo.gpus:
        g.link_bandwidth_gbps = round(result["solo"][g.index]["h2d"], 2)
        g.extra["measured_d2h_gbps"] = round(result["solo"][g.index]["d2h"], 2)
    for r in topo.root_complexes:
        if r.id in result["concurrent"]:
            r.host_bandwidth_gbps = round(result["concurrent"][r.id]["h2d"], 2)
            r.extra["measured_d2h_gbps"] = round(result["concurrent"][r.id]["d2h"], 2)
    return topo
