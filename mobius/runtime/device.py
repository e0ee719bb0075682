"""The device layer: the only code of the runtime that touches ``torch.cuda``, pinned memory,
streams and events.  Everything above it (prefetcher, schedule, gradient offload, chunked_dp)
runs the same lines on CUDA and on CPU workers.

Two implementations of one interface, after torchgpipe's ``stream.py`` but asynchronous on the
CPU too:

* :class:`CudaDevice`: CUDA streams and events, ``non_blocking`` copies from page-locked host
  memory (one ``cudaHostRegister`` per buffer, not ``pin_memory()`` per tensor: the caching host
  allocator rounds every request up to a power of two), ``record_stream`` for the allocator.
* :class:`CpuDevice`: the compute stream is the calling thread (work runs as it is issued, as a
  CUDA stream does from the point of view of a host that then waits); every other stream is a
  thread executing its queue in order; an event is set when its stream reaches it, and waiting on
  it orders the waiting stream behind it for real.  Streams can be slowed by random sleeps
  (``MOBIUS_STREAM_JITTER_MS``) to shake out ordering bugs.

The CPU implementation also *checks* the ordering (:class:`StreamChecker`, on when
``MOBIUS_CHECK_STREAMS=1``, as in the tests).  Streams carry vector clocks; every buffer
remembers the event of its last write and the events of its readers.  Reading a buffer on a
stream that has not waited for its last write, or writing/reusing it while a read on another
stream may still be pending, raises :class:`StreamOrderError` naming the buffer and the streams:
exactly the bugs that on a GPU corrupt a tensor silently.  The runtime declares its reads and
writes (``stream.reads``/``writes``); copies declare theirs.
"""

from __future__ import annotations

import ctypes
import os
import queue
import random
import threading
import time
import weakref
from contextlib import nullcontext
from typing import Callable

import torch

CHECK_ENV = "MOBIUS_CHECK_STREAMS"
JITTER_ENV = "MOBIUS_STREAM_JITTER_MS"
KEEP_FREED_ENV = "MOBIUS_KEEP_FREED_MEMORY"
COPY_CHUNK_BYTES = 64 * 2**20  # host<->device copies of flat buffers go in pieces of this size


class StreamOrderError(RuntimeError):
    """A buffer used on a stream that is not ordered after the buffer's last write, or reused while a
    read of it may still be pending: a race on a GPU."""


# ---- ordering: vector clocks and the checker ---------------------------------------------------------

class Clock:
    """What a stream has synchronised with: {stream id: last sequence number seen}."""

    def __init__(self, own: int):
        self.own = own
        self.seen: dict[int, int] = {own: 0}

    def tick(self) -> dict[int, int]:
        self.seen[self.own] += 1
        return dict(self.seen)

    def merge(self, other: dict[int, int]) -> None:
        for k, v in other.items():
            if v > self.seen.get(k, 0):
                self.seen[k] = v

    def covers(self, stream: int, seq: int) -> bool:
        return self.seen.get(stream, 0) >= seq


class _Buffer:
    __slots__ = ("name", "write", "reads")

    def __init__(self, name: str):
        self.name = name
        self.write: Event | None = None  # the event after the last write
        self.reads: list[Event] = []  # events after reads since that write


class StreamChecker:
    """Tracks the buffers the device layer handed out (:meth:`register`) for as long as they
    live; raises :class:`StreamOrderError` on a race.  Other tensors (autograd's) are not
    tracked: the allocator (``record_stream``) orders their reuse."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict[int, _Buffer] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def register(self, t: torch.Tensor, name: str) -> None:
        key = self._key(t)
        with self._lock:
            self._buffers[key] = _Buffer(name)
        weakref.finalize(t, self._forget, key, self._buffers[key])

    def _forget(self, key: int, buf: _Buffer) -> None:
        with self._lock:
            if self._buffers.get(key) is buf:
                del self._buffers[key]

    def _buffer(self, t: torch.Tensor, name: str | None) -> _Buffer | None:
        buf = self._buffers.get(self._key(t))
        if buf is not None and name:
            buf.name = name
        return buf

    def check_read(self, stream: "Stream", t: torch.Tensor, name: str | None = None) -> None:
        with self._lock:
            buf = self._buffer(t, name)
            if buf is None:
                return
            w = buf.write
            if w is not None and not stream.clock.covers(w.stream_id, w.seq):
                raise StreamOrderError(f"{buf.name} is read on stream '{stream.name}' before it waited for its "
                                       f"last write on stream '{w.stream_name}'")

    def check_write(self, stream: "Stream", t: torch.Tensor, name: str | None = None) -> None:
        with self._lock:
            buf = self._buffer(t, name)
            if buf is None:
                return
            for e in ([buf.write] if buf.write is not None else []) + buf.reads:
                if not stream.clock.covers(e.stream_id, e.seq):
                    what = "written" if e is buf.write else "read"
                    raise StreamOrderError(f"{buf.name} is overwritten or reused on stream '{stream.name}' while it "
                                           f"may still be {what} on stream '{e.stream_name}'")

    def note(self, event: "Event", reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        """``event`` was recorded after these reads and writes completed on its stream."""
        with self._lock:
            for t in writes:
                buf = self._buffer(t, None)
                if buf is not None:
                    buf.write, buf.reads = event, []
            for t in reads:
                buf = self._buffer(t, None)
                if buf is not None:
                    buf.reads.append(event)


# ---- the interface ---------------------------------------------------------------------------------

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
        self.direction = direction  # of its copies: "h2d" or "d2h" (the compute stream's are h2d)
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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str | None = None) -> None:
        """``dst.copy_(src)`` on this stream (chunked for large flat buffers)."""
        self.reads(src, name=None)
        self.writes(dst, name=name)
        self._copy(dst, src)

    def record(self) -> Event:
        raise NotImplementedError

    def _wait(self, event: Event) -> None:
        raise NotImplementedError

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
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

    def timed_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The copy a CPU-side stream performs (emulated devices take their links' time)."""
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

    # memory statistics of the device (CUDA) or nothing (CPU: the runtime accounts its budget)
    def reset_peak_memory(self) -> None:
        pass

    def peak_memory(self) -> int:
        return 0


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


# ---- CPU: threads as streams --------------------------------------------------------------------------

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

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.device.timed_copy(self.direction, dst, src)


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

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue(lambda: self.device.timed_copy(self.direction, dst, src))

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


def _copy_pieces(dst: torch.Tensor, src: torch.Tensor) -> None:
    for d, s in chunked(dst, src):
        d.copy_(s)


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
        """As fast as memory goes, or at the emulated link's rate."""
        if self.emulation is None:
            _copy_pieces(dst, src)
        else:
            self.emulation.transfer(src.numel() * src.element_size(), direction, lambda: _copy_pieces(dst, src))

    def compute_span(self, emulated_s: float):
        return nullcontext() if self.emulation is None else self.emulation.compute_span(emulated_s)

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


# ---- CUDA ---------------------------------------------------------------------------------------------

class _CudaStream(Stream):
    def __init__(self, device: "CudaDevice", name: str, stream, direction: str = "h2d"):
        super().__init__(device, name, direction)
        self.cuda = stream

    def record(self) -> Event:
        event = self._new_event()
        event._cuda = torch.cuda.Event(enable_timing=True)
        event._cuda.record(self.cuda)
        return event

    def _wait(self, event: Event) -> None:
        if event._cuda is not None:
            self.cuda.wait_event(event._cuda)
        else:  # an event of a host thread: already passed when it was handed over
            event._done.wait()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.cuda):
            for d, s in chunked(dst, src):
                d.copy_(s, non_blocking=True)
        # The caching allocator must not hand these tensors' memory to another stream before this
        # one is done with them.
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self.cuda)


class _CudaHostStream(_InlineStream):
    """A host thread: waiting on an event blocks it."""

    def _wait(self, event: Event) -> None:
        event.synchronize()


# What a GPU's memory holds beside the runtime's own tensors, and so is kept out of its budget (the
# planner's and the runtime's): inside the caching allocator the cuBLAS workspaces (32 MiB per
# stream on Hopper) and the allocator's rounding of blocks into segments; outside it the CUDA context
# (300-500 MB on recent drivers).
CUDA_ALLOCATOR_SLACK_BYTES = 128 * 2**20
CUDA_RESERVE_BYTES = CUDA_ALLOCATOR_SLACK_BYTES + 384 * 2**20


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, index: int, memory_cap_bytes: int | None = None):
        super().__init__(torch.device(f"cuda:{index}"), check=False)
        torch.cuda.set_device(self.torch_device)
        if memory_cap_bytes is not None:
            # The runtime accounts its budget itself; the allocator cap makes the device agree, with
            # the slack of what the libraries allocate through it beside the runtime's tensors.
            total = torch.cuda.get_device_properties(self.torch_device).total_memory
            cap = memory_cap_bytes + CUDA_ALLOCATOR_SLACK_BYTES
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.torch_device)
        self.compute = _CudaStream(self, "compute", torch.cuda.current_stream(self.torch_device))
        self._registered: list[torch.Tensor] = []
        # The device's clock against the host's: an event recorded on an idle device, taken to
        # happen when the host sees it complete (microseconds off; a step lasts milliseconds).
        torch.cuda.synchronize(self.torch_device)
        self._anchor = self.compute.record()
        self._anchor._cuda.synchronize()
        self._anchor_s = time.perf_counter()

    def new_stream(self, name: str, direction: str) -> Stream:
        return _CudaStream(self, name, torch.cuda.Stream(self.torch_device), direction)

    def _allocate(self, numel: int, dtype: torch.dtype, stream: Stream) -> torch.Tensor:
        with torch.cuda.stream(stream.cuda):
            t = torch.empty(numel, dtype=dtype, device=self.torch_device)
        if stream is not self.compute:
            t.record_stream(self.compute.cuda)  # the compute stream reads what side streams fill
        return t

    def host_stream(self, name: str) -> Stream:
        return _CudaHostStream(self, name)

    def time_of(self, event: Event) -> float:
        if event._cuda is None:  # a host thread's event
            return super().time_of(event)
        event._cuda.synchronize()
        return self._anchor_s + self._anchor._cuda.elapsed_time(event._cuda) / 1e3

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
            self._registered.append(t)
        return t

    def close(self) -> None:
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def peak_memory(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)


# ---- process-wide queries (the profiler, the reference trainer, checkpoints) ---------------------------

def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def rng_states() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng/torch_cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    if "rng/torch_cpu" in states:
        torch.set_rng_state(states["rng/torch_cpu"])
    if torch.cuda.is_available() and "rng/torch_cuda" in states:
        torch.cuda.set_rng_state(states["rng/torch_cuda"])


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_memory(device: torch.device) -> int:
    """Peak bytes the allocator handed out (CUDA); 0 on the CPU, where the runtime accounts itself."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def time_per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn``, timed by device events on CUDA (the host runs ahead)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def cpu_threads_per_worker(workers: int) -> int:
    """The cores of one of ``workers`` workers sharing this machine's."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


# ---- deciding which -------------------------------------------------------------------------------------

def open_device(use_cuda: bool, local_rank: int = 0, memory_cap_bytes: int | None = None, emulation=None) -> Device:
    return CudaDevice(local_rank, memory_cap_bytes) if use_cuda else CpuDevice(emulation=emulation)
