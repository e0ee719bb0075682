"""Named topologies shipped as files in the topology format, plus the CPU topology."""

from __future__ import annotations

from pathlib import Path

from topology.model import GPU, RootComplex, Topology, TopologyError, load_topology_file

PRESET_DIR = Path(__file__).parent / "presets"
CPU_WORKER_MEMORY_GB = 2.0
# Notional numbers for a CPU worker: what the analytic cost model assumes for it.
CPU_WORKER_TFLOPS = 0.05
CPU_COPY_GBPS = 5.0


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) + ["cpu"]


def cpu_topology(workers: int = 2, memory_gb: float = CPU_WORKER_MEMORY_GB, host_memory_gb: float | None = None) -> Topology:
    """Virtual workers (CPU processes over gloo) standing in for GPUs, under one root complex.

    ``memory_gb`` is each worker's device budget, which the runtime enforces by its own accounting.
    """
    if host_memory_gb is None:
        try:
            import os
            host_memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        except (ValueError, OSError, AttributeError):
            host_memory_gb = 16.0
    gpus = [GPU(i, "cpu-worker", memory_gb, CPU_WORKER_TFLOPS, 0, CPU_COPY_GBPS) for i in range(workers)]
    return Topology(name=f"cpu{workers}", host_memory_gb=host_memory_gb,
                    root_complexes=[RootComplex(0, CPU_COPY_GBPS)], gpus=gpus, virtual=True)


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
        from topology.probe import probe

        return probe(cpu_workers=cpu_workers, cpu_memory_gb=memory_gb or CPU_WORKER_MEMORY_GB)
    if spec.endswith(".json") or Path(spec).is_file():
        return load_topology_file(spec)
    if spec == "cpu":
        return cpu_topology(cpu_workers, memory_gb or CPU_WORKER_MEMORY_GB)
    return load_preset(spec)
