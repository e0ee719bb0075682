"""The networks between nodes: what data-parallel replicas (one per node) exchange each step's
gradients and weights over.  Line rates, each way; write a measured figure into a topology file's
``network`` (``bandwidth_gbps``, ``latency_us``) where you have one."""

from __future__ import annotations

import math

from topology.model import Network, TopologyError

NETWORKS = {
    "10gbe": Network("10 GbE", 1.25, 20.0),
    "25gbe": Network("25 GbE", 3.125, 10.0),
    "100gbe": Network("100 GbE", 12.5, 5.0),
    "ib-hdr": Network("InfiniBand HDR (200 Gb/s)", 25.0, 2.0),
    "ib-ndr": Network("InfiniBand NDR (400 Gb/s)", 50.0, 2.0),
}
# What a plan for several nodes assumes when neither --network nor the topology says: the
# commodity case.
DEFAULT_NETWORK = "10gbe"


def network_of(spec: str) -> Network:
    """A preset name (``25gbe``) or a bandwidth in GB/s (``3.1``)."""
    if spec in NETWORKS:
        return NETWORKS[spec]
    try:
        gbps = float(spec)
    except ValueError:
        raise TopologyError(f"unknown network {spec!r}: give one of {', '.join(NETWORKS)} or a bandwidth in "
                            "GB/s") from None
    if not (math.isfinite(gbps) and gbps > 0):
        raise TopologyError(f"--network must be a preset or a positive bandwidth in GB/s, got {spec!r}")
    return Network(f"{gbps:g} GB/s", gbps, NETWORKS[DEFAULT_NETWORK].latency_us)


def assumed_network(topo) -> Network:
    """The network a plan for several of ``topo``'s nodes assumes: the topology's, else the default."""
    return topo.network or NETWORKS[DEFAULT_NETWORK]
