"""The device layer's interface: a device, its streams and their events, the one contract both
implementations keep (:mod:`~mobius.runtime.device.cpu`, :mod:`~mobius.runtime.device.cuda`)."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import torch

from mobius.runtime.device.checker import Clock, StreamChecker

COPY_CHUNK_BYTES = 64 * 2**20  # host<->device copies of flat buffers go in pieces of this size
WITHIN_DEVICE = "device"  # a copy's direction when both tensors are in device memory



class Event:
    """A point in a stream's work.  ``synchronize`` blocks the calling host thread until then."""

    def __init__(self, stream: "Stream", seq: int, vector: dict[int, int]):
        self.stream_id, self.stream_name, self.seq, self.vector = stream.clock.own, stream.name, seq, vector
        self._done = threading.Event()
        self.at_s: float | None = None  # host clock when a CPU stream reached it (Device.time_of)
        self._cuda = None
        self._stream = None  # a CPU side stream, whose failure the event reports

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()
            return
        self._done.wait()
        error = getattr(self._stream, "error", None)
        if error is not None:
            raise RuntimeError(f"stream '{self.stream_name}' failed: {error}") from error

    def query(self) -> bool:
        return self._cuda.query() if self._cuda is not None else self._done.is_set()


class Stream:
    """An ordered queue of device work.  ``reads``/``writes`` declare what the work issued since
    the last :meth:`record` uses, for the checker; copies declare their own."""

    _ids = iter(range(1, 1 << 30))

    def __init__(self, device: "Device", name: str, direction: str = "h2d"):
        self.device, self.name = device, name
        self.direction = direction  # of its copies by default: "h2d" or "d2h" (the compute stream's are h2d)
        self.clock = Clock(next(Stream._ids))
        self._reads: list[torch.Tensor] = []
        self._writes: list[torch.Tensor] = []

    # declarations (checked on CPU; free on CUDA)
    def reads(self, *tensors: torch.Tensor, name: str | None = None) -> None:
        if self.device.checker is not None:
            self._declare(self.device.checker.check_read, self._reads, tensors, name)

    def writes(self, *tensors: torch.Tensor, name: str | None = None) -> None:
        if self.device.checker is not None:
            self._declare(self.device.checker.check_write, self._writes, tensors, name)

    def _declare(self, check, uses: list[torch.Tensor], tensors, name: str | None) -> None:
        for t in tensors:
            check(self, t, name)
            uses.append(t)

    def _new_event(self) -> Event:
        vector = self.clock.tick()
        event = Event(self, vector[self.clock.own], vector)
        if self.device.checker is not None:
            self.device.checker.note(event, self._reads, self._writes)
        self._reads, self._writes = [], []
        return event

    def wait(self, event: Event) -> None:
        """Work issued on this stream from now on starts after ``event``."""
        self.clock.merge(event.vector)
        self._wait(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str | None = None, direction: str | None = None) -> None:
        """``dst.copy_(src)`` on this stream (chunked for large flat buffers), across the link in
        the stream's direction unless ``direction`` says otherwise (``WITHIN_DEVICE``: both
        tensors in device memory, no link crossed)."""
        self.reads(src, name=None)
        self.writes(dst, name=name)
        self._copy(dst, src, direction or self.direction)

    def record(self) -> Event:
        raise NotImplementedError

    def _wait(self, event: Event) -> None:
        raise NotImplementedError

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        self.record().synchronize()


class Device:
    """One worker's device: its compute stream, side streams, host buffers and memory queries."""

    kind = "abstract"

    def __init__(self, torch_device: torch.device, check: bool = False):
        self.torch_device = torch_device
        self.checker = StreamChecker() if check else None
        self.compute: Stream

    def new_stream(self, name: str, direction: str) -> Stream:
        """A stream for copies in ``direction`` ("h2d" or "d2h")."""
        raise NotImplementedError

    def compute_span(self, emulated_s: float):
        """Context for the compute of one micro-batch on a stage whose emulated GPU takes
        ``emulated_s`` (:mod:`mobius.runtime.emulation`); nothing on real devices."""
        return nullcontext()

    def host_update_span(self, params: int):
        """Context for a host AdamW update of ``params`` parameters by this device's optimizer
        thread: the emulated host's time on emulated GPUs; nothing otherwise."""
        return nullcontext()

    def disk_transfer(self, nbytes: int, write: bool, io) -> None:
        """The disk tier's read or write of ``nbytes`` (``io()`` does it): on emulated GPUs it
        lasts at least the emulated drives' time; otherwise it is what it is."""
        io()

    def network_time(self, nbytes: int) -> None:
        """A collective between data-parallel replicas that moved ``nbytes`` over this box's
        network has just run: emulated boxes take their network's time for it; nothing otherwise."""

    def timed_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The copy a CPU-side stream performs (emulated devices take their links' time for
        copies that cross one)."""
        _copy_pieces(dst, src)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer the device copies to and from asynchronously (page-locked on CUDA)."""
        raise NotImplementedError

    def empty(self, numel: int, dtype: torch.dtype, stream: Stream | None = None,
              name: str | None = None) -> torch.Tensor:
        """A flat device buffer, allocated for ``stream`` (default: compute), which owns its
        first write; any other stream must wait for an event of that stream before touching it."""
        stream = stream or self.compute
        t = self._allocate(numel, dtype, stream)
        if self.checker is not None:
            self.checker.register(t, name or f"device buffer of {numel} {dtype}")
            stream.writes(t)
        return t

    def _allocate(self, numel: int, dtype: torch.dtype, stream: Stream) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def nothing(self, dtype: torch.dtype) -> torch.Tensor:
        """No elements, on the device: what a parameter points at while its weights are elsewhere."""
        return torch.empty(0, dtype=dtype, device=self.torch_device)

    def host_stream(self, name: str) -> Stream:
        """A host thread seen as a stream: it orders itself after an event by waiting for it."""
        raise NotImplementedError

    def time_of(self, event: Event) -> float:
        """When ``event``'s stream reached it, on the host clock (``time.perf_counter``); blocks
        until it has.  Traces time device work by this, not by when the host issued it."""
        event.synchronize()
        return event.at_s

    def close(self) -> None:
        pass

    def start_steps(self) -> None:
        """The long-lived host state is built; what follows is the steps' allocate-and-free cycle."""

    def bind_thread(self) -> None:
        """The calling thread works on this device from now on (one process driving several)."""


def chunked(dst: torch.Tensor, src: torch.Tensor):
    """Pairs of pieces of two flat tensors, ``COPY_CHUNK_BYTES`` at a time.  Copies move data,
    never autograd history: the pieces are detached."""
    dst, src = dst.detach(), src.detach()
    step = max(1, COPY_CHUNK_BYTES // max(1, src.element_size()))
    n = src.numel()
    if n <= step or dst.dim() != 1 or src.dim() != 1:
        yield dst, src
        return
    for a in range(0, n, step):
        yield dst[a:a + step], src[a:a + step]


def _copy_pieces(dst: torch.Tensor, src: torch.Tensor) -> None:
    for d, s in chunked(dst, src):
        d.copy_(s)
