"""The stream-order checker of the CPU device (on when ``MOBIUS_CHECK_STREAMS=1``, as in the tests).

Streams carry vector clocks; every buffer remembers the event of its last write and the events of
its readers.  Reading a buffer on a stream that has not waited for its last write, or
writing/reusing it while a read on another stream may still be pending, raises
:class:`StreamOrderError` naming the buffer and the streams: exactly the bugs that on a GPU
corrupt a tensor silently.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

import torch


class StreamOrderError(RuntimeError):
    """A buffer used on a stream that is not ordered after the buffer's last write, or reused while a
    read of it may still be pending: a race on a GPU."""


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


class Point(Protocol):
    """What the checker reads of an event (:class:`~mobius.runtime.device.base.Event`): the stream
    it was recorded on and its place there."""

    stream_id: int
    stream_name: str
    seq: int


class Ordered(Protocol):
    """What the checker reads of a stream (:class:`~mobius.runtime.device.base.Stream`)."""

    name: str
    clock: Clock


class _Buffer:
    __slots__ = ("name", "write", "reads")

    def __init__(self, name: str):
        self.name = name
        self.write: Point | None = None  # the event after the last write
        self.reads: list[Point] = []  # events after reads since that write


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

    def check_read(self, stream: Ordered, t: torch.Tensor, name: str | None = None) -> None:
        with self._lock:
            buf = self._buffer(t, name)
            if buf is None:
                return
            w = buf.write
            if w is not None and not stream.clock.covers(w.stream_id, w.seq):
                raise StreamOrderError(f"{buf.name} is read on stream '{stream.name}' before it waited for its "
                                       f"last write on stream '{w.stream_name}'")

    def check_write(self, stream: Ordered, t: torch.Tensor, name: str | None = None) -> None:
        with self._lock:
            buf = self._buffer(t, name)
            if buf is None:
                return
            for e in ([buf.write] if buf.write is not None else []) + buf.reads:
                if not stream.clock.covers(e.stream_id, e.seq):
                    what = "written" if e is buf.write else "read"
                    raise StreamOrderError(f"{buf.name} is overwritten or reused on stream '{stream.name}' while it "
                                           f"may still be {what} on stream '{e.stream_name}'")

    def note(self, event: Point, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
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
