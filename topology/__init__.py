"""GPU topology: the model and file format, presets, the NVML + sysfs probe, backend choice."""

from topology.model import (ASSUMED_DRIVE_GBPS, GPU, Drive, Network, RootComplex, Topology, TopologyError,
                            load_topology_file, topology_from_dict)
from topology.networks import DEFAULT_NETWORK, NETWORKS, assumed_network, network_of
from topology.presets import cpu_topology, load_preset, load_topology, preset_names

__all__ = ["ASSUMED_DRIVE_GBPS", "DEFAULT_NETWORK", "Drive", "GPU", "NETWORKS", "Network", "RootComplex",
           "assumed_network", "network_of", "Topology", "TopologyError", "cpu_topology", "load_preset",
           "load_topology", "load_topology_file", "preset_names", "topology_from_dict"]
