"""``python -m topology``: the topology as ``nvidia-smi topo -m`` would print it, its root-complex
groups, and the backend ``auto`` would choose, with the reason."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from topology.model import Topology, TopologyError, load_topology_file
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


def _one_line(message: object) -> str:
    """Control characters escaped: a path holding a newline cannot split the message."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(message))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        print(f"error: {_one_line(message)} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _check_write_target(path: str) -> None:
    """``--write`` creates a file, or replaces a topology file; never a directory or another file."""
    p = Path(path)
    if p.is_dir():
        raise TopologyError(f"--write {path}: is a directory; give a file name")
    if not p.resolve().parent.is_dir():
        raise TopologyError(f"--write {path}: directory {p.resolve().parent} does not exist")
    if p.exists():
        try:
            load_topology_file(p)
        except TopologyError:
            raise TopologyError(f"--write {path}: exists and is not a topology file; refusing to overwrite it") from None


def main(argv: list[str] | None = None) -> None:
    p = _Parser(prog="python -m topology", description=__doc__)
    p.add_argument("--topology", default="auto", help="auto, a preset name, or a topology JSON file")
    p.add_argument("--cpu-workers", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the topology file instead")
    p.add_argument("--measure", action="store_true", help="measure pinned host<->device bandwidth (CUDA)")
    p.add_argument("--write", default=None, help="write the (measured) topology to this file")
    args = p.parse_args(argv)
    try:
        if args.cpu_workers <= 0:
            raise TopologyError(f"--cpu-workers must be positive, got {args.cpu_workers}")
        if args.write:
            _check_write_target(args.write)
        topo = load_topology(args.topology, cpu_workers=args.cpu_workers)
        if args.measure:
            if topo.virtual:
                raise TopologyError("--measure needs CUDA GPUs; this topology has CPU workers")
            from topology.bandwidth import apply_measurement, measure

            topo = apply_measurement(topo, measure(topo))
        if args.write:
            topo.save(args.write)
    except TopologyError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps(topo.to_dict(), indent=2) if args.json else render(topo))


if __name__ == "__main__":
    main()
