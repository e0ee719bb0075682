"""The rCache's blocks and the gathers that fill them: before a layer runs (forward or backward),
each chunk it uses is gathered into a block (:class:`~chunked_dp.cache.RCachePolicy`: Belady
replacement over the order recorded in the warm-up step, LRU during it), and the model's
parameters become views of that block.  An offloaded chunk's shard crosses PCIe on a copy stream
of its own, started a layer ahead (prefetch) so it overlaps the current layer's compute; the
all-gather between workers (NVLink's part) runs when the chunk is needed.  An evicted chunk needs
no write-back: its master copy is elsewhere (:mod:`chunked_dp.shards`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from chunked_dp.cache import RCachePolicy
from chunked_dp.chunks import Chunk
from chunked_dp.shards import Shards, all_gather
from mobius.metrics import Trace
from mobius.runtime.device import WITHIN_DEVICE, Device, Event


@dataclass
class Counters:
    gather_bytes: int = 0  # full chunks materialised by gathers (compute dtype)
    reduce_bytes: int = 0  # full gradient chunks reduce-scattered
    h2d: int = 0
    d2h: int = 0
    peer: int = 0  # bytes this worker sent in collectives
    prefetched: int = 0  # gathers started ahead of their use

    def reset(self) -> None:
        self.gather_bytes = self.reduce_bytes = self.h2d = self.d2h = self.peer = self.prefetched = 0


# A gather under way, by where the chunk's shards come from.
@dataclass
class CopiedWithinDevice:
    """One worker, a device chunk: its shard was copied into the block on the compute stream."""


@dataclass
class AllGathered:
    """Device chunks of several workers: all-gathered into the block (``work``: the collective
    under way when started ahead, else None)."""
    work: Any


@dataclass
class FromHost:
    """An offloaded chunk: its shard is crossing PCIe into ``target`` (until ``arrived``), to be
    all-gathered into the block on arrival where there are several workers."""
    arrived: Event
    target: torch.Tensor


class Gathers:
    def __init__(self, chunks: list[Chunk], layer_chunks: list[list[int]], n_block: int, shards: Shards,
                 device: Device, params: dict[str, torch.nn.Parameter], nothing: torch.Tensor, counters: Counters,
                 trace: Trace, prefetch: bool):
        self.chunks, self.layer_chunks, self.shards, self.dev = chunks, layer_chunks, shards, device
        self.world = chunks[0].size // shards.size
        self.params, self.nothing, self.counters, self.trace = params, nothing, counters, trace
        self.prefetch_on = prefetch
        self.blocks = [device.empty(chunks[0].size, shards.dtype, name=f"rCache block {b}") for b in range(n_block)]
        self.cache = RCachePolicy(n_block, "belady")
        self.h2d = device.new_stream("h2d-chunks", "h2d")  # offloaded shards on their way to the device
        self.recorded: list[int] = []
        self.inflight: dict[int, CopiedWithinDevice | AllGathered | FromHost] = {}
        self.read_out: dict[int, Event] = {}  # block -> the copy home of the gradient it holds

    def new_step(self) -> None:
        self.cache.new_step()
        self.recorded = []

    def learn_order(self) -> None:
        """The order just recorded is every later step's future: Belady from now on."""
        if not self.cache.future_known:
            self.cache.set_future(self.recorded)

    def access(self, k: int) -> None:
        """Make chunk ``k`` resident and pin it."""
        self.recorded.append(k)
        hit, victim = self.cache.access(k)
        if victim is not None:
            self.release(victim)
        if k in self.inflight:  # prefetched: finish its gather
            self.finish(k)
        elif not hit:
            self.start(k)
            self.finish(k)
        self.cache.pinned.add(k)

    def unpin(self, k: int) -> None:
        self.cache.pinned.discard(k)

    def start(self, k: int, ahead: bool = False) -> None:
        """Begin gathering chunk ``k`` into its block.  An offloaded shard first crosses PCIe on
        the h2d stream (straight into the block when there is one worker); a device shard is
        all-gathered, asynchronously when ``ahead``."""
        b = self.cache.block_of(k)
        block, on_device, shard = self.blocks[b], self.shards.on_device[k], self.shards.compute[k]
        if b in self.read_out:  # its last gradient may still be leaving for the host
            (self.dev.compute if on_device else self.h2d).wait(self.read_out.pop(b))
        self.counters.gather_bytes += block.numel() * block.element_size()
        self.counters.peer += shard.numel() * block.element_size() * (self.world - 1)
        if on_device and self.world == 1:
            self.dev.compute.copy(block, shard, name=f"rCache block of chunk {k}", direction=WITHIN_DEVICE)
            self.inflight[k] = CopiedWithinDevice()
        elif on_device:
            self.inflight[k] = AllGathered(all_gather(block, shard, async_op=ahead))
        else:
            self.counters.h2d += shard.numel() * block.element_size()
            target = block if self.world == 1 else self.dev.empty(shard.numel(), shard.dtype, stream=self.h2d,
                                                                    name=f"shard of chunk {k}")
            self.h2d.wait(self.dev.compute.record())  # the block's previous chunk is done with
            begin = self.h2d.record() if self.trace.enabled else None
            self.h2d.copy(target, shard, name=f"gathered shard of chunk {k}")
            arrived = self.h2d.record()
            if begin is not None:
                self.trace.device_span(f"chunk {k} to device", "h2d", begin, arrived, self.dev.time_of,
                                       bytes=shard.numel() * block.element_size())
            self.inflight[k] = FromHost(arrived, target)

    def finish(self, k: int) -> None:
        gather = self.inflight.pop(k)
        t0 = time.perf_counter()
        block = self.blocks[self.cache.block_of(k)]
        if isinstance(gather, AllGathered) and gather.work is not None:
            gather.work.wait()
        elif isinstance(gather, FromHost):
            self.dev.compute.wait(gather.arrived)
            if self.world > 1:
                all_gather(block, gather.target)
        self.dev.compute.reads(block)
        for slot in self.chunks[k].params:
            self.params[slot.name].data = block[slot.offset: slot.offset + slot.numel].view(slot.shape)
        if self.world > 1:
            self.trace.span(f"gather chunk {k}", "gather", t0, time.perf_counter())

    def prefetch(self, layer: int) -> None:
        """Start gathering ``layer``'s chunks while the current layer computes.  Every worker decides
        identically, so collectives stay in the same order everywhere."""
        if not self.prefetch_on or not 0 <= layer < len(self.layer_chunks):
            return
        for k in self.layer_chunks[layer]:
            if k in self.inflight or k in self.cache.resident:
                continue
            placed, victim = self.cache.reserve(k)
            if not placed:
                return
            if victim is not None:
                self.release(victim)
            self.start(k, ahead=True)
            self.counters.prefetched += 1

    def release(self, k: int) -> None:
        """Eviction: no write-back (the master copy is elsewhere); gradients stay in ``.grad``."""
        for slot in self.chunks[k].params:
            self.params[slot.name].data = self.nothing

    def give_up(self, k: int) -> int | None:
        """Chunk ``k`` leaves the rCache (its gradients are reduced in its block): the block it held,
        or None where it was not resident."""
        block = self.cache.resident.get(k)
        if block is not None:
            self.release(k)
            self.cache.resident.pop(k)
        return block

    def settle(self) -> None:
        """Every gather under way finished (before an update may write the shards they read)."""
        for k in list(self.inflight):
            self.finish(k)

    def drop_all(self) -> None:
        """The end of a step or an evaluation: every gather finished, every block emptied."""
        self.settle()
        for k in list(self.cache.resident):
            self.release(k)
        self.cache.drop_all()
