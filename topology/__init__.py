"""GPU topology: the model and file format, presets, the NVML + sysfs probe, backend choice."""

from topology.model import GPU, RootComplex, Topology, TopologyError, load_topology_file, topology_from_dict
from topology.presets import cpu_topology, load_preset, load_topology, preset_names

__all__ = ["GPU", "RootComplex", "Topology", "TopologyError", "cpu_topology", "load_preset", "load_topology",
           "load_topology_file", "preset_names", "topology_from_dict"]
