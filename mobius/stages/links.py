"""Activations and their gradients on their way between stages, as one worker sees them.

A stage's output leaves the device on a copy stream of its own (``d2h-activations``), never
behind a parameter prefetch or a gradient offload and never blocking the compute stream, into a
reusable host buffer (page-locked on CUDA); once it is home it goes to the worker of the next stage
through the :mod:`~mobius.stages.transport`, or, when this worker holds that stage too, into a
local mailbox.  Inputs arrive into host buffers and go to the device on the compute stream, which
needs them next.

A sender thread hands each message to the transport the moment its copy is home.  (Handing them
over from the compute thread between micro-batches delayed every message by a micro-batch: with
recomputation the compute thread blocks in the next receive first.  ``--emulate`` showed it.)
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

from mobius.metrics import Trace
from mobius.runtime.device import Device, Event, Stream
from mobius.stages.transport import Transport
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.upload_gate import UploadGate


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostBuffers:
    """Reusable host buffers (page-locked on CUDA) for activations on their way between devices.
    A buffer comes back with the event after its last use; whoever takes it again waits for that
    event first, so a buffer is never overwritten while a copy still reads it."""

    def __init__(self, device: Device, host: Stream):
        self.device, self.host = device, host
        self._free: dict[tuple, list[tuple[torch.Tensor, Event]]] = {}
        self._ours: set[int] = set()

    def get(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype))
        if free:
            buf, last_use = free.pop()
            self.host.wait(last_use)
            return buf
        numel = 1
        for d in shape:
            numel *= d
        buf = self.device.host_buffer(numel, dtype).view(shape)
        self._ours.add(buf.data_ptr())
        return buf

    def put(self, buf: torch.Tensor, last_use: Event) -> None:
        if buf.data_ptr() in self._ours:  # e.g. token batches are not ours to reuse
            self._free.setdefault((tuple(buf.shape), buf.dtype), []).append((buf, last_use))


class ActivationLinks:
    """One worker's ends of the links between workers.  A message is keyed by what the schedule
    names it (the bound pipeline: the sending stage, micro-batch and pass); ``tag_of`` numbers a
    key for the transport, the same on both ends."""

    def __init__(self, transport: Transport, device: Device, host: Stream, memory: DeviceMemory,
                 traffic: Traffic, trace: Trace, tag_of: Callable[[tuple], int], gate: UploadGate | None = None):
        """``gate``: where the device's weights give way to its input uploads (the dispatched
        schedule's)."""
        self.transport, self.device, self.tag_of, self.gate = transport, device, tag_of, gate
        self.memory, self.traffic, self.trace = memory, traffic, trace
        self.rank = transport.rank
        self.compute, self.host = device.compute, host
        self.d2h = device.new_stream("d2h-activations", "d2h")
        self.buffers = HostBuffers(device, host)
        self._outbox: list[tuple] = []  # for this worker itself: (event, buffer, key)
        self._mailbox: dict[tuple, torch.Tensor] = {}  # messages from this worker to itself
        self._sending: queue.SimpleQueue = queue.SimpleQueue()  # (event, buffer, dst, tag), or None: stop
        self._sender_view = device.host_stream("sender")  # what the sender thread does to host buffers
        self._pending: list[tuple] = []  # (send work, buffer, event after the sender's hand-over)
        self._handed = threading.Condition()
        self._queued = self._done = 0
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="mobius-sender", daemon=True)
        self._sender.start()

    def to_device(self, host: torch.Tensor, what: str, recycle: bool = True) -> torch.Tensor:
        """A host tensor (ours, or a token batch) -> a new device tensor, on the compute stream:
        the compute needs it next, and it never waits behind a parameter prefetch.  Unless
        ``recycle`` is off (the caller keeps ``host``, then hands it to :meth:`recycle`), the host
        buffer is reused once the copy is done."""
        n = nbytes(host)
        self.memory.allocate(n, what)  # the caller frees it within the running phase
        self.traffic.h2d += n
        x = self.device.empty(host.numel(), host.dtype, name=what).view(host.shape)
        self.compute.wait(self.host.record())  # after this thread's writes (a receive) of ``host``
        with self.gate.upload(self.compute, n) if self.gate is not None else nullcontext():
            self.compute.copy(x, host)
        if recycle:
            self.recycle(host)
        return x

    def recycle(self, host: torch.Tensor) -> None:
        """``host`` is free again once the compute stream's work so far is done."""
        self.buffers.put(host, self.compute.record())

    def send(self, t: torch.Tensor, dst: int, key: tuple) -> None:
        """Device tensor -> host on the D2H stream, without blocking the compute stream; the host
        leg to worker ``dst`` follows (to this worker itself: in :meth:`flush`)."""
        self.send_to(t, [(dst, key)])

    def send_to(self, t: torch.Tensor, messages: list[tuple[int, tuple]]) -> None:
        """:meth:`send` of one tensor as several messages, ``(worker, key)`` each, from one copy
        off the device (a message to this worker itself beside others gets a host copy)."""
        self.d2h.wait(self.compute.record())  # after ``t`` was computed
        buf = self.buffers.get(tuple(t.shape), t.dtype)
        self.d2h.wait(self.host.record())  # after the buffer's previous use
        self.d2h.copy(buf, t, name="activation staging buffer")
        self.traffic.d2h += nbytes(t)
        home = self.d2h.record()
        remote = [(dst, self.tag_of(key)) for dst, key in messages if dst != self.rank]
        for k, (_, key) in enumerate((dst, key) for dst, key in messages if dst == self.rank):
            self._outbox.append((home, buf, key, bool(remote) or k > 0))
        if remote:
            self.traffic.peer += nbytes(t) * len(remote)
            with self._handed:
                self._queued += 1
            self._sending.put((home, buf, remote))

    def _send_loop(self) -> None:
        while (item := self._sending.get()) is not None:
            done, buf, remote = item
            try:
                if self._error is None:
                    self._sender_view.wait(done)  # the copy is home
                    self._sender_view.reads(buf)
                    works = [self.transport.isend(buf, dst, tag) for dst, tag in remote]
                    with self._handed:
                        self._pending.append((works, buf, self._sender_view.record()))
            except BaseException as err:  # surfaced by finish_sends
                self._error = err
            with self._handed:
                self._done += 1
                self._handed.notify_all()

    def flush(self, keep: int = 0) -> None:
        """Move every message to this worker itself that reached the host, but the last ``keep``,
        into the mailbox (messages to other workers leave by the sender thread)."""
        while len(self._outbox) > keep:
            done, buf, key, shared = self._outbox.pop(0)
            self.host.wait(done)
            self.host.reads(buf)
            self._mailbox[key] = buf.clone() if shared else buf  # a shared one is another message's too

    def recv(self, src: int, key: tuple, shape, dtype) -> torch.Tensor:
        """The message ``key`` from worker ``src`` (this one: from the mailbox), in a host buffer."""
        if src == self.rank:
            return self._mailbox.pop(key)
        buf = self.buffers.get(tuple(shape), dtype)
        self.host.writes(buf, name="activation receive buffer")
        t0 = time.perf_counter()
        self.transport.recv(buf, src, self.tag_of(key))
        self.trace.span("recv", "comm", t0, time.perf_counter(), key=str(key))
        return buf

    def finish_sends(self) -> None:
        """Wait for the messages of this step to be delivered; their buffers are free again."""
        with self._handed:
            self._handed.wait_for(lambda: self._done == self._queued)
            pending, self._pending = self._pending, []
        if self._error is not None:
            raise RuntimeError(f"sending an activation failed: {self._error}") from self._error
        for works, buf, handed in pending:
            for work in works:
                work.wait()
            self.host.wait(handed)
            self.buffers.put(buf, self.host.record())

    def reap(self) -> None:
        """The buffers of the messages already delivered are free again (without waiting for the
        others: a schedule whose steps overlap never waits for all of them)."""
        with self._handed:
            delivered, waiting = [], []
            for sent in self._pending:
                works, _, handed = sent
                (delivered if handed.query() and all(w.is_completed() for w in works) else waiting).append(sent)
            self._pending = waiting
        for _, buf, handed in delivered:
            self.host.wait(handed)
            self.buffers.put(buf, self.host.record())

    def close(self) -> None:
        self._sending.put(None)
        self._sender.join(timeout=10)
        self.d2h.synchronize()
