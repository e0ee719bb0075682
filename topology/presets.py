"""Named topologies shipped as files in the topology format, plus the CPU topology."""

from __future__ import annotations

from pathlib import Path

from topology.model import CPU_WORKER_MEMORY_GB, Topology, TopologyError, cpu_topology, load_topology_file
from topology.probe import probe

PRESET_DIR = Path(__file__).parent / "presets"
def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) + ["cpu"]


def load_preset(name: str) -> Topology:
    if name == "cpu":
        return cpu_topology()
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise TopologyError(f"unknown topology preset {name!r}; choose one of: {', '.join(preset_names())}, "
                            "auto, or a JSON file")
    return load_topology_file(path)


def load_topology(spec: str, cpu_workers: int = 2, memory_gb: float | None = None) -> Topology:
    """``auto`` (probe), a preset name, or a path to a topology file."""
    if spec == "auto":
        return probe(cpu_workers=cpu_workers, cpu_memory_gb=memory_gb or CPU_WORKER_MEMORY_GB)
    if spec.endswith(".json") or Path(spec).is_file():
        return load_topology_file(spec)
    if spec == "cpu":
        return cpu_topology(cpu_workers, memory_gb or CPU_WORKER_MEMORY_GB)
    return load_preset(spec)
