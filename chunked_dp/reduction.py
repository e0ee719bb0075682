"""Gradients home and updates: once the last layer using a chunk has run backward in a pass, its
gradients (in its rCache block, the parameter memory reused) are reduce-scattered and added to the
fp32 master gradient of this worker's shard.  A device chunk's shard is added on the compute
stream; an offloaded chunk's leaves on a device->host stream into one of two page-locked staging
buffers, and the optimizer thread adds it to the master gradient and hands the buffer back, while
the device goes on with backward.  After the step's last pass each chunk is updated (AdamW,
:meth:`~chunked_dp.shards.Shards.update`) where its shard lives, or, under clipping, once the
step's global gradient norm is known."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from chunked_dp.chunks import Chunk
from chunked_dp.gathers import Counters, Gathers
from chunked_dp.shards import Shards, reduce_scatter
from mobius.metrics import Trace
from mobius.runtime.device import Device, Event
from mobius.runtime.optim import UpdateRule, clip_coefficient, squares


class Reduction:
    def __init__(self, chunks: list[Chunk], shards: Shards, gathers: Gathers, device: Device,
                 params: dict[str, torch.nn.Parameter], counters: Counters, trace: Trace, rule: UpdateRule):
        self.chunks, self.shards, self.gathers, self.dev, self.params = chunks, shards, gathers, device, params
        self.counters, self.trace, self.rule = counters, trace, rule
        self.world = gathers.world
        self.lr = rule.lr  # this step's rate (set by the engine)
        self.grads_out = device.new_stream("d2h-gradients", "d2h")
        self.host = device.host_stream("optimizer")  # what the optimizer thread does to host buffers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-chunk-optimizer")
        # Two page-locked staging buffers, used in turn; each remembers when the optimizer thread
        # last finished reading it (before that chunk's AdamW).
        offloaded = not all(shards.on_device)
        self.staging = [device.host_buffer(shards.size, shards.dtype) for _ in range(2 if offloaded else 0)]
        self._staging_free: list[Future | None] = [None] * len(self.staging)
        self._next_staging = 0
        self._host_jobs: list[Future] = []  # this step's optimizer-thread jobs

    def reduce(self, k: int, last: bool) -> None:
        """All of chunk ``k``'s users have run backward in this pass: its gradients are
        reduce-scattered and added to the fp32 master gradient; after the step's ``last`` pass
        (without clipping), AdamW updates the chunk."""
        t0 = time.perf_counter()
        c = self.chunks[k]
        block = self.gathers.give_up(k)
        flat = self.gathers.blocks[block] if block is not None else \
            self.dev.empty(c.size, self.shards.dtype, name=f"gradient of chunk {k}")
        flat.zero_()
        for slot in c.params:
            p = self.params[slot.name]
            if p.grad is not None:
                flat[slot.offset: slot.offset + slot.numel] = p.grad.reshape(-1)
                p.grad = None
        if self.world == 1:
            mine = flat
        else:
            mine = self.dev.empty(self.shards.size, self.shards.dtype, name=f"gradient shard of chunk {k}")
            reduce_scatter(mine, flat)
            self.trace.span(f"reduce chunk {k}", "reduce", t0, time.perf_counter())
        self.counters.reduce_bytes += flat.numel() * flat.element_size()
        self.counters.peer += mine.numel() * mine.element_size() * (self.world - 1)
        if self.shards.on_device[k]:
            self.shards.master_grad[k].add_(mine)
            if last and not self.rule.max_grad_norm:
                self.update(k, self.dev.compute)
            return
        # Offloaded: the shard goes home on its own stream; the optimizer thread takes it from there.
        self.counters.d2h += mine.numel() * mine.element_size()
        slot = self._next_staging
        self._next_staging = 1 - slot
        if self._staging_free[slot] is not None:  # its previous gradient must have been added first
            self.grads_out.wait(self._staging_free[slot].result())
        self.grads_out.wait(self.dev.compute.record())
        begin = self.grads_out.record() if self.trace.enabled else None
        self.grads_out.copy(self.staging[slot], mine, name=f"gradient staging {slot}")
        arrived = self.grads_out.record()
        if begin is not None:
            self.trace.device_span(f"gradient of chunk {k} to host", "d2h", begin, arrived, self.dev.time_of,
                                   bytes=mine.numel() * mine.element_size())
        if block is not None and mine is flat:  # the block's next gather must wait for this copy
            self.gathers.read_out[block] = arrived
        freed: Future = Future()
        self._staging_free[slot] = freed
        self._host_jobs.append(self._pool.submit(self._gradient_home, k, slot, arrived, last, freed))

    def _gradient_home(self, k: int, slot: int, arrived: Event, last: bool, freed: Future) -> Event:
        """On the optimizer thread: add the staged gradient to the master gradient and hand the
        staging buffer back (``freed``), so that the next gradient's copy home and the backward
        that issues it do not wait for this chunk's AdamW; after the step's last pass, update the
        chunk."""
        try:
            self.host.wait(arrived)
            t0 = time.perf_counter()
            self.host.reads(self.staging[slot])
            self.shards.master_grad[k].add_(self.staging[slot])
            self.trace.span(f"gradient of chunk {k} into fp32", "optimizer", t0, time.perf_counter())
            freed.set_result(self.host.record())
        except BaseException as err:  # whoever waits for the buffer must not wait forever
            freed.set_exception(err)
            raise
        if last and not self.rule.max_grad_norm:
            self.update(k, self.host)
        return self.host.record()

    def update(self, k: int, stream) -> None:
        """Chunk ``k``'s AdamW on ``stream``: the compute stream's, or the optimizer thread's."""
        self.shards.update(k, self.lr, stream, "optimizer" if stream is self.host else "compute")

    def clipped_updates(self) -> float:
        """Clipping: every chunk's update waits for the step's global gradient norm (the sum of
        every rank's shards' squares); then each chunk is updated with its gradient scaled, device
        chunks on the compute stream, offloaded ones on the optimizer thread.  Returns the norm."""
        self.wait_host_jobs()  # every offloaded gradient is home
        total = torch.tensor([squares(self.shards.master_grad)], dtype=torch.float64)
        dist.all_reduce(total)
        clip = clip_coefficient(total.item(), self.rule.max_grad_norm)
        for k in range(len(self.chunks)):
            if self.shards.on_device[k]:
                self._scaled_update(k, clip, self.dev.compute)
            else:
                self._host_jobs.append(self._pool.submit(self._scaled_update, k, clip, self.host))
        return total.item() ** 0.5

    def _scaled_update(self, k: int, clip: float, stream) -> Event:
        if clip < 1.0:
            self.shards.master_grad[k].mul_(clip)
        self.update(k, stream)
        return stream.record()

    def wait_host_jobs(self) -> None:
        """The compute stream waits for every job of the optimizer thread so far (the next
        gathers read the compute copies it updates)."""
        for job in self._host_jobs:
            self.dev.compute.wait(job.result())
        self._host_jobs.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.grads_out.synchronize()
