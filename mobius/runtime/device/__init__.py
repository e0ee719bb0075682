"""The device layer: the only code of the runtime that touches ``torch.cuda``, pinned memory,
streams and events (the measuring commands time the card directly: :mod:`topology.bandwidth` its
pinned copies, :mod:`mobius.rates` its GEMMs and AdamW).  Everything above it (prefetcher,
schedule, gradient offload, chunked_dp) runs the same lines on CUDA and on CPU workers.

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

from mobius.runtime.device.base import COPY_CHUNK_BYTES, WITHIN_DEVICE, Device, Event, Stream, chunked
from mobius.runtime.device.checker import StreamOrderError
from mobius.runtime.device.cpu import CpuDevice, cpu_threads_per_worker, usable_cores
from mobius.runtime.device.cuda import (
    CUDA_ALLOCATOR_SLACK_BYTES,
    CUDA_RESERVE_BYTES,
    CudaDevice,
    cuda_available,
    cuda_device_name,
    memory_allocated,
    peak_memory,
    reset_peak_memory,
    rng_states,
    set_rng_states,
    time_per_call,
)

__all__ = ["COPY_CHUNK_BYTES", "CUDA_ALLOCATOR_SLACK_BYTES", "CUDA_RESERVE_BYTES", "WITHIN_DEVICE", "CpuDevice",
           "CudaDevice", "Device", "Event", "Stream", "StreamOrderError", "chunked", "cpu_threads_per_worker",
           "cuda_available", "cuda_device_name", "memory_allocated", "open_device", "peak_memory", "reset_peak_memory",
           "rng_states", "set_rng_states", "time_per_call", "usable_cores"]


def open_device(use_cuda: bool, local_rank: int = 0, memory_cap_bytes: int | None = None, emulation=None) -> Device:
    return CudaDevice(local_rank, memory_cap_bytes) if use_cuda else CpuDevice(emulation=emulation)
