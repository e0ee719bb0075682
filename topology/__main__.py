"""``python -m topology``: the topology as ``nvidia-smi topo -m`` would print it, its root-complex
groups, and the backend ``auto`` would choose, with the reason."""

from __future__ import annotations

import argparse
import json
import sys

from topology.model import Topology, TopologyError
from topology.presets import load_topology


def render(topo: Topology) -> str:
    n = topo.n
    head = [f"GPU{i}" for i in range(n)]
    width = max(5, *(len(h) + 1 for h in head))
    lines = [f"topology {topo.name}" + (" (CPU workers standing in for GPUs)" if topo.virtual else ""),
             " " * 6 + "".join(h.ljust(width) for h in head) + "CPU root complex"]
    for a in range(n):
        row = "".join(topo.link_level(a, b).ljust(width) for b in range(n))
        lines.append(f"GPU{a}".ljust(6) + row + str(topo.root_complex_of(a)))
    lines.append("")
    lines.append("Legend: X self, NV# NVLink, PIX one PCIe switch, PXB several switches, "
                 "PHB same host bridge (root complex), NODE/SYS across root complexes or sockets")
    for g in topo.gpus:
        lines.append(f"GPU{g.index}: {g.name}, {g.memory_gb:.1f} GB, {g.tflops:g} TFLOPS, "
                     f"link {g.link_bandwidth_gbps:g} GB/s")
    for rc, members in topo.groups().items():
        lines.append(f"root complex {rc}: GPUs {members}, host bandwidth {topo.rc(rc).host_bandwidth_gbps:g} GB/s")
    backend, reason = topo.choose_backend()
    lines.append(f"backend: {backend} ({reason})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m topology", description=__doc__)
    p.add_argument("--topology", default="auto", help="auto, a preset name, or a topology JSON file")
    p.add_argument("--cpu-workers", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the topology file instead")
    p.add_argument("--measure", action="store_true", help="measure pinned host<->device bandwidth (CUDA)")
    p.add_argument("--write", default=None, help="write the (measured) topology to this file")
    args = p.parse_args(argv)
    try:
        topo = load_topology(args.topology, cpu_workers=args.cpu_workers)
        if args.measure:
            if topo.virtual:
                raise TopologyError("--measure needs CUDA GPUs; this topology has CPU workers")
            from topology.bandwidth import apply_measurement, measure

            topo = apply_measurement(topo, measure(topo))
        if args.write:
            topo.save(args.write)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps(topo.to_dict(), indent=2) if args.json else render(topo))


if __name__ == "__main__":
    main()
