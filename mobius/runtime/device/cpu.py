"""CPU workers as a device: the compute stream is the calling thread (work runs as it is issued,
as a CUDA stream does from the point of view of a host that then waits); every other stream is a
thread executing its queue in order; an event is set when its stream reaches it, and waiting on
it orders the waiting stream behind it for real.  Streams can be slowed by random sleeps
(``MOBIUS_STREAM_JITTER_MS``) to shake out ordering bugs, and checked
(:mod:`~mobius.runtime.device.checker`)."""

from __future__ import annotations

import ctypes
import os
import queue
import random
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

from mobius.runtime.device.base import WITHIN_DEVICE, Device, Event, Stream, _copy_pieces

CHECK_ENV = "MOBIUS_CHECK_STREAMS"
JITTER_ENV = "MOBIUS_STREAM_JITTER_MS"
KEEP_FREED_ENV = "MOBIUS_KEEP_FREED_MEMORY"


class _InlineStream(Stream):
    """The calling thread as a stream (the compute stream, or a host thread such as the
    optimizer's): work runs as it is issued."""

    def record(self) -> Event:
        event = self._new_event()
        event.at_s = time.perf_counter()
        event._done.set()
        return event

    def _wait(self, event: Event) -> None:
        event._done.wait()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        self.device.timed_copy(direction, dst, src)


class _ThreadStream(Stream):
    """A thread executing this stream's queue in order.  A failed job fails the stream: later work
    is skipped, events are still set (no waiter hangs), and the error is raised by the next
    issue on the stream or by synchronizing one of its events."""

    def __init__(self, device: "CpuDevice", name: str, direction: str, jitter_s: float):
        super().__init__(device, name, direction)
        self._jitter_s = jitter_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"mobius-stream-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job, event = self._queue.get()
            if job is None and event is None:
                return
            if event is not None:
                event.at_s = time.perf_counter()
                event._done.set()
                continue
            if self._jitter_s:
                time.sleep(random.uniform(0, self._jitter_s))
            if self.error is None:
                try:
                    job()
                except BaseException as err:
                    self.error = err

    def _enqueue(self, job: Callable[[], None] | None, event: Event | None = None) -> None:
        if self.error is not None:
            raise RuntimeError(f"stream '{self.name}' failed: {self.error}") from self.error
        self._queue.put((job, event))

    def record(self) -> Event:
        event = self._new_event()
        event._stream = self
        self._enqueue(None, event)
        return event

    def _wait(self, event: Event) -> None:
        self._enqueue(event.synchronize)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        self._enqueue(lambda: self.device.timed_copy(direction, dst, src))

    def close(self) -> None:
        self._queue.put((None, None))
        self._thread.join(timeout=10)


def keep_freed_host_memory() -> None:
    """A CPU worker allocates and frees flat buffers of tens to hundreds of MB every step (stage
    weights, gradients).  glibc hands buffers that large back to the kernel (mmap, heap trim), and
    the next step pays a page fault per 4 KB to get them back.  Keep them in the heap instead, as
    the CUDA caching allocator keeps device memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


class CpuDevice(Device):
    """CPU workers; with ``emulation`` (:class:`~mobius.runtime.emulation.EmulatedLinks`), each stands
    for a GPU of a PCIe box: copies take the emulated link's time, compute at least the GPU's."""

    kind = "cpu"

    def __init__(self, check: bool | None = None, jitter_ms: float | None = None, emulation=None):
        if check is None:
            check = os.environ.get(CHECK_ENV) == "1"
        if jitter_ms is None:
            jitter_ms = float(os.environ.get(JITTER_ENV, "0") or 0)
        super().__init__(torch.device("cpu"), check)
        self._jitter_s = jitter_ms / 1e3
        self.compute = _InlineStream(self, "compute")
        self._streams: list[_ThreadStream] = []
        self.emulation = emulation

    def timed_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """As fast as memory goes, or at the emulated link's rate.  A copy within the emulated
        GPU's memory crosses no link: at HBM's terabytes per second it is taken as free."""
        if self.emulation is None or direction == WITHIN_DEVICE:
            _copy_pieces(dst, src)
        else:
            self.emulation.transfer(src.numel() * src.element_size(), direction, lambda: _copy_pieces(dst, src))

    def compute_span(self, emulated_s: float):
        return nullcontext() if self.emulation is None else self.emulation.compute_span(emulated_s)

    def host_update_span(self, params: int):
        return nullcontext() if self.emulation is None else self.emulation.host_update_span(params)

    def network_time(self, nbytes: int) -> None:
        if self.emulation is not None:
            self.emulation.exchange(nbytes)

    def disk_transfer(self, nbytes: int, write: bool, io) -> None:
        if self.emulation is None:
            io()
        else:
            self.emulation.disk(nbytes, write, io)

    def start_steps(self) -> None:
        # Only now: while the stage store is built, the fp32 layers it copies from must go back
        # to the kernel, not stay in the heap.  MOBIUS_KEEP_FREED_MEMORY=0 turns the policy off
        # (scripts/measure_host_memory.py: the stand-in device's freed slabs then leave the RSS).
        if os.environ.get(KEEP_FREED_ENV, "1") != "0":
            keep_freed_host_memory()

    def new_stream(self, name: str, direction: str) -> Stream:
        stream = _ThreadStream(self, name, direction, self._jitter_s)
        self._streams.append(stream)
        return stream

    def host_stream(self, name: str) -> Stream:
        """A host thread's view as a stream (it synchronises by waiting on events)."""
        return _InlineStream(self, name)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self.checker is not None:
            self.checker.register(t, f"host buffer of {numel} {dtype}")
        return t

    def close(self) -> None:
        for s in self._streams:
            s.close()


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or ``taskset``'s share, not
    every core of the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads_per_worker(workers: int) -> int:
    """The cores of one of ``workers`` workers sharing this process's."""
    return max(1, usable_cores() // max(1, workers))
