"""Stage prefetch: copy a stage's compute-dtype weights host -> device in the background.

One copy thread per worker takes load requests in priority order (the mapping's rule: the stage
that executes earlier goes first; CUDA stream priorities do not order memory copies, so the queue
does).  Each tensor is copied as soon as :class:`DeviceMemory` has room for it beside the running
stage's working memory, so a stage is prefetched as far as the budget allows while the current
stage computes, and the rest follows the moment the current stage is released.

On CUDA the copies run on a dedicated copy stream from pinned memory and the compute stream waits
on an event; on CPU workers the copy thread does a real memcpy into fresh tensors.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import torch
from torch import nn

from mobius.metrics import Trace
from mobius.models import GPTConfig, build_layer
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.store import HostStageStore


class DeviceStage:
    """A stage's layers on the device; usable once :meth:`wait` returns."""

    def __init__(self, index: int, nbytes: int):
        self.index = index
        self.nbytes = nbytes
        self.layers: nn.ModuleList | None = None
        self._loaded = threading.Event()
        self._event = None  # CUDA event recorded after the last copy
        self.error: BaseException | None = None

    def wait(self) -> nn.ModuleList:
        self._loaded.wait()
        if self.error is not None:
            raise self.error
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self.layers


class Prefetcher:
    def __init__(self, store: HostStageStore, config: GPTConfig, memory: DeviceMemory, device: torch.device,
                 traffic: Traffic, trace: Trace):
        self.store, self.config, self.memory, self.device = store, config, memory, device
        self.traffic, self.trace = traffic, trace
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: list = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mobius-prefetch", daemon=True)
        self._thread.start()

    def request(self, stage: int, priority: int) -> DeviceStage:
        handle = DeviceStage(stage, self.store.stages[stage].param_bytes)
        with self._cond:
            heapq.heappush(self._queue, (priority, next(self._counter), handle))
            self._cond.notify()
        return handle

    def release(self, handle: DeviceStage) -> None:
        """Evict a stage: its device weights are dropped and their bytes returned to the budget."""
        layers = handle.wait()
        for p in layers.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
        handle.layers = None
        self.memory.free(handle.nbytes)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                _, _, handle = heapq.heappop(self._queue)
            try:
                self._load(handle)
            except BaseException as err:  # surfaced to the compute thread by wait()
                handle.error = err
            handle._loaded.set()

    def _load(self, handle: DeviceStage) -> None:
        host = self.store.stages[handle.index]
        start = time.perf_counter()
        if host.device_layers is None:
            # Built once; a swap only replaces each Parameter's data.  Keeping the Parameter objects
            # lets an autograd graph recorded in forward (recompute off) find the reloaded weights
            # in backward and accumulate gradients into them.
            host.device_layers = nn.ModuleList([build_layer(self.config, i, seed=0, device="meta")
                                                for i in host.layer_ids])
            for module in host.device_layers.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = nn.Parameter(torch.empty(0, dtype=self.store.compute_dtype,
                                                                            device=self.device))
        for p, src in zip(host.device_layers.parameters(), host.compute_copy):
            nbytes = src.numel() * src.element_size()
            self.memory.reserve_for_prefetch(nbytes, self._stop)
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                    dst.copy_(src, non_blocking=True)
                    dst.record_stream(torch.cuda.default_stream(self.device))  # used by compute
            else:
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                dst.copy_(src)
            p.data = dst
            self.traffic.h2d += nbytes
        if self.stream is not None:
            handle._event = torch.cuda.Event()
            handle._event.record(self.stream)
        handle.layers = host.device_layers
        self.trace.span(f"load stage {handle.index}", "prefetch", start, time.perf_counter(),
                        bytes=handle.nbytes)
