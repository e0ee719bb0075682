"""The configuration search of Elixir (§5.1, App. A.1-A.3): no ZeRO knobs to tune by hand.

1. Allowed memory (A.1): ``U = F_alloc * (capacity - U_buffer - F_frag * U_activation)``.
2. Chunk size (A.2): for each candidate size, pack the parameters in first-use order and replay one
   step's chunk accesses under Belady with the smallest rCache that holds every chunk one layer
   needs (A.3).  The size that moves the fewest bytes through the rCache wins.
3. Placement (§5.1): the memory left goes, one unit at a time, either to one more rCache block
   (benefit ``I(n)``, Eq. 1) or to keeping one more chunk and its AdamW update on the device
   (benefit ``J(n)``, Eq. 2), whichever saves more time per byte.

Bandwidths come from the topology; update speeds are a CPU AdamW rate and the GPUs' memory
bandwidth (or a probe's measurements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunked_dp.cache import count_replacements
from chunked_dp.chunks import Trace, chunks_of_layers, pack, step_access_order

L_C = 2  # bytes per element in the compute dtype (fp16/bf16)
L_OS = 4  # bytes per element of optimizer-side tensors (fp32)
F_OS = 3  # fp32 master, AdamW m and v
CPU_ADAM_PARAMS_PER_S = 1.0e9
GPU_HBM_BYTES_PER_S = 1.5e12  # A100 40 GB: 1.55 TB/s


def allowed_memory(capacity: float, buffer: float, activation: float, f_alloc: float = 0.95,
                   f_frag: float = 1.25) -> float:
    """Elixir App. A.1."""
    return f_alloc * (capacity - buffer - f_frag * activation)


class DoesNotFit(ValueError):
    """Not even the smallest rCache fits in the memory allowed."""


@dataclass
class SearchResult:
    chunk_size: int  # elements
    n_chunks: int
    n_block: int
    device_chunks: int  # chunks kept (with their optimizer update) on the device
    moved_bytes: float  # bytes gathered through the rCache per step at the chosen size
    allowed_bytes: float
    block_benefit: float = 0.0  # I(n): seconds saved per byte by one more rCache block (Eq. 1)
    chunk_benefit: float = 0.0  # J(n): seconds saved per byte by one more device-resident chunk (Eq. 2)
    candidates: int = 0  # chunk sizes tried

    def reasons(self) -> str:
        """Why this configuration, in one clause each."""
        favoured = "resident chunks" if self.chunk_benefit >= self.block_benefit else "rCache blocks"
        return (f"chunk size moves the fewest bytes through the rCache of {self.candidates} sizes tried "
                f"({self.moved_bytes / 1e9:.2f} GB a pass); memory allowed {self.allowed_bytes / 1e9:.2f} GB, "
                f"spent first on {favoured} (Elixir's benefit per unit of memory: block I={self.block_benefit:.3g}, "
                f"resident chunk J={self.chunk_benefit:.3g})")

    @property
    def device_fraction(self) -> float:
        return self.device_chunks / self.n_chunks

    def to_dict(self) -> dict:
        return {**self.__dict__, "device_fraction": self.device_fraction}


def candidate_sizes(trace: Trace, steps: int = 16) -> list[int]:
    """From the largest parameter up to 4x it, geometrically."""
    largest = max(math.prod(s) for _, s in trace.order)
    return sorted({int(largest * 4 ** (k / (steps - 1))) for k in range(steps)})


def min_blocks(layer_chunks: list[list[int]]) -> int:
    """A.3: the rCache must hold every chunk one layer (one coarse operator) uses."""
    return max(len(cs) for cs in layer_chunks)


def layer_bytes(trace: Trace) -> float:
    """Compute-dtype bytes of the largest layer's parameters (A.3's buffer)."""
    shapes = dict(trace.order)
    return max(sum(math.prod(shapes[n]) for n in names) for names in trace.layer_params) * L_C


def search_chunk_size(trace: Trace, world: int, rcache_bytes: float | None = None) -> tuple[int, float]:
    """(chunk size, bytes moved per step) minimising the bytes moved through an rCache of
    ``rcache_bytes`` (default: twice the largest layer, the layer in use plus the next one)."""
    rcache_bytes = rcache_bytes if rcache_bytes is not None else 2 * layer_bytes(trace)
    best: tuple[float, int] | None = None
    for size in candidate_sizes(trace):
        chunks = pack(trace, size, world)
        layer_chunks = chunks_of_layers(chunks, trace)
        blocks = max(min_blocks(layer_chunks), int(rcache_bytes // (chunks[0].size * L_C)))
        misses, _ = count_replacements(step_access_order(layer_chunks), min(blocks, len(chunks)), "belady")
        moved = misses * chunks[0].size * L_C
        if best is None or moved < best[0]:
            best = (moved, chunks[0].size)
    return best[1], best[0]


def benefits(chunk: int, n: int, b_c2g: float, b_g2c: float, v_c: float, v_g: float) -> tuple[float, float]:
    """Elixir Eq. 1 and 2: time saved per unit of memory by one more rCache block (I) or by one
    more device-resident chunk (J).  Bandwidths in bytes/s (aggregate over n), speeds in elements/s."""
    i_n = (L_C * chunk / b_g2c + L_C * chunk / b_c2g) / L_C
    j_n = n / (L_C + L_OS * F_OS) * ((L_OS * chunk / b_c2g + L_C * i_n + L_C * chunk / b_g2c)
                                    + (chunk / v_c - chunk / v_g))
    return i_n, j_n


def search(trace: Trace, topo, activation_bytes: float = 0.0, buffer_bytes: float = 0.0,
           cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S) -> SearchResult:
    """The configuration for ``trace`` (the model) on ``topo`` (all its GPUs data-parallel)."""
    n = topo.n
    capacity = min(g.memory_gb for g in topo.gpus) * 1e9
    allowed = allowed_memory(capacity, buffer_bytes, activation_bytes)
    size, moved = search_chunk_size(trace, n)
    chunks = pack(trace, size, n)
    layer_chunks = chunks_of_layers(chunks, trace)
    n_block = min(min_blocks(layer_chunks), len(chunks))
    left = allowed - n_block * size * L_C
    if left < 0:
        raise DoesNotFit(f"the rCache needs {n_block * size * L_C / 1e9:.1f} GB, more than the "
                         f"{allowed / 1e9:.1f} GB allowed on each GPU")
    # Aggregate host<->device bandwidth: each root complex gives at most its host bandwidth.
    agg = sum(min(topo.rc(rc).host_bandwidth_gbps, sum(topo.gpus[g].link_bandwidth_gbps for g in members))
              for rc, members in topo.groups().items() if members) * 1e9
    v_g = n * GPU_HBM_BYTES_PER_S / (L_OS * (F_OS + 1))  # elements/s: read/write master, m, v, grad
    i_n, j_n = benefits(size, n, agg, agg, cpu_adam_params_per_s, v_g)
    block_cost = size * L_C
    chunk_cost = size * (L_C + L_OS * F_OS) / n  # a resident chunk's shard, master and AdamW state
    device = 0
    while True:
        if j_n >= i_n and device < len(chunks) and left >= chunk_cost:
            device += 1
            left -= chunk_cost
        elif n_block < len(chunks) and left >= block_cost:
            n_block += 1
            left -= block_cost
        elif device < len(chunks) and left >= chunk_cost:
            device += 1
            left -= chunk_cost
        else:
            break
    return SearchResult(size, len(chunks), n_block, device, moved, allowed, i_n, j_n,
                        len(candidate_sizes(trace)))
