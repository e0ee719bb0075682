"""CUDA GPUs as a device: CUDA streams and events, ``non_blocking`` copies from page-locked host
memory (one ``cudaHostRegister`` per buffer, not ``pin_memory()`` per tensor: the caching host
allocator rounds every request up to a power of two), ``record_stream`` for the allocator; and
the process-wide queries of the profiler, the reference trainer and checkpoints (which fall back
to the CPU where there is no GPU)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from mobius.runtime.device.base import Device, Event, Stream, chunked
from mobius.runtime.device.cpu import _InlineStream


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

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
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
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


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

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.torch_device)

    def time_of(self, event: Event) -> float:
        if event._cuda is None:  # a host thread's event
            return super().time_of(event)
        event._cuda.synchronize()
        return self._anchor_s + self._anchor._cuda.elapsed_time(event._cuda) / 1e3

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # Portable: page-locked for every device of the process (the dispatched schedule's
            # devices all load from one host store), not only for the current one.
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
            self._registered.append(t)
        return t

    def close(self) -> None:
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()


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
