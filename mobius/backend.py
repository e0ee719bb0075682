"""Which backend a run uses, on which topology."""

from __future__ import annotations

from mobius.config import RunConfig
from mobius.errors import InputError
from topology import Topology, TopologyError, load_topology


def resolve_topology(cfg: RunConfig) -> Topology:
    try:
        topo = load_topology(cfg.topology, cpu_workers=cfg.cpu_workers, memory_gb=cfg.gpu_mem_gb)
    except TopologyError as err:
        raise InputError(str(err)) from None
    if cfg.gpu_mem_gb is not None:
        for g in topo.gpus:
            g.memory_gb = min(g.memory_gb, cfg.gpu_mem_gb)
    if cfg.host_adam_gbps is not None:
        topo.host_memory_bandwidth_gbps = cfg.host_adam_gbps
    return topo


def resolve_backend(cfg: RunConfig) -> tuple[str, Topology | None]:
    """``(backend, topology)``; ``single`` needs no topology, but a bad one is still an error."""
    topo = resolve_topology(cfg)
    if cfg.backend == "single":
        return "single", None
    backend = cfg.backend
    if backend == "auto":
        backend, _ = topo.choose_backend()
    return backend, topo
