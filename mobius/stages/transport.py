"""How workers hand each other host tensors: point-to-point messages keyed by a tag, and the one
collective the pipeline needs (fp16's overflow vote).

* :class:`GlooTransport`: between worker processes, over ``torch.distributed`` (gloo).  Our target
  GPUs have no peer-to-peer path, so device -> host -> host -> device is the real route and gloo
  moves the host leg.
* :class:`LocalGroup`: between threads of one process: the dispatched schedule's devices
  (:mod:`mobius.stages.dispatch`), and in unit tests each bound worker's
  :class:`~mobius.stages.executor.StageRunner`, in milliseconds, without starting processes.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Protocol

import torch
import torch.distributed as dist

RECV_TIMEOUT_S = 60  # as the process group's collective timeout: a lost message fails, never hangs


class Work(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    rank: int

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Work:
        """Start sending ``buf``; it must not change until the returned work is waited for."""

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        """Receive into ``buf`` (blocking)."""

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any of them."""

    def sum_all(self, value: float) -> float:
        """The sum of every rank's ``value`` (float64), on every rank."""


class GlooTransport:
    """The workers of one pipeline replica: ``first`` is the process rank of its worker 0
    (:mod:`mobius.stages.replicas`); ``rank`` is this worker's place in the replica."""

    def __init__(self, first: int = 0):
        self.first = first
        self.rank = dist.get_rank() - first

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Work:
        return dist.isend(buf, self.first + dst, tag=tag)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        dist.recv(buf, self.first + src, tag=tag)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum_all(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()


class _Sent:
    def wait(self) -> None:  # the message was copied when sent
        return None

    def is_completed(self) -> bool:
        return True


class LocalGroup:
    """``n`` ranks in one process; :meth:`endpoint` gives rank ``r`` its transport."""

    def __init__(self, n: int, timeout_s: float = RECV_TIMEOUT_S):
        self.n, self.timeout_s = n, timeout_s  # a message not there by then fails its receiver
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self._barrier = threading.Barrier(n, timeout=RECV_TIMEOUT_S)
        self._votes: list[tuple[int, object]] = []

    def _queue(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._queues[(src, dst, tag)]

    def endpoint(self, rank: int) -> "LocalTransport":
        return LocalTransport(self, rank)


class LocalTransport:
    def __init__(self, group: LocalGroup, rank: int):
        self.group, self.rank = group, rank

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Work:
        self.group._queue(self.rank, dst, tag).put(buf.clone())
        return _Sent()

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> None:
        try:
            buf.copy_(self.group._queue(src, self.rank, tag).get(timeout=self.group.timeout_s))
        except queue.Empty:
            raise RuntimeError(f"rank {self.rank}: no message from rank {src} (tag {tag}) "
                               f"within {self.group.timeout_s:.0f} s") from None

    def any_rank(self, flag: bool) -> bool:
        return any(self._all(flag))

    def sum_all(self, value: float) -> float:
        return sum(self._all(value))  # in rank order, as on every rank

    def _all(self, value) -> list:
        """Every rank's ``value``, in rank order."""
        g = self.group
        with g._lock:
            g._votes.append((self.rank, value))
        g._barrier.wait()  # every vote is in
        result = [v for _, v in sorted(g._votes, key=lambda rv: rv[0])]
        if g._barrier.wait() == 0:  # every rank has read it: one of them clears it
            g._votes.clear()
        g._barrier.wait()
        return result


def on_threads(fn, ranks) -> None:
    """``fn(rank)`` for every rank at once, one thread each (the ends of a transport wait for each
    other); the first error of any of them is raised here, on the caller's thread."""
    errors: list[BaseException] = []

    def run(rank) -> None:
        try:
            fn(rank)
        except BaseException as err:  # re-raised on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
