"""The executor of the Mobius pipeline schedule for one worker (Mobius §3.1, Fig. 4).

Stage ``s`` runs on the GPU the mapping gives slot ``s mod N``.  The order of a step's work is data
(:func:`mobius.stages.ops.worker_ops`); :class:`StageRunner` performs each operation with the
device layer (:mod:`mobius.runtime.device`) and gloo:

* forward: for each of its stages in order, wait for the stage's weights, start prefetching the
  next stage, and run *all* M micro-batches while the stage is resident, sending each output
  activation (device -> host -> the next stage's worker) as soon as it exists.  The stage is then
  evicted — except the worker's last stage, which backward needs first;
* backward: the same in reverse order; micro-batch m's output gradient arrives from the next
  stage's worker, the input gradient goes back to the previous one.  After a stage's last
  micro-batch its gradients go to host and AdamW updates its fp32 master weights on the CPU, on a
  background thread, overlapped with the next stage's backward — except for the stages the plan
  keeps resident, which are loaded once and updated on the device.

Boundary activations needed by backward are either *recomputed* (the stage input of every
micro-batch stays in host memory; backward re-runs the stage forward with autograd on) or *kept*
on the device (the autograd graph of every micro-batch stays until its backward), per stage
(the plan's ``recompute`` and the stages it ``kept``).  Both give the reference trainer's numbers.

The runner only sequences; each concern is a unit of its own: the links between stages
(:mod:`~mobius.stages.links` over a :mod:`~mobius.stages.transport`), the working memory of the
running stage (:mod:`~mobius.stages.working_memory`), the gradient offload and CPU optimizer
(:mod:`~mobius.stages.host_optimizer`), the resident stages' optimizer
(:mod:`~mobius.stages.device_optimizer`), the tied embedding (:mod:`~mobius.stages.tied`).
"""

from __future__ import annotations

import contextlib
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn

from mobius.data import BatchSource
from mobius.metrics import Trace
from mobius.models import TokenLayout, run_layers
from mobius.models.lora import dropout_micro_batch
from mobius.models.router_balance import activation_shape, carries_tally
from mobius.runtime.device import Device, Event
from mobius.runtime.optim import DynamicLossScaler
from mobius.runtime.spec import Plan
from mobius.stages.device_optimizer import DeviceOptimizer
from mobius.stages.host_optimizer import HostOptimizer
from mobius.stages.links import ActivationLinks
from mobius.stages.ops import (
    COMPUTE,
    END,
    LOAD,
    OFFLOAD,
    RECOMPUTE,
    RECV,
    RELEASE,
    SEND,
    UPDATE,
    WAIT,
    Op,
    worker_ops,
)
from mobius.stages.replicas import ReplicaGroup, ReplicaLayout
from mobius.stages.tied import TiedEmbedding
from mobius.stages.transport import Transport
from mobius.stages.working_memory import WorkingMemory
from mobius.swap.disk import DiskState
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import DeviceStage, Prefetcher
from mobius.swap.store import HostStageStore


@dataclass
class _StepState:
    """What the operations of one step hand each other."""

    micro: list
    lr: float
    step: int
    training: bool = True  # False: an evaluation pass (forward only, no dropout)
    handles: dict[int, DeviceStage] = field(default_factory=dict)
    layers: nn.ModuleList | None = None  # the resident stage being computed
    stage_pass: ExitStack = field(default_factory=ExitStack)  # its working-memory reservation
    begin: Event | None = None  # the compute stream's event at the pass's start, when tracing
    grads: torch.Tensor | None = None  # its flat gradient buffer (backward)
    grad_phase: int = 0
    inbox: dict = field(default_factory=dict)  # (stage, mb) -> received host tensor
    outbox: dict = field(default_factory=dict)  # (stage, mb) -> stage output to send
    host_inputs: dict = field(default_factory=dict)  # recompute: (stage, mb) -> host input
    recomputed_from: dict = field(default_factory=dict)  # (stage, mb) -> host input, recycled after backward
    kept: dict = field(default_factory=dict)  # (stage, mb) -> (input, output, ledger, phase) on the device
    finished: dict = field(default_factory=dict)  # (stage, mb) -> (input with .grad, phase) after backward
    loss_sum: float = 0.0


class StageRunner:
    def __init__(self, plan: Plan, store: HostStageStore, prefetcher: Prefetcher, memory: DeviceMemory,
                 traffic: Traffic, trace: Trace, batches: BatchSource, device: Device,
                 scaler: DynamicLossScaler, transport: Transport,
                 replicas: ReplicaGroup | None = None, disk: DiskState | None = None):
        self.plan, self.store, self.prefetcher, self.trace, self.batches = plan, store, prefetcher, trace, batches
        self.device, self.scaler = device, scaler
        self.n_stages = len(plan.bounds)
        self.M = plan.micro_batches  # this replica's share of the step's micro-batches
        # Data-parallel replicas (mobius.stages.replicas): which share of each step is this one's.
        self.replica = replicas.layout if replicas is not None else ReplicaLayout()
        mine = plan.stages_of_gpu(transport.rank)
        self.resident = frozenset(plan.resident) & set(mine)
        self.ops = worker_ops(self.n_stages, mine, self.M, plan.recompute, plan.prefetch, resident=self.resident,
                              kept=frozenset(plan.kept))
        self.eval_ops = worker_ops(self.n_stages, mine, self.M, plan.recompute, plan.prefetch, forward_only=True,
                                   resident=self.resident)
        self._resident_handles: dict[int, DeviceStage] = {}  # loaded once, never released
        self.dtype = store.compute_dtype
        # Streams: compute, and this thread's host-side work (so the checker sees every hand-over);
        # the links and the optimizer bring their own copy streams.
        self.compute = device.compute
        self.host = device.host_stream("host")
        self.links = ActivationLinks(transport, device, self.host, memory, traffic, trace, self._tag)
        self.working = WorkingMemory(memory, plan)
        self.optimizer = HostOptimizer(store, device, memory, traffic, trace, scaler,
                                       TiedEmbedding(store, plan, transport, traffic), transport,
                                       replicas, disk)
        self.device_optimizer = DeviceOptimizer(store, device, memory, trace, plan.device_adam_params_per_s)
        self.grad_norm: float | None = None  # the last step's global gradient norm, where it clips
        # The compute stream's work of each micro-batch once its inputs are on the device, between
        # two of its events: what the run compares with its plan's compute lane (mobius.runtime.plan_check),
        # the layers' time.  The inputs' uploads and the waits before them are not in it: under
        # contention for the root complex an upload can take as long as the pass, which made an
        # emulated box's compute lane look 3x slower than its profile.
        self._computed: list[tuple[Event, Event]] = []
        self._inputs_in: Event | None = None  # the running pass's inputs are on the device
        self.compute_s = 0.0  # the last step's
        # The planner never makes such a plan: these updates need what only the host has (the tied
        # sum, fp16's vote), or must write the weights the step after next reads (--optimizer-lag).
        shared = [s for s in self.resident if self.optimizer.needs_the_host(s) or store.lag]
        if shared:
            raise ValueError(f"stages {shared} cannot stay resident: their update needs the host, or lags")

    # ---- one optimizer step --------------------------------------------------------------------
    def step(self, step: int) -> float:
        """Run step ``step`` by executing this worker's operations (:func:`worker_ops`); returns
        the sum of the losses this worker computed (the last stage's worker: the step's loss)."""
        st = _StepState(self.replica.share(self.batches.step(step)), self.store.rule.lr_at(step),
                        step)
        self.micro = st.micro  # what a preference run's head found is in them (PairLayout.found)
        self.store.begin_step(step)
        self._execute(self.ops, st)
        self.grad_norm = self.optimizer.finish_step(step, st.lr, self.host, self.device_optimizer)
        self._settle()
        self.compute_s = sum(self.device.time_of(end) - self.device.time_of(begin) for begin, end in self._computed)
        self._computed.clear()
        return st.loss_sum

    def reload_resident(self) -> None:
        """The resident stages loaded before any step (by a preference run's reference pass) let go,
        to load again from the host store as the first step finds it (a checkpoint restored)."""
        for handle in self._resident_handles.values():
            self.prefetcher.release(handle)
        self._resident_handles.clear()

    def drain(self) -> None:
        """Every update issued so far is done and in the host stage store (before a checkpoint, an
        export or the final weights are read)."""
        self.optimizer.drain()
        self.device_optimizer.sync_to_host()

    def evaluate(self, micro: list, next_step: int) -> float:
        """The forward pass of ``micro`` (evaluation batches) with the weights step ``next_step``
        would compute with, no autograd and no dropout; returns this worker's loss sum."""
        self.optimizer.drain()  # every update so far is in the weights (resident ones: on the device)
        st = _StepState(self.replica.share(micro), 0.0, next_step, training=False)
        self.store.begin_step(next_step)
        with torch.no_grad():
            self._execute(self.eval_ops, st)
        self._settle()
        return st.loss_sum

    def _execute(self, ops: list[Op], st: _StepState) -> None:
        perform = {LOAD: self._op_load, WAIT: self._op_wait, RECV: self._op_recv, COMPUTE: self._op_compute,
                   RECOMPUTE: self._op_recompute, SEND: self._op_send, END: self._op_end, OFFLOAD: self._op_offload,
                   UPDATE: self._op_update, RELEASE: self._op_release}
        for op in ops:
            perform[op.kind](op, st)
        self.working.idle()

    def _settle(self) -> None:
        self.links.finish_sends()
        self.compute.wait(self.host.record())

    # ---- the operations ------------------------------------------------------------------------
    def _op_load(self, op: Op, st: _StepState) -> None:
        s = op.stage
        if s in self._resident_handles:  # already on the device, for good
            st.handles[s] = self._resident_handles[s]
            return
        st.handles[s] = self.prefetcher.request(s, op.priority)
        if s in self.resident:
            self._resident_handles[s] = st.handles[s]

    def _op_wait(self, op: Op, st: _StepState) -> None:
        s = op.stage
        self.working.idle()  # nothing computes while we wait for the stage
        st.layers = self.prefetcher.wait(st.handles[s])
        st.stage_pass.enter_context(self.working.stage_pass(s, op.backward))
        if op.backward and s in self.resident:
            st.grads = self.device_optimizer.gradients_for(s, st.layers)
        elif op.backward:
            st.grads, st.grad_phase = self.optimizer.gradients_for(s, st.layers)
        st.begin = self.device.compute.record() if self.trace.enabled else None

    def _op_recv(self, op: Op, st: _StepState) -> None:
        s, m = op.stage, op.mb
        # (a micro-batch is as wide as its longest sequence)
        shape = activation_shape(self.store.config, st.micro[m].tokens.shape, self.dtype)
        if op.backward:  # the output gradient, from the next stage's worker
            st.inbox[(s, m)] = self.links.recv(self.plan.gpu_of_stage(s + 1), (s, m, True), shape, self.dtype)
        else:
            st.inbox[(s, m)] = self.links.recv(self.plan.gpu_of_stage(s - 1), (s - 1, m, False), shape, self.dtype)

    def _tag(self, key: tuple[int, int, bool]) -> int:
        """A message's number for the transport: (sending stage, micro-batch, backward)."""
        stage, m, backward = key
        return (stage * self.M + m) * 2 + int(backward)

    def _layout(self, s: int, m: int, st: _StepState) -> TokenLayout | None:
        """What stage ``s`` needs of micro-batch ``m`` besides its input: the positions and mask of
        packed examples (every stage), the targets (the last); read from the step's own data."""
        layout = st.micro[m].layout
        if s < self.n_stages - 1:
            layout = layout.for_blocks(padding=carries_tally(self.store.config))
        return layout.to(self.device.torch_device) if layout is not None else None

    def _emulated_s(self, s: int, kind: str) -> float:
        """The planned time of one micro-batch of stage ``s`` (on emulated GPUs, the least it takes):
        the plan's backward includes the recomputed forward, which runs as an operation of its own
        (every stage's but the last's, :mod:`mobius.stages.ops`)."""
        st = self.plan.stages[s]
        if kind == "backward":
            recomputed = self.plan.recomputes(s)
            return (st.bwd_ms - (st.fwd_ms if recomputed else 0.0)) / 1e3
        return st.fwd_ms / 1e3

    def _dropout(self, m: int, st: _StepState):
        """LoRA dropout draws micro-batch ``m``'s masks: the same in forward and its recomputation
        (none in evaluation)."""
        if not st.training:
            return contextlib.nullcontext()
        return dropout_micro_batch(self.batches.seed, st.step, self.replica.index * self.M + m)

    def _op_compute(self, op: Op, st: _StepState) -> None:
        with self.device.compute_span(self._emulated_s(op.stage, "backward" if op.backward else "forward")):
            if op.backward:
                self._backward(op.stage, op.mb, st)
            else:
                self._forward(op.stage, op.mb, op.recompute, st)
        if st.training:
            self._computed.append((self._inputs_in, self.compute.record()))

    def _forward(self, s: int, m: int, recompute: bool, st: _StepState) -> None:
        x_host = st.micro[m].tokens if s == 0 else st.inbox.pop((s, m))
        self.links.flush(keep=1)  # the previous micro-batch's output went on while this one computes
        layout = self._layout(s, m, st)
        keep_input = recompute and st.training  # on the host, for the recomputation in backward
        x = self.links.to_device(x_host, "stage input", recycle=not keep_input)
        self._inputs_in = self.compute.record()
        if recompute or not st.training:
            if keep_input:
                st.host_inputs[(s, m)] = x_host
            with torch.no_grad(), self._dropout(m, st):
                out = run_layers(st.layers, x, layout)
            self.working.free(x)
        else:
            if x.is_floating_point():
                x.requires_grad_(True)
            with self.working.saved_activations(st.layers) as ledger, self._dropout(m, st):
                out = run_layers(st.layers, x, layout)
            st.kept[(s, m)] = (x, out, ledger, self.working.memory.phase)
        if s == self.n_stages - 1:
            st.loss_sum += out.item()  # this micro-batch's share of the step's token mean
        else:
            st.outbox[(s, m)] = out

    def _op_recompute(self, op: Op, st: _StepState) -> None:
        """Redo the stage's forward of micro-batch ``m`` with autograd on, from its host input."""
        s, m = op.stage, op.mb
        self.links.flush(keep=1)
        x_phase = self.working.memory.phase
        x_host = st.host_inputs.pop((s, m))
        x = self.links.to_device(x_host, "recompute input", recycle=False)
        self._inputs_in = self.compute.record()
        if x.is_floating_point():
            x.requires_grad_(True)
        with self.working.saved_activations(st.layers) as ledger, \
                self.device.compute_span(self._emulated_s(s, "forward")), self._dropout(m, st):
            out = run_layers(st.layers, x, self._layout(s, m, st))
        self._computed.append((self._inputs_in, self.compute.record()))
        st.kept[(s, m)] = (x, out, ledger, x_phase)
        st.recomputed_from[(s, m)] = x_host

    def _backward(self, s: int, m: int, st: _StepState) -> None:
        if (s, m) not in st.recomputed_from:
            self.links.flush(keep=1)
        x, out, ledger, x_phase = st.kept.pop((s, m))
        if s == self.n_stages - 1:
            self._inputs_in = self.compute.record()
            (out * self.scaler.scale).backward()  # the loss is already its share of the step's mean
        else:
            g = self.links.to_device(st.inbox.pop((s, m)), "output gradient")
            self._inputs_in = self.compute.record()
            if out.requires_grad:  # else nothing before it trains (e.g. a frozen embedding under LoRA)
                out.backward(g)
            self.working.free(g)
            del g
        self.working.release(ledger)
        st.finished[(s, m)] = (x, x_phase)
        if s == 0:  # no input gradient to send
            self._retire_input(s, m, st)

    def _retire_input(self, s: int, m: int, st: _StepState) -> None:
        x, x_phase = st.finished.pop((s, m))
        if (s, m) in st.recomputed_from:
            self.links.recycle(st.recomputed_from.pop((s, m)))
        self.working.free(x, x_phase)

    def _op_send(self, op: Op, st: _StepState) -> None:
        s, m = op.stage, op.mb
        if op.backward:  # the input gradient, to the previous stage's worker
            x, _ = st.finished[(s, m)]
            self.links.send(x.grad, self.plan.gpu_of_stage(s - 1), (s - 1, m, True))
            self._retire_input(s, m, st)
        else:
            out = st.outbox.pop((s, m))
            self.working.allocate(out, "stage output")
            self.links.send(out, self.plan.gpu_of_stage(s + 1), (s, m, False))
            self.working.free(out)

    def _op_end(self, op: Op, st: _StepState) -> None:
        """The stage's pass is done: its outputs go on, its working memory is on record."""
        self.links.flush()
        st.stage_pass.close()
        end = self.device.compute.record() if self.trace.enabled else None
        self.trace.device_span(f"{'B' if op.backward else 'F'}{op.stage}", "compute", st.begin, end,
                               self.device.time_of, stage=op.stage)

    def _op_offload(self, op: Op, st: _StepState) -> None:
        self.optimizer.offload(op.stage, st.layers, st.grads, st.grad_phase, st.step, st.lr)
        st.grads = None

    def _op_update(self, op: Op, st: _StepState) -> None:
        self.device_optimizer.update(op.stage, st.layers, st.handles[op.stage].weights, st.lr)
        st.grads = None

    def _op_release(self, op: Op, st: _StepState) -> None:
        st.layers = None
        self.prefetcher.release(st.handles.pop(op.stage))

    def close(self) -> None:
        self.optimizer.close()
        self.links.close()
