"""Stage prefetch: copy a stage's compute-dtype weights host -> device in the background.

One thread per worker takes load requests in priority order (the mapping's rule: the stage that
executes earlier goes first; stream priorities do not order memory copies, so the queue does) and
issues each load on the parameter copy stream of the device layer.  A stage's weights are one
flat host buffer; the load allocates one flat device buffer and copies into it in chunks, each as
soon as :class:`DeviceMemory` has room for it beside the running stage's working memory, so a
stage is prefetched as far as the budget allows while the current stage computes, and the rest
follows the moment the current stage is released.  The stage's parameters are views of the
device buffer.  The compute stream waits on the load's event before it reads the weights.  A stage
whose weights wait on disk (:mod:`mobius.swap.disk`) is first read whole into a staging buffer of
the host's (one, reused: the largest such stage), then copied as any other.

Activation and gradient transfers use streams of their own (see :mod:`mobius.stages.executor`):
they never queue behind a parameter prefetch.  Under the dispatched schedule the weights give way
to the device's input uploads on the link as well (:mod:`mobius.swap.upload_gate`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from typing import Callable

import torch
from torch import nn

from mobius.metrics import Trace
from mobius.models import GPTConfig, build_layer
from mobius.runtime.device import COPY_CHUNK_BYTES, Device, Event
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.store import HostStageStore, view
from mobius.swap.upload_gate import AHEAD, UploadGate


class DeviceStage:
    """A stage's layers on the device; usable once :meth:`wait` returns."""

    def __init__(self, index: int, sources: list[torch.Tensor | None], nbytes: int, after: Event,
                 ready: Callable[[], None] | None = None):
        self.index = index
        self.ready = ready  # blocks the prefetcher's thread until the host weights are written
        # The host buffers to load, in slab order: frozen, then this step's compute copy (None: on disk).
        self.sources = sources
        self.nbytes = nbytes
        self.after = after  # the load starts after this compute-stream event
        self.layers: nn.ModuleList | None = None
        self.weights: torch.Tensor | None = None  # the flat device buffer the parameters view
        self.event: Event | None = None  # recorded on the copy stream after the last copy
        self._loaded = threading.Event()
        self.error: BaseException | None = None


class Prefetcher:
    def __init__(self, store: HostStageStore, config: GPTConfig, memory: DeviceMemory, device: Device,
                 traffic: Traffic, trace: Trace, disk=None, gate: UploadGate | None = None):
        """``disk``: the disk tier holding the compute copy of the stages whose weights wait there;
        ``gate``: the device's input uploads, which the weights give way to (the dispatched
        schedule's rule: :mod:`mobius.swap.upload_gate`)."""
        self.store, self.config, self.memory, self.device = store, config, memory, device
        self.disk, self.gate = disk, gate
        self._staging: torch.Tensor | None = None  # where a stage's weights on disk are read to
        self._staged: Event | None = None  # the last copy out of it
        self.traffic, self.trace = traffic, trace
        self._layers: dict[int, nn.ModuleList] = {}  # each stage's device modules, built once
        self.stream = device.new_stream("h2d-params", "h2d")
        self._queue: list = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mobius-prefetch", daemon=True)
        self._thread.start()

    def request(self, stage: int, priority: int, step: int | None = None,
                ready: Callable[[], None] | None = None) -> DeviceStage:
        """Load ``stage`` after the work the compute stream has been given so far (which covers
        the update that last wrote its host weights): the compute copy that step ``step`` reads
        (None: the one the store's current step reads), once ``ready()`` returns (an update of
        another thread's that writes it)."""
        host = self.store.stages[stage]
        compute = host.compute if step is None else self.store.compute_of(stage, step)
        handle = DeviceStage(stage, [host.frozen, None if host.weights_on_disk else compute], host.param_bytes,
                             self.device.compute.record(), ready)
        with self._cond:
            heapq.heappush(self._queue, (priority, next(self._counter), handle))
            self._cond.notify()
        return handle

    def wait(self, handle: DeviceStage) -> nn.ModuleList:
        """The stage's layers, with the compute stream ordered after their load."""
        handle._loaded.wait()
        if handle.error is not None:
            raise handle.error
        self.device.compute.wait(handle.event)
        self.device.compute.reads(handle.weights)
        return handle.layers

    def release(self, handle: DeviceStage) -> None:
        """Evict a stage: its device weights are dropped and their bytes returned to the budget."""
        layers = self.wait(handle)
        for p in layers.parameters():
            p.data = self.device.nothing(p.dtype)
            p.grad = None
        self.device.compute.record()  # the compute stream's reads of the weights end here
        handle.layers = handle.weights = None
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

    def _device_layers(self, s: int) -> nn.ModuleList:
        """The stage's modules on the device, built once; a swap only re-points each Parameter's
        data.  Keeping the Parameter objects lets an autograd graph recorded in forward (recompute
        off) find the reloaded weights in backward and accumulate gradients into them."""
        if s not in self._layers:
            layers = nn.ModuleList([build_layer(self.config, i, seed=0, device="meta")
                                    for i in self.store.stages[s].layer_ids])
            for module in layers.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = nn.Parameter(self.device.nothing(self.store.compute_dtype),
                                                                requires_grad=p.requires_grad)
            self._layers[s] = layers
        return self._layers[s]

    def _from_disk(self, host) -> torch.Tensor:
        """Stage ``host``'s compute copy, read from the disk tier into the staging buffer once the
        copies out of it of the last such load are done."""
        numel = host.grad_staging.numel()
        if self._staging is None or self._staging.numel() < numel:
            largest = max(st.grad_staging.numel() for st in self.store.stages.values() if st.weights_on_disk)
            self._staging = self.device.host_buffer(largest, self.store.compute_dtype)
        if self._staged is not None:
            self._staged.synchronize()
        self.disk.read_weights(host.index, self._staging)
        return self._staging[:numel]

    def _load(self, handle: DeviceStage) -> None:
        if handle.ready is not None:
            handle.ready()
        host = self.store.stages[handle.index]
        layers = self._device_layers(handle.index)
        sources = [self._from_disk(host) if t is None else t for t in handle.sources]
        numel = sum(t.numel() for t in sources)
        weights = self.device.empty(numel, self.store.compute_dtype, self.stream, name=f"weights of stage {handle.index}")
        self.stream.wait(handle.after)
        # The copies' spans on the trace's "prefetch" lane, one per run of copies: a wait for device
        # memory between two of them is not the link's time, and a span across it makes the link
        # look slower than it is.
        tracing = self.trace.enabled
        bursts: list[list] = []  # [begin event, end event or None, bytes]

        def end_burst() -> None:
            if bursts and bursts[-1][1] is None:
                bursts[-1][1] = self.stream.record()

        at = 0
        unfinished: deque[Event] = deque()  # with a gate: the pieces issued and maybe still copying
        for source in sources:
            step = max(1, (COPY_CHUNK_BYTES if self.gate is None else self.gate.piece_bytes()) // source.element_size())
            for a in range(0, source.numel(), step):
                b = min(a + step, source.numel())
                nbytes = (b - a) * source.element_size()
                self.memory.reserve_for_prefetch(nbytes, self._stop, before_waiting=end_burst if tracing else None)
                if self.gate is not None:
                    while len(unfinished) >= AHEAD:
                        unfinished.popleft().synchronize()
                    self.gate.wait_clear()
                if tracing and (not bursts or bursts[-1][1] is not None):
                    bursts.append([self.stream.record(), None, 0])
                self.stream.copy(weights[at + a:at + b], source[a:b])
                if self.gate is not None:
                    unfinished.append(self.stream.record())
                self.traffic.h2d += nbytes
                if tracing:
                    bursts[-1][2] += nbytes
            at += source.numel()
        for p, slot in zip(layers.parameters(), host.slots):
            p.data = view(weights, slot)
        handle.weights, handle.layers = weights, layers
        handle.event = self.stream.record()
        if host.weights_on_disk:
            self._staged = handle.event
        if bursts and bursts[-1][1] is None:
            bursts[-1][1] = handle.event
        for begin, end, nbytes in bursts:
            self.trace.device_span(f"load stage {handle.index}", "prefetch", begin, end, self.device.time_of,
                                   bytes=nbytes)
