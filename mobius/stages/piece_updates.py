"""What the dispatched schedule's threads share on the host (:mod:`mobius.stages.dispatch`): the
board they wait on (each piece's updates done, the steps' losses, the first error), and each
piece's AdamW, once a step, on host threads.

A piece's update waits for every part of its step's gradients (the head's task split over several
devices: one part each, summed in part order into the fp32 master, whatever order they arrived
in), steps AdamW (after the step's global norm, where it clips), and writes the compute copy that
step ``1 + lag`` later reads; then its version says so, and the loads that read it go on.  A piece's
next gradients wait for that update before landing in its staging buffer, so its updates stay in
step order on any of the threads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from mobius.metrics import Trace
from mobius.runtime.device import Device, Event
from mobius.runtime.optim import clip_coefficient, set_lr, squares
from mobius.swap.store import HostStageStore


class Board:
    """What the threads wait on: each piece's updates done, the steps' losses; and the first error,
    which ends every wait."""

    def __init__(self, n_pieces: int, wait_s: float):
        self.cond, self.wait_s = threading.Condition(), wait_s
        self.versions = [0] * n_pieces  # updates of each piece done (steps 0 .. v-1)
        self.losses: dict[tuple[int, bool], dict[int, float]] = {}  # (step, training) -> micro-batch -> loss
        self.error: BaseException | None = None

    def wait_until(self, ready, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.error is not None or ready(), timeout=self.wait_s):
                raise RuntimeError(f"waited {self.wait_s:.0f} s for {what}")
            if self.error is not None:
                raise RuntimeError(f"another device failed: {self.error}") from self.error

    def fail(self, err: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = err
            self.cond.notify_all()


class PieceUpdates:
    """AdamW of each piece on the host, once per step, on a thread per device: in step order per
    piece (the producer of a piece's gradients waits for the update before,
    :meth:`wait_staging`), the head's parts summed in part order."""

    def __init__(self, store: HostStageStore, board: Board, parts: dict[int, int], device: Device, trace: Trace,
                 threads: int = 1):
        """``parts``: piece -> how many tasks' gradients its update sums (the head's parts)."""
        self.store, self.board, self.trace = store, board, trace
        self.lag, self.rule = store.lag, store.rule
        self.parts = parts
        self.trained = [p for p, host in store.stages.items() if host.trains]
        # Part 0 lands in the store's staging (fp32: the master gradient itself), the others beside it.
        self.staging: dict[int, list[torch.Tensor]] = {}
        for p in self.trained:
            first = store.stages[p].grad_staging
            self.staging[p] = [first, *(device.host_buffer(first.numel(), first.dtype)
                                        for _ in range(parts.get(p, 1) - 1))]
        self._arrived: dict[tuple[int, int], list] = {}  # (piece, step) -> [(part, event, copied)]
        self._summed: dict[int, list[int]] = {}  # step -> pieces whose gradients are in their masters
        self._lr: dict[int, float] = {}
        self._lock = threading.Lock()
        # A thread per device, as the plan's host lanes: a piece's updates stay in step order because
        # its next gradients wait for the update before (wait_staging).
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mobius-optimizer")
        self._jobs: list = []
        self.grad_norm: dict[int, float] = {}  # step -> the global norm it was clipped by

    def wait_weights(self, piece: int, step: int) -> None:
        """Block until the weights step ``step`` reads of ``piece`` are in its compute copy."""
        need = step - self.lag
        self.board.wait_until(lambda: self.board.versions[piece] >= need,
                              f"the weights of piece {piece} that step {step} reads")

    def wait_staging(self, piece: int, step: int) -> None:
        """Block until step ``step``'s gradients of ``piece`` may land in its staging: the update of
        the step before has read it (and stepped the master that update follows)."""
        self.board.wait_until(lambda: self.board.versions[piece] >= step,
                              f"the update of piece {piece} step {step - 1}")

    def home(self, piece: int, part: int, step: int, lr: float, arrived: Event, copied, device: Device) -> None:
        """Part ``part`` of step ``step``'s gradients of ``piece`` leave ``device`` (``arrived``:
        the event after their copy, whereupon ``copied()`` frees the device's buffer); the update
        follows once every part is home."""
        with self._lock:
            got = self._arrived.setdefault((piece, step), [])
            got.append((part, arrived, copied))
            self._lr[step] = lr
            complete = len(got) == self.parts.get(piece, 1)
        if complete:
            self._submit(self._sum, piece, step, device)

    def _submit(self, fn, *args) -> None:
        def run():
            try:
                fn(*args)
            except BaseException as err:  # every waiting thread hears of it
                self.board.fail(err)
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(self._pool.submit(run))

    def _sum(self, piece: int, step: int, device: Device) -> None:
        """On the optimizer thread: the parts' gradients into the fp32 master gradient."""
        host = self.store.stages[piece]
        with self._lock:
            parts = sorted(self._arrived.pop((piece, step)), key=lambda pe: pe[0])
        for _, event, copied in parts:
            event.synchronize()
            copied()
        for k, (part, _, _) in enumerate(parts):
            src = self.staging[piece][part]
            if k == 0:
                if src.data_ptr() != host.master_grad.data_ptr():
                    host.master_grad.copy_(src)
            else:
                host.master_grad.add_(src)
        host.attach_master_grads()
        if not self.rule.max_grad_norm:
            self._update(piece, step, 1.0, device)
            return
        with self._lock:
            done = self._summed.setdefault(step, [])
            done.append(piece)
            last = len(done) == len(self.trained)
            if last:
                del self._summed[step]
        if last:  # the step's global norm, then every piece's update
            total = squares(p.grad for q in sorted(done) for p in self.store.stages[q].master_params)
            self.grad_norm[step] = total ** 0.5
            clip = clip_coefficient(total, self.rule.max_grad_norm)
            for q in sorted(done):
                self._update(q, step, clip, device)

    def _update(self, piece: int, step: int, clip: float, device: Device) -> None:
        host = self.store.stages[piece]
        t0 = time.perf_counter()
        if host.optimizer is not None:
            set_lr(host.optimizer, self._lr[step])
            if clip < 1.0:
                for p in host.master_params:
                    p.grad.mul_(clip)
            with device.host_update_span(sum(p.numel() for p in host.master_params)):
                host.optimizer.step()
            host.optimizer.zero_grad(set_to_none=True)
        self.store.refresh_compute_copy(piece, self.store.buffer_updated_by(step))
        self.trace.span(f"AdamW piece {piece}", "optimizer", t0, time.perf_counter(), step=step)
        with self.board.cond:
            self.board.versions[piece] = step + 1
            self.board.cond.notify_all()

    def skip_untrained(self, step: int) -> None:
        """Pieces that train nothing are current for every step."""
        with self.board.cond:
            for p, host in self.store.stages.items():
                if not host.trains:
                    self.board.versions[p] = step + 1
            self.board.cond.notify_all()

    def drain(self) -> None:
        """Every update submitted so far is done."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
