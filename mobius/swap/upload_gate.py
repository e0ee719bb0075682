"""Activations before weights on one device's link (RoundPipe's rule, the dispatched schedule's).

A pass's inputs are what its compute waits for now; the weights streaming in beside them are for
the tasks after it.  The copies of one GPU have no priorities (its link and copy engines serve
them as they come, and CUDA's stream priorities order kernels, not copies), so the order is kept
by whoever issues the weights: the prefetcher issues them in pieces, at most :data:`AHEAD` of them
unfinished, and no new piece while an input upload is under way on the device.  An upload then
shares the link with those few pieces at most, instead of with a whole stage's weights.

A piece is a quarter of the last input uploaded (an upload shares the link with at most half its
own bytes), but never smaller than the device's floor: below a megabyte a GPU's link would copy a
piece faster than the prefetcher's thread issues the next one (two are in flight so that the
next is issued while one copies).  CPU workers, whose emulated GPUs run dilated, have a floor of
their own.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from mobius.runtime.device import COPY_CHUNK_BYTES, Device, Event, Stream

AHEAD = 2  # pieces of weights issued and unfinished at most
MIN_PIECE_BYTES = {"cuda": 2**20, "cpu": 64 * 2**10}  # by device kind


class UploadGate:
    """One device's input uploads, as the prefetcher of its weights sees them."""

    def __init__(self, device: Device):
        self.min_piece_bytes = MIN_PIECE_BYTES[device.kind]
        self._cond = threading.Condition()
        self._open: list[list] = []  # per upload: [its start on its stream, its end (None: not yet issued)]
        self._last_bytes = 0  # the last upload's

    @contextmanager
    def upload(self, stream: Stream, nbytes: int):
        """The body issues an input upload of ``nbytes`` on ``stream``: from the moment the stream
        reaches it until it is done, no new piece of weights is issued on this device."""
        window: list[Event | None] = [stream.record(), None]
        with self._cond:
            self._open.append(window)
            self._last_bytes = nbytes
        try:
            yield
        finally:
            ended = stream.record()
            with self._cond:
                window[1] = ended
                self._cond.notify_all()

    def piece_bytes(self) -> int:
        """How much of the weights to issue at once (a whole chunk until an upload is seen)."""
        if not self._last_bytes:
            return COPY_CHUNK_BYTES
        return min(COPY_CHUNK_BYTES, max(self.min_piece_bytes, self._last_bytes // 4))

    def wait_clear(self) -> None:
        """Return once no upload is under way: none has begun on its stream and not ended.  One
        not begun yet (its stream still computes what came before it) holds nothing back."""
        while True:
            with self._cond:
                self._open = [w for w in self._open if w[1] is None or not w[1].query()]
                running = next((w for w in self._open if w[0].query()), None)
                if running is None:
                    return
                if running[1] is None:  # on a CPU device the body runs the copy: until it returns
                    self._cond.wait()
                    continue
            running[1].synchronize()
