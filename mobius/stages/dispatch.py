"""The dispatched schedule, run: the tasks of :func:`mobius.stages.tasks.step_tasks` on a pool of
devices, one host thread per device in one process (as torchgpipe drives its devices), the host's
weights shared by all of them.

* **The host keeps the weights piece by piece** (:func:`~mobius.stages.tasks.pieces`: the layers cut
  wherever the forward or the backward partition cuts them), in one
  :class:`~mobius.swap.store.HostStageStore` whose stages are the pieces.  A task loads its pieces
  on its device with that device's :class:`~mobius.swap.prefetch.Prefetcher`, the next tasks' while
  this one computes (:data:`LOOKAHEAD`, in task order); a load waits on the prefetcher's thread
  until the update its step reads is in
  (:meth:`~mobius.stages.piece_updates.PieceUpdates.wait_weights`), never on the device's.
* **Activations go to the device whose task needs them**, over the links of
  :mod:`~mobius.stages.links` (an in-process transport between the device threads): the hidden
  state at a layer boundary goes to the forward task that starts there and, from the same copy off
  the device, to the recomputing backward task that starts there; a gradient to the backward task
  that ends there.  Each is keyed by (what, step, boundary, micro-batch).  On each device's link a
  task's inputs go before the weights streaming in for the tasks after it
  (:mod:`~mobius.swap.upload_gate`).
* **One update per piece and step** (:class:`~mobius.stages.piece_updates.PieceUpdates`, on host
  threads): a backward's gradients of each piece go home into the piece's staging buffer (the
  head's parts into one each) and the piece's AdamW runs once all have arrived, summed in part
  order, then writes the compute copy the step ``1 + lag`` later reads.  Where the update needs the
  whole step (the global norm clipping scales it by), the pieces wait for the step's last
  gradients.
* **Steps overlap** where the lag allows: :meth:`DispatchedRunner.step` hands the step's tasks to
  the devices and returns once its loss is in; the backward's last tasks run on while the next
  step's first ones start.  Every dependency is a message or a version the task waits for, so no
  order of the threads changes a number: the reference trainer's losses and weights, as the bound
  pipeline's.

A kept stage's forward keeps its autograd graph, and its weights, on its device until its backward
runs there.  A resident one (the plan's choice, without the lag) runs on the same device every
step and stays there: its weights are loaded once, its gradients stay in a buffer of the device's,
and its AdamW runs there (:mod:`~mobius.stages.device_optimizer`), after the step's norm where it
clips, before the piece's next use; :meth:`DispatchedRunner.drain` copies it home.  Evaluation runs
the forward partition's tasks in turn, the head's loss on the last.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch import nn

from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.data import BatchSource
from mobius.metrics import Trace
from mobius.models import GPTConfig, TokenLayout, run_layers, tied_parameter_names
from mobius.models.router_balance import activation_shape, carries_tally
from mobius.models.precision import DTYPES
from mobius.models.lora import dropout_micro_batch
from mobius.runtime.device import Device
from mobius.runtime.optim import DynamicLossScaler, UpdateRule, squares
from mobius.stages.device_optimizer import DeviceOptimizer
from mobius.stages.links import ActivationLinks
from mobius.stages.piece_updates import Board, PieceUpdates
from mobius.stages.replicas import ReplicaGroup, ReplicaLayout
from mobius.stages.tasks import DispatchedShape, Task, pieces, step_tasks
from mobius.stages.transport import LocalGroup
from mobius.stages.working_memory import WorkingMemory
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import DeviceStage, Prefetcher
from mobius.swap.store import HostStageStore, view
from mobius.swap.upload_gate import UploadGate

# As a transport's receive: a dependency that never comes fails the run, never hangs it (an emulated
# run allows for its dilated steps: mobius.runtime.worker.collective_timeout_s).
WAIT_S = 60.0
# The kinds of message: the hidden state into a forward task, the input a backward task recomputes
# from, a gradient into a backward task.
ACT, SAVED, GRAD = 0, 1, 2
MAX_MICRO_BATCHES = 4096  # per step, in a message's tag
LOOKAHEAD = 2  # tasks beyond the running one whose pieces a device loads ahead


@dataclass(eq=False)  # one object per step: compared by identity
class _Step:
    """One step (or evaluation pass) as every device sees it."""

    step: int
    micro: list
    lr: float
    tasks: list[Task]
    training: bool = True
    first: int = 0  # its first micro-batch's number (tasks number them across steps)
    routes: "_Routes | None" = None  # where its messages go, made when it is handed out


@dataclass(eq=False)
class _Queued:
    """A task given to a device, and its pieces once requested."""

    st: _Step
    task: Task
    handles: list[DeviceStage] | None = None


class _Routes:
    """Which device runs each task of a step, by the layer boundaries its messages cross."""

    def __init__(self, shape: DispatchedShape, st: _Step):
        self.shape = shape
        self.forward_gpu: dict[int, int] = {}  # forward stage -> GPU (the head's: per micro-batch, below)
        self.head_gpu: dict[int, int] = {}  # micro-batch -> the GPU of its head part
        self.backward_gpu: dict[int, int] = {}
        for t in st.tasks:
            if t.kind == "F":
                self.forward_gpu[t.stage] = t.gpu
            elif t.kind == "H":
                self.head_gpu.update({m - st.first: t.gpu for m in t.micro_batches})
            else:
                self.backward_gpu[t.stage] = t.gpu
        fwd, bwd = shape.forward, shape.backward
        self.last_fwd = len(fwd) - 1
        self.fwd_start = {lo: j for j, (lo, _) in enumerate(fwd)}
        recomputing = range(len(bwd) - 1 - shape.kept) if st.training else range(0)
        self.recompute_start = {bwd[k][0]: k for k in recomputing if bwd[k][0] > 0}
        self.bwd_start = {lo: k for k, (lo, _) in enumerate(bwd)}
        self.bwd_end = {hi: k for k, (_, hi) in enumerate(bwd)}

    def forward_stage_gpu(self, j: int, m: int) -> int:
        return self.head_gpu[m] if j == self.last_fwd and self.head_gpu else self.forward_gpu[j]

    def producer(self, b: int, m: int) -> int:
        """The GPU that computes the hidden state at boundary ``b`` (the forward holding layer b-1)."""
        j = max(j for j, (lo, _) in enumerate(self.shape.forward) if lo < b)
        return self.forward_stage_gpu(j, m)

    def consumers(self, b: int, m: int) -> list[tuple[int, tuple]]:
        """Where the hidden state at boundary ``b`` goes: (GPU, message kind)."""
        out = []
        if b in self.fwd_start:
            out.append((self.forward_stage_gpu(self.fwd_start[b], m), ACT))
        if b in self.recompute_start:
            out.append((self.backward_gpu[self.recompute_start[b]], SAVED))
        return out

    def grad_source(self, b: int, m: int) -> int:
        """The GPU that computes the gradient at boundary ``b`` (the backward stage starting there)."""
        k = self.bwd_start[b]
        return self.head_gpu[m] if k == len(self.shape.backward) - 1 else self.backward_gpu[k]

    def grad_target(self, b: int) -> int:
        return self.backward_gpu[self.bwd_end[b]]


class _DeviceWorker:
    """One device's thread: it runs its tasks in the order they were issued, each one's pieces
    loaded ahead (:meth:`_load_ahead`), its micro-batches computed, its gradients sent home."""

    def __init__(self, runner: "DispatchedRunner", gpu: int, device: Device, budget_bytes: int):
        self.runner, self.gpu, self.device = runner, gpu, device
        r = runner
        self.memory = DeviceMemory(budget_bytes, f"GPU {gpu}")
        self.traffic = Traffic()
        self.trace = r.trace.of_pid(gpu)  # a row of lanes for each device
        gate = UploadGate(device)  # a task's inputs go up before the weights of the tasks after it
        self.prefetcher = Prefetcher(r.store, r.config, self.memory, device, self.traffic, self.trace, gate=gate)
        self.host = device.host_stream("host")
        self.compute = device.compute
        self.grads_out = device.new_stream("d2h-gradients", "d2h")
        self.links = ActivationLinks(r.group.endpoint(gpu), device, self.host, self.memory, self.traffic, self.trace,
                                     r.tag_of, gate)
        self.working = WorkingMemory(self.memory, None)
        self._seen: dict[str, int] = {}  # task name -> the most working memory it used: held from prefetches
        self.kept: dict[tuple, tuple] = {}  # (step, forward stage, micro-batch) -> (input, output, ledger, phase)
        self.kept_handles: dict[tuple[int, int], list[DeviceStage]] = {}  # (step, forward stage) -> its pieces
        # Pieces on (or on their way to) this device: piece -> [handle, its step, tasks using it].
        # A piece has one set of modules here, so a task of another step waits until it is released.
        self._live: dict[int, list] = {}
        # Resident pieces (the resident stages this device runs): loaded once, updated here.
        self.resident = {p for p, g in r.resident_gpu.items() if g == gpu}
        self.resident_handles: dict[int, DeviceStage] = {}
        self.optimizer = DeviceOptimizer(r.store, device, self.memory, self.trace, r.device_adam_params_per_s) \
            if self.resident else None
        self._held_step: int | None = None  # the step whose resident updates wait for its norm (clipping)
        self._queue: list[_Queued] = []  # this device's tasks not done, in order
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"mobius-gpu{gpu}", daemon=True)
        self._thread.start()

    # ---- the queue and the pieces' loads ----------------------------------------------------
    def give(self, st: _Step, task: Task) -> None:
        with self._cond:
            self._queue.append(_Queued(st, task))
            self._load_ahead()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._queue.append(None)
            self._cond.notify()
        self._thread.join(timeout=self.runner.board.wait_s)
        try:
            self.links.finish_sends()
        finally:
            self.links.close()
            self.prefetcher.close()
            self.device.close()

    def _load_ahead(self) -> None:
        """Request the pieces of the queued tasks, in order, up to :data:`LOOKAHEAD` tasks ahead of
        the running one: the prefetcher loads them one after the other as memory allows, each
        once the update its step reads is in.  A task whose piece another step's task still holds
        here stops the lookahead until that one is released (loads never overtake each other, so
        a load waits only for memory that earlier tasks free).  Under ``self._cond``."""
        r = self.runner
        for q in self._queue[:LOOKAHEAD + 1]:
            if q is None or q.handles is not None:
                continue
            if q.task.kind == "B" and not q.task.recomputes:  # its forward leaves them here
                key = (q.st.step, r.fwd_of_kept(q.task.stage))
                if key not in self.kept_handles:
                    return
                q.handles = self.kept_handles.pop(key)
                continue
            wanted = r.pieces_in(*self._layers_of(q.task))
            if any(p in self._live and self._live[p][1] is not q.st for p in wanted):
                return
            for p in wanted:
                if p in self.resident:  # loaded the first time, there for good
                    if p not in self.resident_handles:
                        self.resident_handles[p] = self._load(q.st, p)
                    continue
                if p not in self._live:
                    self._live[p] = [self._load(q.st, p), q.st, 0]
                self._live[p][2] += 1
            q.handles = [self.resident_handles[p] if p in self.resident else self._live[p][0] for p in wanted]

    def _load(self, st: _Step, p: int) -> DeviceStage:
        return self.prefetcher.request(p, priority=0, step=st.step,
                                       ready=lambda: self.runner.updates.wait_weights(p, st.step))

    def _done_with(self, handles: list[DeviceStage]) -> None:
        """The task that used ``handles`` is done: a piece no later task shares is evicted."""
        with self._cond:
            for h in handles:
                if h.index in self.resident:
                    continue
                entry = self._live[h.index]
                entry[2] -= 1
                if not entry[2]:
                    del self._live[h.index]
                    self.prefetcher.release(h)
            self._load_ahead()

    def _run(self) -> None:
        self.device.bind_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) and (self._queue[0] is None
                                                                   or self._queue[0].handles is not None))
                item = self._queue[0]
            if item is None:
                return
            try:
                self._task(item.st, item.task, item.handles)
            except BaseException as err:  # every waiting thread hears of it
                self.runner.board.fail(err)
                return
            with self._cond:
                self._queue.pop(0)
                self._load_ahead()
            self.runner.task_done(item.st)

    # ---- a task ------------------------------------------------------------------------------
    def _layers_of(self, t: Task) -> tuple[int, int]:
        shape = self.runner.shape
        return (shape.forward if t.kind in "FH" else shape.backward)[t.stage]

    def _task(self, st: _Step, t: Task, handles: list[DeviceStage]) -> None:
        self.working.idle()  # nothing computes while the pieces arrive
        if any(h.index in self.resident for h in handles):
            self.settle()
        layers = nn.ModuleList([layer for h in handles for layer in self.prefetcher.wait(h)])
        # The memory it works in beyond its weights, as planned, until its own peak is known: held
        # back from the loads ahead.
        shape = self.runner.shape
        planned = self._planned(t, shape.forward_bytes, shape.backward_bytes)
        self.memory.set_compute_reserve(max(planned, self._seen.get(t.name, 0)))
        begin = self.compute.record() if self.trace.enabled else None
        if t.kind == "B":
            self._backward(st, t, handles, layers)
        else:
            self._forward(st, t, handles, layers)
        self.links.flush()
        self.links.reap()
        self._seen[t.name] = max(self._seen.get(t.name, 0), self.memory.compute_peak_since_reserve)
        end = self.compute.record() if self.trace.enabled else None
        self.trace.device_span(t.name, "compute", begin, end, self.device.time_of, step=st.step)
        if t.kind == "F" and t.keeps and st.training:  # they stay for its backward, here
            self.kept_handles[(st.step, t.stage)] = handles
        else:
            self._done_with(handles)

    def _planned(self, t: Task, forward: list, backward: list):
        """A task's figure from the plan's per-stage ones (the head's task: its forward stage's and
        the last backward stage's together); 0 where the shape carries none (tests)."""
        if not forward:
            return 0
        if t.kind == "B":
            return backward[t.stage]
        return forward[t.stage] + (backward[-1] if t.kind == "H" else 0)

    def _layout(self, st: _Step, m: int, hi: int) -> TokenLayout | None:
        """What layers up to ``hi`` need of micro-batch ``m`` besides its input: the positions and
        mask of packed examples, and the targets where they reach the head."""
        layout = st.micro[m].layout
        if hi < self.runner.n_layers:
            layout = layout.for_blocks(padding=carries_tally(self.runner.config))
        return layout.to(self.device.torch_device) if layout is not None else None

    def _dropout(self, st: _Step, m: int):
        """LoRA dropout draws micro-batch ``m``'s masks: the same in forward and its recomputation."""
        if not st.training:
            return contextlib.nullcontext()
        r = self.runner
        return dropout_micro_batch(r.batches.seed, st.step, r.replica.index * r.M + m)

    def _input(self, st: _Step, kind: int, b: int, m: int, src: int, what: str) -> torch.Tensor:
        """The tensor at boundary ``b`` of micro-batch ``m``, on this device (at 0: the tokens)."""
        r = self.runner
        tokens = st.micro[m].tokens  # (a micro-batch is as wide as its longest sequence)
        host = tokens if b == 0 else \
            self.links.recv(src, (kind, st.step, st.training, b, m), activation_shape(r.config, tokens.shape, r.dtype),
                            r.dtype)
        return self.links.to_device(host, what)

    def _send_hidden(self, st: _Step, routes: _Routes, h: torch.Tensor, b: int, m: int) -> None:
        self.links.send_to(h, [(gpu, (kind, st.step, st.training, b, m)) for gpu, kind in routes.consumers(b, m)])

    def _forward(self, st: _Step, t: Task, handles, layers: nn.ModuleList) -> None:
        """Each micro-batch through the task's layers: its hidden state goes on at the stage's end,
        and at every boundary within where a recomputing backward stage starts; the head's task
        runs each micro-batch's backward of the last backward stage at once."""
        r = self.runner
        routes = st.routes
        lo, hi = self._layers_of(t)
        planned_s = self._planned(t, r.shape.forward_s, r.shape.backward_s)  # a micro-batch, emulated
        keeps = t.kind == "F" and t.keeps and st.training
        grads = self._attach_grads(t, handles) if t.kind == "H" else None
        b_lo = r.shape.backward[-1][0] if t.kind == "H" else hi  # the head's backward starts there
        for m in (mb - st.first for mb in t.micro_batches):
            x = self._input(st, ACT, lo, m, routes.producer(lo, m) if lo else -1, "stage input")
            x_phase = self.memory.phase
            layout = self._layout(st, m, hi)
            with self._dropout(st, m), self.device.compute_span(planned_s):
                if keeps:  # its backward runs here, from this graph
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    with self.working.saved_activations(layers) as ledger:
                        out = run_layers(layers, x, layout)
                    self.kept[(st.step, t.stage, m)] = (x, out, ledger, x_phase)
                    self._send_hidden(st, routes, out, hi, m)
                    continue
                h = x
                with torch.no_grad():
                    for k in range(lo, b_lo):
                        h = layers[k - lo](h, layout)
                        if k + 1 < hi and k + 1 in routes.recompute_start:
                            self._send_hidden(st, routes, h, k + 1, m)
                if t.kind == "H":
                    h = h.detach().requires_grad_(h.is_floating_point())
                    with self.working.saved_activations(layers) as ledger:
                        loss = run_layers(layers[b_lo - lo:], h, layout)
                    r.add_loss(st, m, loss.item())
                    if loss.requires_grad:  # the loss is already its share of the step's mean
                        (loss * r.updates.scale_of(st.step)).backward()
                    self.working.release(ledger)
                    if b_lo > 0:
                        self.links.send(h.grad, routes.grad_target(b_lo), (GRAD, st.step, True, b_lo, m))
                elif hi == r.n_layers:  # evaluation's last stage: its loss
                    r.add_loss(st, m, h.item())
                else:
                    self._send_hidden(st, routes, h, hi, m)
            self.working.free(x, x_phase)
            del x, h
        if grads is not None:
            self._gradients_home(st, t, grads)

    def _backward(self, st: _Step, t: Task, handles, layers: nn.ModuleList) -> None:
        """Each micro-batch's backward, from its recomputed forward or the graph its forward kept
        here; the input gradient goes to the backward task before."""
        r = self.runner
        routes = st.routes
        lo, hi = self._layers_of(t)
        planned_s = self._planned(t, r.shape.forward_s, r.shape.backward_s)  # a micro-batch, emulated
        grads = self._attach_grads(t, handles)
        for m in (mb - st.first for mb in t.micro_batches):
            if t.recomputes:
                x = self._input(st, SAVED, lo, m, routes.producer(lo, m) if lo else -1, "recompute input")
                x_phase = self.memory.phase
                if x.is_floating_point():
                    x.requires_grad_(True)
            else:
                x, out, ledger, x_phase = self.kept.pop((st.step, r.fwd_of_kept(t.stage), m))
            g = self._input(st, GRAD, hi, m, routes.grad_source(hi, m), "output gradient")
            with self.device.compute_span(planned_s):
                if t.recomputes:
                    with self.working.saved_activations(layers) as ledger, self._dropout(st, m):
                        out = run_layers(layers, x, self._layout(st, m, hi))
                if out.requires_grad:  # else nothing before it trains (a frozen embedding under LoRA)
                    out.backward(g)
            self.working.free(g)
            self.working.release(ledger)
            if lo > 0:
                self.links.send(x.grad, routes.grad_target(lo), (GRAD, st.step, True, lo, m))
            self.working.free(x, x_phase)
            del x, out, g
        self._gradients_home(st, t, grads)

    def settle(self) -> None:
        """The resident pieces' updates held for their step's norm, applied once it is known."""
        if self._held_step is not None:
            self.optimizer.apply(self.runner.updates.clip_of(self._held_step))
            self._held_step = None

    def _attach_grads(self, t: Task, handles) -> dict[int, tuple]:
        """A zeroed device gradient buffer for each trained piece the task's backward covers,
        which autograd accumulates into: piece -> (buffer, handle, memory phase)."""
        lo, hi = self.runner.shape.backward[-1] if t.kind == "H" else self._layers_of(t)
        covered = set(self.runner.pieces_in(lo, hi))
        grads = {}
        for h in handles:
            host = self.runner.store.stages[h.index]
            if not host.trains or h.index not in covered:
                continue
            if h.index in self.resident:  # its persistent buffer, which stays here
                grads[h.index] = (self.optimizer.gradients_for(h.index, h.layers), h, None)
                continue
            phase = self.memory.allocate(host.grad_bytes, f"gradients of piece {h.index}")
            buf = self.device.empty(host.grad_staging.numel(), host.grad_staging.dtype,
                                    name=f"gradients of piece {h.index}")
            buf.zero_()
            for p, slot in zip(h.layers.parameters(), host.grad_slots()):
                if slot is not None:
                    p.grad = view(buf, slot)
            grads[h.index] = (buf, h, phase)
        return grads

    def _gradients_home(self, st: _Step, t: Task, grads: dict[int, tuple]) -> None:
        """Each trained piece's gradients leave for its staging buffer on the host (the head's part
        ``p``: the piece's ``p``-th), on their own stream; the piece's update follows there."""
        r = self.runner
        part = int(t.name.split(".")[1]) if t.kind == "H" else 0
        for p, (buf, h, phase) in grads.items():
            host = r.store.stages[p]
            resident = p in self.resident
            for q, slot in zip(h.layers.parameters(), host.grad_slots()):
                if slot is not None:  # autograd may have replaced a gradient that was a view
                    mine = view(buf, slot)
                    if q.grad is not None and q.grad.data_ptr() != mine.data_ptr():
                        mine.copy_(q.grad)
                    if resident:  # the device's AdamW steps the device weights with these
                        q.grad = mine
                if not resident:
                    q.grad = None
            if resident:  # AdamW here, on the compute stream (after the step's norm, where it clips)
                self.optimizer.update(p, h.layers, h.weights, st.lr)
                if self.optimizer.held_back:
                    self._held_step = st.step
                    r.updates.resident_done(p, st.step, squares([buf]))
                continue
            r.updates.wait_staging(p, st.step)
            self.grads_out.wait(self.compute.record())
            self.grads_out.copy(r.updates.staging[p][part], buf, name=f"gradient staging of piece {p}")
            self.traffic.d2h += host.grad_bytes
            self.memory.will_free(host.grad_bytes)
            r.updates.home(p, part, st.step, st.lr, self.grads_out.record(),
                           lambda n=host.grad_bytes, phase=phase: self.memory.free(n, phase, announced=True),
                           self.device)


class DispatchedRunner:
    """The dispatched schedule over ``devices`` (GPU ``g`` of the shape's turn is ``devices[g]``,
    with ``budget_bytes[g]`` of memory), the host's pieces in ``store``; as one of ``replicas``
    (None: the only one), on its share of each step's micro-batches."""

    def __init__(self, shape: DispatchedShape, store: HostStageStore, devices: list[Device],
                 budget_bytes: list[int], batches: BatchSource, trace: Trace, wait_s: float = WAIT_S,
                 replicas: ReplicaGroup | None = None, device_adam_params_per_s: float = float("inf"),
                 scaler: DynamicLossScaler | None = None):
        self.shape, self.store, self.batches, self.trace = shape, store, batches, trace
        self.config = store.config
        self.pieces = pieces(shape.forward, shape.backward)
        self.n_layers = self.pieces[-1][1]
        if [(st.layer_ids[0], st.layer_ids[-1] + 1) for _, st in sorted(store.stages.items())] != self.pieces:
            raise ValueError(f"the host store's stages are not the pieces {self.pieces}")
        self.replica = replicas.layout if replicas is not None else ReplicaLayout()
        self.M = batches.micro_batches // self.replica.count  # this replica's share of a step
        self.dtype = store.compute_dtype
        self.board = Board(len(self.pieces), wait_s)
        head = self.pieces_in(*shape.backward[-1])
        self.device_adam_params_per_s = device_adam_params_per_s  # an emulated GPU's AdamW rate
        # Piece -> the GPU it stays on, for the resident stages' pieces.
        self.resident_gpu = {p: g for j, g in shape.resident for p in self.pieces_in(*shape.forward[j])}
        if self.resident_gpu and (store.lag or replicas is not None):
            raise ValueError("resident stages update on their devices at once, not with an optimizer lag or replicas")
        self.updates = PieceUpdates(store, self.board, {p: shape.head_gpus for p in head}, devices[0], trace,
                                    threads=len(devices), replicas=replicas, resident=set(self.resident_gpu),
                                    scaler=scaler)
        self._scaling = False  # the loss scale's first step is set (at the first step, or after a resume)
        self.group = LocalGroup(len(devices), wait_s)
        self._pending: dict[tuple[int, bool], int] = {}  # (step, training) -> its tasks not done
        self.workers = [_DeviceWorker(self, g, d, b) for g, (d, b) in enumerate(zip(devices, budget_bytes))]

    # ---- the shape's facts -------------------------------------------------------------------
    def pieces_in(self, lo: int, hi: int) -> list[int]:
        return [p for p, (a, b) in enumerate(self.pieces) if lo <= a and b <= hi]

    def fwd_of_kept(self, k: int) -> int:
        """The forward stage that is kept backward stage ``k``."""
        return self.shape.forward.index(self.shape.backward[k])

    def tag_of(self, key: tuple) -> int:
        """A message's number for the transport: unique among the steps that may be in flight."""
        kind, step, training, b, m = key
        return ((((step % 4) * 2 + int(training)) * 3 + kind) * (self.n_layers + 1) + b) * MAX_MICRO_BATCHES + m

    # ---- steps ----------------------------------------------------------------------------------
    def step(self, step: int) -> float:
        """Hand step ``step``'s tasks to the devices; return its loss once the head has it (the
        backward's last tasks may run on while the next step starts)."""
        if not self._scaling:  # fp16: the scale as the scaler has it now (a checkpoint's, restored)
            self.updates.start_scaling(step)
            self._scaling = True
        tasks = step_tasks(self.shape.forward, self.shape.backward, self.shape.kept, self.shape.head_gpus,
                           self.shape.order, self.M, steps=1, first_step=step, resident=self.shape.resident)
        self.micro = self.replica.share(self.batches.step(step))  # a preference run's head fills PairLayout.found
        return self._run(_Step(step, self.micro, self.store.rule.lr_at(step), tasks, first=step * self.M))

    def evaluate(self, micro: list, next_step: int) -> float:
        """The forward partition's tasks in turn on this replica's share of ``micro``, with the
        weights step ``next_step`` reads, no autograd and no dropout; returns the loss sum."""
        micro = self.replica.share(micro)
        order, n = self.shape.order, len(self.shape.order)
        every = tuple(range(len(micro)))
        pinned = dict(self.shape.resident)
        tasks = [Task(f"F{j}", "F", j, pinned.get(j, order[j % n]), every, next_step)
                 for j in range(len(self.shape.forward))]
        with torch.no_grad():
            loss = self._run(_Step(next_step, micro, 0.0, tasks, training=False))
        self.drain()
        return loss

    def _run(self, st: _Step) -> float:
        key = (st.step, st.training)
        self.updates.skip_untrained(st.step)
        with self.board.cond:
            self.board.losses[key] = {}
            self._pending[key] = len(st.tasks)
        st.routes = _Routes(self.shape, st)
        for t in st.tasks:
            self.workers[t.gpu].give(st, t)
        self.board.wait_until(lambda: len(self.board.losses[key]) == len(st.micro), f"the loss of step {st.step}")
        with self.board.cond:
            losses = self.board.losses.pop(key)
        return sum(losses[m] for m in sorted(losses))

    def add_loss(self, st: _Step, m: int, loss: float) -> None:
        with self.board.cond:
            self.board.losses[(st.step, st.training)][m] = loss
            self.board.cond.notify_all()

    def task_done(self, st: _Step) -> None:
        with self.board.cond:
            key = (st.step, st.training)
            self._pending[key] -= 1
            if not self._pending[key]:
                del self._pending[key]
            self.board.cond.notify_all()

    def resume_at(self, step: int) -> None:
        """The store holds the state after ``step`` steps (a checkpoint's): every update before is in."""
        with self.board.cond:
            self.board.versions = [step] * len(self.pieces)
        self.updates.resume_at(step)
        self._scaling = False

    def drain(self) -> None:
        """Every task handed out so far is done and every update is in the host store (the resident
        pieces' too, copied there from their devices)."""
        self.board.wait_until(lambda: not self._pending, "the devices' tasks")
        self.updates.drain()
        for w in self.workers:
            if w.optimizer is not None:
                w.settle()
                w.optimizer.sync_to_host()

    def close(self) -> None:
        errors = []
        for w in self.workers:
            try:
                w.stop()
            except BaseException as err:  # the others still stop
                errors.append(err)
        self.updates.close()
        if errors and self.board.error is None:
            raise errors[0]


def dispatched_refusal(cfg: RunConfig) -> str | None:
    """What of the run the dispatched schedule does not run yet, in a few words (None: nothing)."""
    refused = [(bool(cfg.offload_dir), "--offload-dir"),
               (cfg.pipeline.replan == "auto", "--replan auto")]
    return next((what for refuse, what in refused if refuse), None)


def check_dispatched(cfg: RunConfig) -> None:
    """What the dispatched schedule does not run, refused before anything is built."""
    refusal = dispatched_refusal(cfg)
    if refusal is not None:
        raise InputError(f"--schedule dispatched does not run {refusal} yet: use --schedule bound")


def build_dispatched(cfg: RunConfig, model_config: GPTConfig, shape: DispatchedShape, precision: str,
                     devices: list[Device], budget_bytes: list[int], batches: BatchSource,
                     trace: Trace, wait_s: float = WAIT_S, replicas: ReplicaGroup | None = None,
                     device_adam_params_per_s: float = float("inf")) -> DispatchedRunner:
    """The host's pieces (built once, on the first device's pinned memory) and the runner over
    ``devices``, as one of ``replicas`` (each parameter's AdamW on its owner's host), with fp16's
    loss scaler where ``precision`` is fp16; ``wait_s``: how long a task waits for what it needs
    before the run fails."""
    check_dispatched(cfg)
    cuts = pieces(shape.forward, shape.backward)
    store = HostStageStore(model_config, cuts, list(range(len(cuts))), cfg.optim.seed, UpdateRule.of(cfg.optim),
                           DTYPES[precision], devices[0], cfg.optim.optimizer_lag)
    if replicas is not None:
        # A tied table's two copies have one owner, which sums their gradients and updates both.
        replicas.assign({n: p.numel() for st in store.stages.values() for n, p in st.trained()},
                        tied_parameter_names(model_config))
        store.update_only(replicas.updates)
    return DispatchedRunner(shape, store, devices, budget_bytes, batches, trace, wait_s, replicas,
                            device_adam_params_per_s, DynamicLossScaler(enabled=precision == "fp16"))
