"""Stage-to-GPU mapping: Mobius cross mapping (Eq. 12-13), the sequential baseline, priorities."""

from mobius.mapping.cross import Mapping, contention, cross_map, sequential_map, transfer_priority

__all__ = ["Mapping", "contention", "cross_map", "sequential_map", "transfer_priority"]
