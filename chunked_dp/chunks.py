"""Chunks: parameters packed in first-use order into fixed-size chunks (Elixir App. A.2, PatrickStar).

The first-use order comes from a traced step: the layer list runs forward once on the meta device
with a hook on every leaf module, recording which parameters each layer touches and in which order.
A parameter used by several layers (tied input/output embeddings) lives in one chunk, the one of
its first use.  That chunk lists every layer that uses it, so its gradient is reduced only after
the last of them has run backward.

Chunks have a fixed number of elements, padded to a multiple of the data-parallel degree, so every
worker holds an equal shard.  A parameter never straddles two chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mobius.models import GPTConfig, build_model


@dataclass
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # first element within the chunk

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Chunk:
    index: int
    size: int  # elements, padded to a multiple of the world size
    params: list[ParamSlot] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # layers that use a parameter of this chunk

    @property
    def used(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass
class Trace:
    order: list[tuple[str, tuple[int, ...]]]  # parameters (name, shape) in first-use order
    layer_params: list[list[str]]  # per layer, the parameters it uses, in use order


def trace_first_use(config: GPTConfig) -> Trace:
    """Run one forward pass on the meta device and record parameter uses per layer."""
    model = build_model(config, device="meta")
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight appears once
    order: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    layer_params: list[list[str]] = [[] for _ in model.layers]
    current = [0]

    def on_module(module, _inputs):
        use(module.parameters(recurse=False))

    def use(params) -> None:
        for p in params:
            name = names[id(p)]
            if name not in layer_params[current[0]]:
                layer_params[current[0]].append(name)
            if name not in seen:
                seen.add(name)
                order.append((name, tuple(p.shape)))

    handles = [m.register_forward_pre_hook(on_module) for m in model.modules() if not list(m.children())]
    tokens = torch.zeros(1, 2, dtype=torch.long, device="meta")
    x = tokens
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            current[0] = i
            x = layer(x, tokens) if i == len(model.layers) - 1 else layer(x)
            use(layer.parameters())  # weights a layer uses without calling their module (the head's)
    for h in handles:
        h.remove()
    return Trace(order, layer_params)


def pack(trace: Trace, chunk_size: int, world: int) -> list[Chunk]:
    """Greedy packing in first-use order; ``chunk_size`` is raised to the largest parameter and
    rounded up to a multiple of ``world``."""
    largest = max(_numel(shape) for _, shape in trace.order)
    size = max(chunk_size, largest)
    size = -(-size // world) * world
    chunks: list[Chunk] = [Chunk(0, size)]
    for name, shape in trace.order:
        n = _numel(shape)
        if chunks[-1].used + n > size:
            chunks.append(Chunk(len(chunks), size))
        chunks[-1].params.append(ParamSlot(name, shape, chunks[-1].used))
    where = {p.name: c.index for c in chunks for p in c.params}
    for layer, names in enumerate(trace.layer_params):
        for name in names:
            c = chunks[where[name]]
            if layer not in c.layers:
                c.layers.append(layer)
    return chunks


def chunks_of_layers(chunks: list[Chunk], trace: Trace) -> list[list[int]]:
    """Per layer, the chunks it needs, in the order it first touches them."""
    where = {p.name: c.index for c in chunks for p in c.params}
    out = []
    for names in trace.layer_params:
        seq: list[int] = []
        for name in names:
            if where[name] not in seq:
                seq.append(where[name])
        out.append(seq)
    return out


def step_access_order(layer_chunks: list[list[int]]) -> list[int]:
    """The chunk accesses of one training step: layers forward, then backward in reverse."""
    forward = [c for cs in layer_chunks for c in cs]
    backward = [c for cs in reversed(layer_chunks) for c in cs]
    return forward + backward


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
