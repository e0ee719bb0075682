"""What the dispatched schedule's threads share on the host (:mod:`mobius.stages.dispatch`): the
board they wait on (each piece's updates done, the steps' losses, the first error), and each
piece's AdamW, once a step, on host threads.

A piece's update waits for every part of its step's gradients (the head's task split over several
devices: one part each, summed in part order into the fp32 master, whatever order they arrived
in), steps AdamW (after the step's global norm, where it clips; a piece of several parts in as
many slices of its parameters, side by side on the pool, the last to finish going on), and writes
the compute copy that step ``1 + lag`` later reads; then its version says so, and the loads that
read it go on.  A piece's next gradients wait for that update before landing in its staging
buffer, so its updates stay in step order on any of the threads.

Without a lag or replicas the updates that clipping's norm or fp16's vote hold back need not wait
for them: a piece's update runs as its gradients are summed (unscaled, its sum of squares taken
first; none where a gradient is not finite) and writes its compute copy; the loads wait for the
step's decision, which keeps the updates, takes them back (a step the vote skips:
:func:`~mobius.runtime.optim.undo_adamw_step`), or takes them back and redoes them with the
gradients clipped.  The first step, and a step after one that clipped or overflowed, wait for the
decision instead (as the bound schedule's :class:`~mobius.stages.host_optimizer.HostOptimizer`).

In fp16 the pieces wait for the step's last gradients too: the step's overflow vote (a non-finite
gradient anywhere, on any replica) decides whether every piece steps, with its gradients unscaled,
or none does; the loss scale the vote leaves is the one the next step's head scales its loss by
(:meth:`PieceUpdates.scale_of`), as the reference trainer's :class:`DynamicLossScaler` keeps it.

With data-parallel replicas (:mod:`mobius.stages.replicas`: a process per box, each on its share of
the step's micro-batches) a piece's summed gradients are summed over the replicas into their
owners, each owner steps AdamW on its parameters, and the owners' weights are broadcast back
before the compute copy is written.  A group's collectives must come in the same order on every
replica, whatever order the gradients came home in: one thread issues the sums, another the
broadcasts, each taking the pieces step by step, within a step from the last piece to the first
(:class:`InOrder`); the AdamW between them runs on the pool.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mobius.metrics import Trace
from mobius.models import tied_parameter_names
from mobius.runtime.device import Device, Event
from mobius.runtime.optim import (
    DynamicLossScaler, host_update, host_update_path, not_finite, set_lr, squares, update_slices)
from mobius.stages.replicas import ReplicaGroup
from mobius.stages.step_decision import StepDecisions
from mobius.stages.tied import sum_copies
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


def _tied_table(store: HostStageStore) -> list[tuple[int, torch.nn.Parameter]]:
    """(piece, master parameter) of a token table's copy in the embedding and in the head, where
    the model ties them and the table trains (LoRA freezes it); else none."""
    aliases = tied_parameter_names(store.config)
    if not aliases:
        return []
    (alias, canonical), = aliases.items()
    first, last = min(store.stages), max(store.stages)
    embedding = dict(store.stages[first].trained()).get(canonical)
    return [(first, embedding), (last, dict(store.stages[last].trained())[alias])] if embedding is not None else []


def _with_shares(slices: list[list[torch.nn.Parameter]]) -> list[tuple[list[torch.nn.Parameter], float]]:
    """Each slice of an update with its share of the update's elements (what an emulated host
    times it by)."""
    total = sum(p.numel() for run in slices for p in run)
    return [(run, sum(p.numel() for p in run) / total) for run in slices]


class InOrder:
    """(piece, step) pairs handed over in any order, taken in one order: step by step from the
    first, within a step ``order``'s pieces in turn.  Waits on the board, so an error anywhere
    ends the wait."""

    def __init__(self, board: Board, order: list[int]):
        self.board, self.order = board, order
        self._got: set[tuple[int, int]] = set()
        self._next = (0, 0)  # (step, index into order)
        self._closed = False

    def put(self, piece: int, step: int) -> None:
        with self.board.cond:
            self._got.add((piece, step))
            self.board.cond.notify_all()

    def start_at(self, step: int) -> None:
        with self.board.cond:
            self._next = (step, 0)

    def take(self) -> tuple[int, int] | None:
        """The next pair, once it is here (None: closed)."""
        with self.board.cond:
            step, k = self._next
            want = (self.order[k], step)
            self.board.cond.wait_for(lambda: want in self._got or self._closed or self.board.error is not None)
            if want not in self._got:
                return None
            self._got.remove(want)
            self._next = (step, k + 1) if k + 1 < len(self.order) else (step + 1, 0)
            return want

    def close(self) -> None:
        with self.board.cond:
            self._closed = True
            self.board.cond.notify_all()


@dataclass(frozen=True)
class Decided:
    """What a step's decision leaves for its metrics."""

    grad_norm: float | None  # the global norm before clipping (where it clips)
    loss_scale: float
    skipped_steps: int


class PieceUpdates:
    """AdamW of each piece on the host, once per step, on a thread per device: in step order per
    piece (the producer of a piece's gradients waits for the update before,
    :meth:`wait_staging`), the head's parts summed in part order; with ``replicas``, between the
    sum over the replicas and the broadcast back."""

    def __init__(self, store: HostStageStore, board: Board, parts: dict[int, int], device: Device, trace: Trace,
                 threads: int = 1, replicas: ReplicaGroup | None = None, resident: set[int] = frozenset(),
                 scaler: DynamicLossScaler | None = None):
        """``parts``: piece -> how many tasks' gradients its update sums (the head's parts);
        ``resident``: pieces updated on their devices (:meth:`resident_done`), whose gradients
        count in the step's norm; ``scaler``: fp16's loss scale, which the steps' votes update."""
        self.store, self.board, self.trace, self.device = store, board, trace, device
        self._tied_copies = _tied_table(store)  # [(piece, parameter)]: the embedding's copy, the head's
        self.tied = {p for p, _ in self._tied_copies}
        if self.tied & set(resident):
            raise ValueError(f"pieces {sorted(self.tied & set(resident))} hold a tied token table: their update "
                             "sums both copies' gradients on the host, so they cannot be resident")
        self.scaler = scaler or DynamicLossScaler(enabled=False)
        if self.scaler.enabled and resident:
            raise ValueError("resident stages update on their devices, but fp16's overflow vote needs every "
                             "gradient on the host")
        self._scales: dict[int, float] = {}  # step -> the loss scale its head scales by (fp16)
        self._whole_step = bool(store.rule.max_grad_norm) or self.scaler.enabled  # every piece waits for the last
        self.lag, self.rule = store.lag, store.rule
        self.parts = parts
        self.trained = [p for p, host in store.stages.items() if host.trains and p not in resident]
        self.resident = [p for p in resident if store.stages[p].trains]
        self._resident_squares: dict[int, float] = {}  # step -> its resident pieces' sum of squares
        self.clips: dict[int, float] = {}  # step -> the coefficient its gradients are clipped by
        # Part 0 lands in the store's staging (fp32: the master gradient itself), the others beside it.
        self.staging: dict[int, list[torch.Tensor]] = {}
        for p in self.trained:
            first = store.stages[p].grad_staging
            self.staging[p] = [first, *(device.host_buffer(first.numel(), first.dtype)
                                        for _ in range(parts.get(p, 1) - 1))]
        self._arrived: dict[tuple[int, int], list] = {}  # (piece, step) -> [(part, event, copied)]
        self._waiting: dict[int, list[int]] = {}  # step -> pieces summed, their updates held (_held)
        self._lr: dict[int, float] = {}
        self._lock = threading.Lock()
        # A thread per device, as the plan's host lanes: a piece's updates stay in step order because
        # its next gradients wait for the update before (wait_staging).
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mobius-optimizer")
        # The head's update (its parts' sum and AdamW) split over as many of the pool's threads as
        # the devices its parts came from, as the plan splits it over their host lanes.
        # piece -> [(a slice's parameters, its share of the piece's elements)]
        self._slices = {p: _with_shares(update_slices(store.stages[p].optimizer, parts[p])) for p in self.trained
                        if parts.get(p, 1) > 1 and store.stages[p].optimizer is not None}
        self._jobs: list = []
        # step -> its decision as the step's metrics report it, and when its last update was in
        self._decided: dict[int, Decided] = {}
        self._finished: dict[int, float] = {}
        self.decisions = StepDecisions(self.rule, self.lag, self.scaler, replicas is not None)
        self.path = host_update_path(self.rule.max_grad_norm, self.lag, self.scaler.enabled, replicas is not None)
        # piece -> its parts' 16-bit gradients, held for the step's decision, which its update's pass
        # converts (the piece's next gradients wait for that update: wait_staging)
        self._staged: dict[int, tuple[torch.Tensor, ...]] = {}
        self._last_step = -1  # the latest step whose gradients came home
        self.replicas = replicas
        self._threads: list[threading.Thread] = []
        if replicas is not None:
            # Every replica takes the pieces in this order: from the last, as the backward frees them.
            self.summed, self.stepped = (InOrder(board, sorted(self.trained, reverse=True)) for _ in range(2))
            self._threads = [threading.Thread(target=self._run, args=(loop,), name=f"mobius-{what}", daemon=True)
                             for loop, what in ((self._sums, "sums"), (self._broadcasts, "broadcasts"))]
            for t in self._threads:
                t.start()

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
            self._last_step = max(self._last_step, step)
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
        """On the optimizer thread: the parts' gradients into the fp32 master gradient, or left
        for the update's pass to sum (:meth:`_converts_in_pass`)."""
        host = self.store.stages[piece]
        with self._lock:
            parts = sorted(self._arrived.pop((piece, step)), key=lambda pe: pe[0])
        for _, event, copied in parts:
            event.synchronize()
            copied()
        if self._converts_in_pass(piece):
            staging = tuple(self.staging[piece][part] for part, _, _ in parts)
            held = self._held(step, piece)
            if held is None:
                self._adamw(piece, step, 1.0, device, staging=staging)
                return
            with self._lock:
                self._staged[piece] = staging
            self._update_released(step, held, device)
            return
        for k, (part, _, _) in enumerate(parts):
            src = self.staging[piece][part]
            if k == 0:
                if src.data_ptr() != host.master_grad.data_ptr():
                    host.master_grad.copy_(src)
            else:
                host.master_grad.add_(src)
        host.attach_master_grads()
        if self.replicas is not None:
            self.summed.put(piece, step)  # the sums' thread takes it from here
            return

        def summed() -> None:  # after its update before the step's decision, if it makes one (every slice)
            held = self._held(step, piece)
            if held is None:
                self._adamw(piece, step, 1.0, device)
                return
            self._update_released(step, held, device)

        if self.decisions.speculating and piece not in self.tied:
            self._adamw(piece, step, 1.0, device, speculative=True, then=summed)
            return
        summed()

    def _update_released(self, step: int, held: list[int], device: Device) -> None:
        """The updates of the pieces ``held`` for each other (none until the last is here), each
        on a thread of its own, as the plan's host lanes share them: run here, one after the
        other, a step whose updates wait for its norm took all of them on this one thread."""
        for q, clip in self._released(step, held, self._squares) if held else ():
            with self._lock:
                staging = self._staged.pop(q, ())
            self._submit(self._adamw, q, step, clip, device, False, staging)

    def _converts_in_pass(self, piece: int) -> bool:
        """Whether ``piece``'s update sums its parts' 16-bit gradients into fp32 in its own pass:
        where the run's path does (:func:`~mobius.runtime.optim.host_update_path`: no update made
        before its step's decision, no replicas), but not a tied table's, and where the step's norm
        or vote reads the gradients first, only one of a single part (the sum of several is the
        master's)."""
        host = self.store.stages[piece]
        return (self.path.converts and piece not in self.tied
                and (not self._whole_step or self.parts.get(piece, 1) == 1)
                and host.grad_staging.data_ptr() != host.master_grad.data_ptr())

    def _update_work(self, piece: int, host) -> float:
        """The parameters an emulated host's update of ``piece`` takes the time of: its own, and
        for the head's parts the more its update moves (as the plan charges it)."""
        params = sum(p.numel() for g in host.optimizer.param_groups for p in g["params"])
        parts, elt = self.parts.get(piece, 1), host.grad_staging.element_size()  # the gradients as they come home
        return params * self.path.split_bytes_per_param(elt, parts) / self.path.bytes_per_param(elt)

    def _held(self, step: int, piece: int) -> list[int] | None:
        """None where ``piece``'s update may run now; else the pieces it waited with, once the last
        of them is here (an empty list until then): every piece where the step's global norm clips
        them or fp16's vote decides, the two copies of a tied token table each other (they are
        updated with their sum)."""
        if not self._whole_step and piece not in self.tied:
            return None
        with self._lock:
            done = self._waiting.setdefault(step, [])
            done.append(piece)
            everything = len(self.trained) + len(self.resident)
            if len(done) < (everything if self._whole_step else len(self.tied)):
                return []
            return self._waiting.pop(step)

    def _released(self, step: int, pieces: list[int], squares_of, any_of=bool) -> list[tuple[int, float | None]]:
        """The pieces held for each other, their tied table's gradients summed, each with the
        coefficient its gradients are multiplied by: the clip (from ``squares_of(pieces)``, the sum
        of squares of their gradients, where the step clips) over fp16's loss scale (a piece
        updated before the step's decision has its gradients unscaled already); None where the
        step's vote (``any_of``: over the replicas) found an overflow and it is skipped."""
        if self.tied and self.tied <= set(pieces):
            sum_copies(*(param for _, param in self._tied_copies))  # (embedding, head)
        scale = self.scale_of(step)
        first = {q for q in pieces if self.decisions.updated_first(q)}
        overflow = self.scaler.enabled and any_of(self._overflowed(pieces))
        waited = [q for q in pieces if q not in self.resident and q not in first]
        clip, norm = self.decisions.decide(
            step, overflow, lambda: squares_of(waited) / scale ** 2 + self._resident_squares.pop(step, 0.0))
        if self.scaler.enabled:
            with self.board.cond:
                self._scales[step + 1] = self.scaler.scale
                self._scales.pop(step - 1, None)
                self.board.cond.notify_all()
        with self.board.cond:
            self._decided[step] = Decided(norm, self.scaler.scale, self.scaler.skipped_steps)
            if norm is not None:  # the resident pieces' devices wait for it (each has applied the one before)
                self.clips = {step: clip, **{k: v for k, v in self.clips.items() if k == step - 1}}
                self.board.cond.notify_all()
        if overflow:
            return [(q, None) for q in sorted(pieces)]
        return [(q, clip if q in first else clip / scale) for q in sorted(pieces) if q not in self.resident]

    def start_scaling(self, step: int) -> None:
        """The run's first step (or the first after a resume) is ``step``: its head scales by the
        scaler's scale as it is now (restored from a checkpoint, or the initial one)."""
        with self.board.cond:
            self._scales = {step: self.scaler.scale}
            self.board.cond.notify_all()

    def scale_of(self, step: int) -> float:
        """The loss scale step ``step``'s head multiplies its loss by: in fp16, the scale the vote
        of the step before left (waiting for it); else 1."""
        if not self.scaler.enabled:
            return 1.0
        self.board.wait_until(lambda: step in self._scales, f"the loss scale of step {step}")
        with self.board.cond:
            return self._scales[step]

    def resident_done(self, piece: int, step: int, squares_sum: float) -> None:
        """Step ``step``'s gradients of resident ``piece`` are in (their sum of squares
        ``squares_sum``): its device holds its update for the step's norm (:meth:`clip_of`)."""
        with self._lock:
            self._resident_squares[step] = self._resident_squares.get(step, 0.0) + squares_sum
        self._update_released(step, self._held(step, piece), self.device)

    def clip_of(self, step: int) -> float:
        """The coefficient step ``step``'s gradients are clipped by, once its norm is known."""
        self.board.wait_until(lambda: step in self.clips, f"the gradient norm of step {step}")
        with self.board.cond:
            return self.clips[step]

    def _overflowed(self, pieces: list[int]) -> bool:
        """Whether a gradient this host updates in ``pieces`` (with replicas: of those it owns,
        which its sum holds whole) is not finite."""
        return not_finite(g for q in sorted(pieces) for g in self._gradients(q))

    def _gradients(self, piece: int, leave_out: torch.nn.Parameter | None = None) -> list[torch.Tensor | None]:
        """The gradients this host updates in ``piece`` but ``leave_out``: as they came home where
        its update's pass converts them, else the master's."""
        return self.store.stages[piece].updated_gradients(piece in self._staged, leave_out)

    def _squares(self, pieces: list[int]) -> float:
        """The sum of squares of the gradients of the parameters this host updates in ``pieces``
        (with replicas: those it owns, which its sum holds whole), a tied table counted once."""
        duplicate = self._tied_copies[1][1] if self._tied_copies else None
        return squares(g for q in sorted(pieces) for g in self._gradients(q, duplicate))

    def _run(self, loop) -> None:
        try:
            loop()
        except BaseException as err:  # every waiting thread hears of it
            self.board.fail(err)

    def _sums(self) -> None:
        """The sums' thread: each piece's gradients summed over the replicas into their owners, in
        every replica's order; then its AdamW (after the step's norm, where it clips)."""
        device = self.replicas.device
        while (item := self.summed.take()) is not None:
            piece, step = item
            self.replicas.reduce_gradients(self.store.stages[piece])
            held = self._held(step, piece)
            if held is None:
                self._submit(self._adamw, piece, step, 1.0, device)
                continue
            released = self._released(step, held, lambda ps: self.replicas.sum(self._squares(ps)),
                                      lambda local: self.replicas.sum(float(local)) > 0) if held else ()
            for q, clip in released:
                self._submit(self._adamw, q, step, clip, device)

    def _broadcasts(self) -> None:
        """The broadcasts' thread: each piece's weights from their owners, in every replica's order;
        then its compute copy."""
        while (item := self.stepped.take()) is not None:
            piece, step = item
            self.replicas.broadcast_weights(self.store.stages[piece])
            self._publish(piece, step)

    def _adamw(self, piece: int, step: int, coefficient: float | None, device: Device,
               speculative: bool = False, staging: tuple[torch.Tensor, ...] = (), then=None) -> None:
        """AdamW of ``piece`` with step ``step``'s gradients times ``coefficient`` (the clip over
        fp16's loss scale; None: a step fp16's vote skips, the weights as they are).
        ``speculative``: before the step's vote and norm are known, the gradients unscaled and their
        squares taken first (no update where one is not finite), the gradients kept and the loads
        held back; a piece updated so comes back here with the step's decision: kept, taken back
        (None: a step the vote skips), or taken back and redone with its gradients clipped.
        ``staging``: its parts' 16-bit gradients, which the update sums into fp32 in its pass (else
        they are the master's already).  ``then``: called once the update is done (its last slice
        done, on that slice's thread), or found not to be made."""
        host = self.store.stages[piece]
        t0 = time.perf_counter()
        compute = host.compute_buffers[self.store.buffer_updated_by(step)]
        # the compute copy written in the update's pass, where it is not the master itself
        refreshed = (coefficient is not None and host.optimizer is not None and self.path.refreshes
                     and compute.data_ptr() != host.master.data_ptr())
        if host.optimizer is not None:
            set_lr(host.optimizer, self._lr[step])
            unscale = self.scale_of(step) if speculative and self.scaler.enabled else None
            if not self.decisions.goes_ahead(piece, host.optimizer, speculative, unscale, coefficient == 1.0, device):
                if not speculative:  # the update made first stands
                    self._publish(piece, step, refresh=False)
                elif then is not None:  # a gradient is not finite: no update
                    then()
                return
            if coefficient is not None:
                slices = self._slices.get(piece) or [(None, 1.0)]
                left = [len(slices)]

                def update(params: list | None, share: float) -> None:  # a slice (None: all of it)
                    begun = time.perf_counter()
                    with device.host_update_span(self._update_work(piece, host) * share):
                        host_update(host.optimizer, host.master, compute if refreshed else None, staging,
                                    clip=coefficient, params=params)
                    if params is not None:
                        self.trace.span(f"AdamW piece {piece} slice", "optimizer", begun, time.perf_counter(),
                                        step=step, thread=threading.current_thread().name, share=share)
                    with self._lock:
                        left[0] -= 1
                        if left[0]:
                            return  # the last slice to finish goes on
                    self._updated(piece, step, host, speculative, refreshed, t0, then)

                for params, share in slices[1:]:
                    self._submit(update, params, share)
                update(*slices[0])
                return
        self._updated(piece, step, host, speculative, refreshed, t0, then)

    def _updated(self, piece: int, step: int, host, speculative: bool, refreshed: bool, t0: float, then) -> None:
        """After ``piece``'s update of step ``step`` (every slice of it): its gradients let go,
        and its compute copy written and published (see :meth:`_adamw`); then ``then``."""
        if host.optimizer is not None and not speculative:
            host.optimizer.zero_grad(set_to_none=True)
        self.trace.span(f"AdamW piece {piece}", "optimizer", t0, time.perf_counter(), step=step,
                        thread=threading.current_thread().name)
        if speculative:  # the compute copy now, the loads once the norm keeps it
            if not refreshed:
                self.store.refresh_compute_copy(piece, self.store.buffer_updated_by(step))
        elif self.replicas is not None:
            self.stepped.put(piece, step)  # the broadcasts' thread takes it from here
        else:
            self._publish(piece, step, refresh=not refreshed)
        if then is not None:
            then()

    def _publish(self, piece: int, step: int, refresh: bool = True) -> None:
        """Piece ``piece``'s master after step ``step``'s update into the compute copy the step
        ``1 + lag`` later reads (unless it is there: ``refresh`` off); then the loads waiting for it
        go on."""
        if refresh:
            self.store.refresh_compute_copy(piece, self.store.buffer_updated_by(step))
        with self.board.cond:
            self.board.versions[piece] = step + 1
            if step not in self._finished and self._all_updated(step):
                self._finished[step] = time.perf_counter()
            self.board.cond.notify_all()

    def _all_updated(self, step: int) -> bool:
        return all(self.board.versions[p] > step for p in self.trained)

    def settled(self, step: int) -> tuple[float, Decided]:
        """Once every host update of step ``step`` is in: when the last one was
        (``time.perf_counter``), and the step's decision (the norm, and fp16's scale and skipped
        steps, as they stood after it).  A step's losses come home before its last backward stages
        run, so its metrics are completed here, later (:func:`mobius.runtime.loop.run_steps`)."""
        self.board.wait_until(lambda: self._all_updated(step), f"the updates of step {step}")
        with self.board.cond:
            finished = self._finished.pop(step, None)
            decided = self._decided.pop(step, None) or Decided(None, self.scaler.scale, self.scaler.skipped_steps)
        return (time.perf_counter() if finished is None else finished), decided

    def resume_at(self, step: int) -> None:
        """The next step's gradients are step ``step``'s."""
        if self.replicas is not None:
            self.summed.start_at(step)
            self.stepped.start_at(step)

    def skip_untrained(self, step: int) -> None:
        """Pieces that train nothing are current for every step."""
        with self.board.cond:
            for p, host in self.store.stages.items():
                if not host.trains:
                    self.board.versions[p] = step + 1
            self.board.cond.notify_all()

    def drain(self) -> None:
        """Every update of the gradients home so far is done."""
        last = self._last_step
        self.board.wait_until(lambda: all(self.board.versions[p] > last for p in self.trained),
                              f"the updates of step {last}")
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.result()

    def close(self) -> None:
        if self.replicas is not None:
            self.summed.close()
            self.stepped.close()
        for t in self._threads:
            t.join(timeout=self.board.wait_s)
        self._pool.shutdown(wait=True)
