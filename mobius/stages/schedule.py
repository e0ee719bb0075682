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
  background thread, overlapped with the next stage's backward.

Boundary activations needed by backward are either *recomputed* (the stage input of every
micro-batch stays in host memory; backward re-runs the stage forward with autograd on) or *kept*
on the device (the autograd graph of every micro-batch stays until its backward), per
``recompute``.  Both give the reference trainer's numbers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mobius.data import BatchSource
from mobius.metrics import Trace
from mobius.models import Head
from mobius.optim import DynamicLossScaler, lr_at, set_lr
from mobius.runtime.spec import Plan
from mobius.runtime.device import Device, Event, Stream
from mobius.stages.ops import Op, worker_ops
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import DeviceStage, Prefetcher
from mobius.swap.store import HostStageStore, view


def _nbytes(t: torch.Tensor) -> int:
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


@dataclass
class _StepState:
    """What the operations of one step hand each other."""

    micro: list
    lr: float
    pending: list = field(default_factory=list)  # (send work, host buffer) of activations in flight
    handles: dict[int, DeviceStage] = field(default_factory=dict)
    layers: nn.ModuleList | None = None  # the resident stage being computed
    t0: float = 0.0
    grads: torch.Tensor | None = None  # its flat gradient buffer (backward)
    grad_phase: int = 0
    inbox: dict = field(default_factory=dict)  # (stage, mb) -> received host tensor
    outbox: dict = field(default_factory=dict)  # (stage, mb) -> stage output to send
    host_inputs: dict = field(default_factory=dict)  # recompute: (stage, mb) -> host input
    recomputed_from: dict = field(default_factory=dict)  # (stage, mb) -> host input, recycled after backward
    kept: dict = field(default_factory=dict)  # (stage, mb) -> (input, output, ledger, phase) on the device
    finished: dict = field(default_factory=dict)  # (stage, mb) -> (input with .grad, phase) after backward
    optimizer_jobs: list = field(default_factory=list)
    loss_sum: float = 0.0
    loss_count: int = 0


class StageRunner:
    def __init__(self, plan: Plan, rank: int, store: HostStageStore, prefetcher: Prefetcher, memory: DeviceMemory,
                 traffic: Traffic, trace: Trace, batches: BatchSource, device: Device, total_steps: int,
                 peak_lr: float, scaler: DynamicLossScaler, recompute: bool):
        self.plan, self.rank, self.store, self.prefetcher = plan, rank, store, prefetcher
        self.memory, self.traffic, self.trace, self.batches = memory, traffic, trace, batches
        self.device, self.total_steps, self.peak_lr = device, total_steps, peak_lr
        self.scaler, self.recompute = scaler, recompute
        self.n_stages = len(plan.bounds)
        self.my_stages = plan.stages_of_gpu(rank)
        self.M = plan.micro_batches
        self.ops = worker_ops(self.n_stages, self.my_stages, self.M, recompute)
        self.hidden_shape = (batches.micro_batch_size, batches.seq_len, store.config.hidden)
        self.dtype = store.compute_dtype
        self.host_pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-host")
        # Streams: compute; activations leave the device on a copy stream of their own, never
        # behind a parameter prefetch (``h2d-params``) or a stage's gradient offload
        # (``d2h-gradients``, copied in chunks); this thread's host-side work and the optimizer
        # thread's are streams too, so the checker sees every hand-over.
        self.compute = device.compute
        self.d2h = device.new_stream("d2h-activations")
        self.grads_out = device.new_stream("d2h-gradients")
        self.host = device.host_stream("host")
        self.optimizer_host = device.host_stream("optimizer")
        self.buffers = HostBuffers(device, self.host)
        self._outbox: list[tuple] = []  # activations on their way to the host: (event, buffer, to_stage, key)
        self._mailbox: dict[tuple, torch.Tensor] = {}  # messages between stages on this same worker
        # Tied input/output embeddings: stage 0 and the last stage each hold a copy; their
        # gradients are summed before either copy is updated (identically, so they stay equal).
        self.tied = store.config.tie_embeddings
        self.tied_stages = {0, self.n_stages - 1} if self.tied else set()
        self._seen_working: dict[tuple[int, str], int] = {}

    # ---- transfers ---------------------------------------------------------------------------
    def _to_device(self, host: torch.Tensor, what: str, recycle: bool = True) -> torch.Tensor:
        """A host tensor (ours, or a token batch) -> a new device tensor, on the compute stream:
        the compute needs it next, and it never waits behind a parameter prefetch."""
        nbytes = _nbytes(host)
        self.memory.allocate(nbytes, what)  # freed within the same phase (self._free)
        self.traffic.h2d += nbytes
        x = self.device.empty(host.numel(), host.dtype, name=what).view(host.shape)
        self.compute.wait(self.host.record())  # after this thread's writes (a receive) of ``host``
        self.compute.copy(x, host)
        if recycle:  # else it is kept (the stage input for recomputation) and recycled later
            self.buffers.put(host, self.compute.record())
        return x

    def _tag(self, stage: int, m: int, backward: bool) -> int:
        return (stage * self.M + m) * 2 + int(backward)

    def _send(self, t: torch.Tensor, to_stage: int, tag_stage: int, m: int, backward: bool) -> None:
        """Device tensor -> host on the D2H stream, without blocking the compute stream; the host
        leg to the worker of ``to_stage`` follows in :meth:`_flush` (no GPU peer-to-peer)."""
        self.d2h.wait(self.compute.record())  # after ``t`` was computed
        buf = self.buffers.get(tuple(t.shape), t.dtype)
        self.d2h.wait(self.host.record())  # after the buffer's previous use
        self.d2h.copy(buf, t, name="activation staging buffer")
        self.traffic.d2h += _nbytes(t)
        self._outbox.append((self.d2h.record(), buf, to_stage, (tag_stage, m, backward)))

    def _flush(self, pending: list, keep: int = 0) -> None:
        """Hand every activation that reached the host, but the last ``keep``, to its receiver."""
        while len(self._outbox) > keep:
            done, buf, to_stage, key = self._outbox.pop(0)
            self.host.wait(done)
            self.host.reads(buf)
            dst = self.plan.gpu_of_stage(to_stage)
            if dst == self.rank:
                self._mailbox[key] = buf
            else:
                self.traffic.peer += _nbytes(buf)
                pending.append((dist.isend(buf, dst, tag=self._tag(*key)), buf))

    def _recv(self, from_stage: int, tag_stage: int, m: int, backward: bool, shape, dtype) -> torch.Tensor:
        key = (tag_stage, m, backward)
        src = self.plan.gpu_of_stage(from_stage)
        if src == self.rank:
            return self._mailbox.pop(key)
        buf = self.buffers.get(tuple(shape), dtype)
        self.host.writes(buf, name="activation receive buffer")
        t0 = time.perf_counter()
        dist.recv(buf, src, tag=self._tag(*key))
        self.trace.span("recv", "comm", t0, time.perf_counter(), stage=tag_stage, mb=m)
        return buf

    # ---- running a stage -----------------------------------------------------------------------
    def _run_layers(self, layers: nn.ModuleList, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        for layer in layers:
            x = layer(x, targets) if isinstance(layer, Head) else layer(x)
        return x

    def _saved_hooks(self, ledger: list[tuple[int, int]]):
        """Account the activations autograd keeps: each storage once, however often it is saved
        (the profiler counts the same way, so plan and runtime agree)."""
        memory = self.memory
        seen: set[int] = set()

        def pack(t: torch.Tensor):
            if not isinstance(t, nn.Parameter):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    phase = memory.allocate(storage.nbytes(), "saved activations")
                    ledger.append((storage.nbytes(), phase))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _free_ledger(self, ledger: list[tuple[int, int]]) -> None:
        for nbytes, phase in ledger:
            self.memory.free(nbytes, phase)
        ledger.clear()

    def _free(self, t: torch.Tensor) -> None:
        """Free a transient tensor allocated in the running phase."""
        self.memory.free(_nbytes(t), self.memory.phase)

    # ---- memory reservation against prefetch -------------------------------------------------
    # Headroom over the plan's working-memory estimate: the bytes autograd saves vary by a few
    # percent from run to run, and a prefetch must never take what the running stage will need.
    RESERVE_MARGIN = 1.10

    def _reserve(self, s: int, phase: str) -> None:
        """Hold back the working memory stage ``s`` needs in ``phase``: the plan's estimate with a
        margin, or more if an earlier step saw it use more."""
        sp = self.plan.stages[s]
        planned = (sp.mem_fwd_bytes if phase == "forward" else sp.mem_bwd_bytes) - sp.param_bytes
        self.memory.set_compute_reserve(max(int(planned * self.RESERVE_MARGIN), self._seen_working.get((s, phase), 0)))

    def _observe(self, s: int, phase: str) -> None:
        used = self.memory.compute_peak_since_reserve
        self._seen_working[(s, phase)] = max(self._seen_working.get((s, phase), 0), used)

    # ---- one optimizer step --------------------------------------------------------------------
    def step(self, step: int) -> tuple[float, int]:
        """Run step ``step`` by executing this worker's operations (:func:`worker_ops`); returns
        (sum of this worker's micro-batch losses, micro-batches counted)."""
        st = _StepState(self.batches.step(step), lr_at(step, self.total_steps, self.peak_lr))
        for op in self.ops:
            getattr(self, f"_op_{op.kind}")(op, st)
        self.memory.set_compute_reserve(0)
        for job in st.optimizer_jobs:
            self.compute.wait(job.result())  # the host weights are updated before the next loads
        self.host.wait(self.compute.record())  # host-side updates below come after the step's device work
        if self.tied:
            self._sum_tied_gradients()
        if self.scaler.enabled:
            self._finish_fp16_step(st.lr)
        else:
            for s in self.tied_stages & set(self.my_stages):
                self._update(s, st.lr, self.host)
        for work, buf in st.pending:
            work.wait()
            self.buffers.put(buf, self.host.record())
        self.compute.wait(self.host.record())
        return st.loss_sum, st.loss_count

    # ---- the operations ------------------------------------------------------------------------
    def _op_load(self, op: Op, st: "_StepState") -> None:
        st.handles[op.stage] = self.prefetcher.request(op.stage, op.priority)

    def _op_wait(self, op: Op, st: "_StepState") -> None:
        s, phase = op.stage, "backward" if op.backward else "forward"
        self.memory.set_compute_reserve(0)  # nothing computes while we wait for the stage
        st.layers = self.prefetcher.wait(st.handles[s])
        self._reserve(s, phase)
        if op.backward:
            st.grad_phase = self.memory.allocate(self.plan.stages[s].param_bytes, f"gradients of stage {s}")
            st.grads = self._flat_gradients(s, st.layers)
        st.t0 = time.perf_counter()

    def _op_recv(self, op: Op, st: "_StepState") -> None:
        s, m = op.stage, op.mb
        if op.backward:  # the output gradient, from the next stage's worker
            st.inbox[(s, m)] = self._recv(s + 1, s, m, True, self.hidden_shape, self.dtype)
        else:
            st.inbox[(s, m)] = self._recv(s - 1, s - 1, m, False, self.hidden_shape, self.dtype)

    def _targets(self, s: int, m: int, st: "_StepState") -> torch.Tensor | None:
        return st.micro[m].targets.to(self.device.torch_device) if s == self.n_stages - 1 else None

    def _op_compute(self, op: Op, st: "_StepState") -> None:
        if op.backward:
            self._backward(op.stage, op.mb, st)
        else:
            self._forward(op.stage, op.mb, op.recompute, st)

    def _forward(self, s: int, m: int, recompute: bool, st: "_StepState") -> None:
        x_host = st.micro[m].tokens if s == 0 else st.inbox.pop((s, m))
        self._flush(st.pending, keep=1)  # the previous micro-batch's output went on while this one computes
        targets = self._targets(s, m, st)
        x = self._to_device(x_host, "stage input", recycle=not recompute)
        if recompute:
            st.host_inputs[(s, m)] = x_host
            with torch.no_grad():
                out = self._run_layers(st.layers, x, targets)
            self._free(x)
        else:
            ledger: list[tuple[int, int]] = []
            if x.is_floating_point():
                x.requires_grad_(True)
            with self._saved_hooks(ledger):
                out = self._run_layers(st.layers, x, targets)
            st.kept[(s, m)] = (x, out, ledger, self.memory.phase)
        if s == self.n_stages - 1:
            st.loss_sum += out.item()
            st.loss_count += 1
        else:
            st.outbox[(s, m)] = out

    def _op_recompute(self, op: Op, st: "_StepState") -> None:
        """Redo the stage's forward of micro-batch ``m`` with autograd on, from its host input."""
        s, m = op.stage, op.mb
        self._flush(st.pending, keep=1)
        ledger: list[tuple[int, int]] = []
        x_phase = self.memory.phase
        x_host = st.host_inputs.pop((s, m))
        x = self._to_device(x_host, "recompute input", recycle=False)
        if x.is_floating_point():
            x.requires_grad_(True)
        with self._saved_hooks(ledger):
            out = self._run_layers(st.layers, x, self._targets(s, m, st))
        st.kept[(s, m)] = (x, out, ledger, x_phase)
        st.recomputed_from[(s, m)] = x_host

    def _backward(self, s: int, m: int, st: "_StepState") -> None:
        if (s, m) not in st.recomputed_from:
            self._flush(st.pending, keep=1)
        x, out, ledger, x_phase = st.kept.pop((s, m))
        if s == self.n_stages - 1:
            (out * (self.scaler.scale / self.M)).backward()
        else:
            g = self._to_device(st.inbox.pop((s, m)), "output gradient")
            out.backward(g)
            self._free(g)
            del g
        self._free_ledger(ledger)
        st.finished[(s, m)] = (x, x_phase)
        if s == 0:  # no input gradient to send
            self._retire_input(s, m, st)

    def _retire_input(self, s: int, m: int, st: "_StepState") -> None:
        x, x_phase = st.finished.pop((s, m))
        if (s, m) in st.recomputed_from:
            self.buffers.put(st.recomputed_from.pop((s, m)), self.compute.record())
        self.memory.free(_nbytes(x), x_phase)

    def _op_send(self, op: Op, st: "_StepState") -> None:
        s, m = op.stage, op.mb
        if op.backward:  # the input gradient, to the previous stage's worker
            x, _ = st.finished[(s, m)]
            self._send(x.grad, s - 1, s - 1, m, True)
            self._retire_input(s, m, st)
        else:
            out = st.outbox.pop((s, m))
            self.memory.allocate(_nbytes(out), "stage output")
            self._send(out, s + 1, s, m, False)
            self._free(out)

    def _op_end(self, op: Op, st: "_StepState") -> None:
        """The stage's pass is done: its outputs go on, its working memory is on record."""
        phase = "backward" if op.backward else "forward"
        self._flush(st.pending)
        self._observe(op.stage, phase)
        self.trace.span(f"{'B' if op.backward else 'F'}{op.stage}", "compute", st.t0, time.perf_counter(),
                        stage=op.stage)

    def _op_offload(self, op: Op, st: "_StepState") -> None:
        """Gradients leave on their own stream; the optimizer thread takes over once they are home."""
        s = op.stage
        self._gather_gradients(s, st.layers, st.grads)
        self.grads_out.wait(self.compute.record())
        host = self.store.stages[s]
        self.grads_out.copy(host.grad_staging, st.grads, name=f"gradient staging of stage {s}")
        self.traffic.d2h += _nbytes(st.grads)
        arrived = self.grads_out.record()
        self.memory.will_free(self.plan.stages[s].param_bytes)
        st.optimizer_jobs.append(self.host_pool.submit(self._offload_and_update, s, arrived, st.lr, st.grad_phase))
        for p in st.layers.parameters():
            p.grad = None
        st.grads = None

    def _op_release(self, op: Op, st: "_StepState") -> None:
        st.layers = None
        self.prefetcher.release(st.handles.pop(op.stage))

    def _flat_gradients(self, s: int, layers: nn.ModuleList) -> torch.Tensor:
        """One zeroed device buffer for the stage's gradients; autograd accumulates into views."""
        host = self.store.stages[s]
        grads = self.device.empty(host.compute.numel(), self.dtype, name=f"gradients of stage {s}")
        grads.zero_()
        for p, slot in zip(layers.parameters(), host.slots):
            p.grad = view(grads, slot)
        return grads

    def _gather_gradients(self, s: int, layers: nn.ModuleList, grads: torch.Tensor) -> None:
        """Autograd accumulates in place into a gradient that obeys the parameter's layout; should
        it have replaced one, its values go back into the flat buffer."""
        for p, slot in zip(layers.parameters(), self.store.stages[s].slots):
            mine = view(grads, slot)
            if p.grad is not None and p.grad.data_ptr() != mine.data_ptr():
                mine.copy_(p.grad)

    def _offload_and_update(self, s: int, arrived: Event, lr: float, grad_phase: int) -> Event:
        """On the optimizer thread: once the gradients are home, fp32 master gradients, then
        (unless fp16 must agree on overflow first) AdamW.  Returns the event after this work."""
        host_stream = self.optimizer_host
        t0 = time.perf_counter()
        host_stream.wait(arrived)
        host = self.store.stages[s]
        host_stream.reads(host.grad_staging)
        if host.grad_staging.data_ptr() != host.master_grad.data_ptr():
            host.master_grad.copy_(host.grad_staging)
        host.attach_master_grads()
        self.memory.free(self.plan.stages[s].param_bytes, grad_phase, announced=True)
        t1 = time.perf_counter()
        self.trace.span(f"grads {s} to host", "offload", t0, t1, bytes=host.param_bytes)
        if not self.scaler.enabled and s not in self.tied_stages:
            self._update(s, lr, host_stream)
            self.trace.span(f"AdamW {s}", "optimizer", t1, time.perf_counter())
        return host_stream.record()

    def _tied_params(self) -> dict[str, torch.nn.Parameter]:
        """This worker's copies of the tied token table: {"embedding": ..., "head": ...}."""
        n_layers = self.plan.bounds[-1][1]
        wanted = {"embedding": (0, "layers.0.wte.weight"),
                  "head": (self.n_stages - 1, f"layers.{n_layers - 1}.lm_head.weight")}
        out = {}
        for role, (s, name) in wanted.items():
            if s in self.my_stages:
                host = self.store.stages[s]
                out[role] = dict(zip(host.names, host.master_params))[name]
        return out

    def _sum_tied_gradients(self) -> None:
        """grad(embedding copy) + grad(head copy), in that order on both holders (same bits)."""
        mine = self._tied_params()
        if len(mine) == 2:  # one worker holds both copies
            total = mine["embedding"].grad + mine["head"].grad
            mine["embedding"].grad, mine["head"].grad = total, total.clone()
            return
        if not mine:
            return
        (role, param), = mine.items()
        other_role = "head" if role == "embedding" else "embedding"
        other_rank = self.plan.gpu_of_stage(self.n_stages - 1 if other_role == "head" else 0)
        other = torch.empty_like(param.grad)
        tag = self._tag(self.n_stages, 0, False)
        work = dist.isend(param.grad.contiguous(), other_rank, tag=tag)
        dist.recv(other, other_rank, tag=tag)
        work.wait()
        self.traffic.peer += _nbytes(param.grad)
        param.grad = param.grad + other if role == "embedding" else other + param.grad

    def _update(self, s: int, lr: float, on: Stream) -> None:
        """AdamW on the host, then the compute-dtype copy the next load reads (written on ``on``)."""
        host = self.store.stages[s]
        set_lr(host.optimizer, lr)
        host.optimizer.step()
        host.optimizer.zero_grad(set_to_none=True)
        on.writes(host.compute, name=f"host weights of stage {s}")
        self.store.refresh_compute_copy(s)

    def _finish_fp16_step(self, lr: float) -> None:
        """fp16: every worker must agree on overflow before anyone updates."""
        local = any(not torch.isfinite(p.grad).all() for s in self.my_stages
                    for p in self.store.stages[s].master_params if p.grad is not None)
        flag = torch.tensor([1.0 if local else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        overflow = bool(flag.item())
        for s in self.my_stages:
            host = self.store.stages[s]
            if overflow:
                host.optimizer.zero_grad(set_to_none=True)
                continue
            for p in host.master_params:
                p.grad.div_(self.scaler.scale)
            self._update(s, lr, self.host)
        self.scaler.update(overflow)

    def close(self) -> None:
        self.host_pool.shutdown(wait=True)
        self.d2h.synchronize()
        self.grads_out.synchronize()
