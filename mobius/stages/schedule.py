"""The Mobius pipeline schedule for one worker (Mobius §3.1, Fig. 4).

Stage ``s`` runs on the GPU the mapping gives slot ``s mod N``.  In one optimizer step a worker:

* forward: for each of its stages in order, waits for the stage's weights, starts prefetching its
  next stage, and runs *all* M micro-batches while the stage is resident, sending each output
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
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from mobius.data import BatchSource
from mobius.mapping import transfer_priority
from mobius.metrics import Trace
from mobius.models import Head
from mobius.optim import DynamicLossScaler, lr_at, set_lr
from mobius.planner import Plan
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.prefetch import DeviceStage, Prefetcher
from mobius.swap.store import HostStageStore


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StageRunner:
    def __init__(self, plan: Plan, rank: int, store: HostStageStore, prefetcher: Prefetcher, memory: DeviceMemory,
                 traffic: Traffic, trace: Trace, batches: BatchSource, device: torch.device, total_steps: int,
                 peak_lr: float, scaler: DynamicLossScaler, recompute: bool):
        self.plan, self.rank, self.store, self.prefetcher = plan, rank, store, prefetcher
        self.memory, self.traffic, self.trace, self.batches = memory, traffic, trace, batches
        self.device, self.total_steps, self.peak_lr = device, total_steps, peak_lr
        self.scaler, self.recompute = scaler, recompute
        self.n_stages = len(plan.bounds)
        self.my_stages = plan.stages_of_gpu(rank)
        self.M = plan.micro_batches
        self.dtype = store.compute_dtype
        self.host_pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-host")
        self._mailbox: dict[tuple, torch.Tensor] = {}  # messages between stages on this same worker
        # Tied input/output embeddings: stage 0 and the last stage each hold a copy; their
        # gradients are summed before either copy is updated (identically, so they stay equal).
        self.tied = store.config.tie_embeddings
        self.tied_stages = {0, self.n_stages - 1} if self.tied else set()
        self._seen_working: dict[tuple[int, str], int] = {}

    # ---- transfers ---------------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.traffic.d2h += _nbytes(t)
        return t.detach().to("cpu") if t.device.type == "cuda" else t.detach().clone()

    def _to_device(self, t: torch.Tensor, what: str) -> torch.Tensor:
        nbytes = _nbytes(t)
        self.memory.allocate(nbytes, what)  # freed within the same phase (self._free)
        self.traffic.h2d += nbytes
        return t.to(self.device, non_blocking=True) if self.device.type == "cuda" else t.clone()

    def _tag(self, stage: int, m: int, backward: bool) -> int:
        return (stage * self.M + m) * 2 + int(backward)

    def _send(self, t: torch.Tensor, to_stage: int, tag_stage: int, m: int, backward: bool, pending: list) -> None:
        """Device tensor -> host -> the worker of ``to_stage`` (no GPU peer-to-peer)."""
        host = self._to_host(t)
        dst = self.plan.gpu_of_stage(to_stage)
        key = (tag_stage, m, backward)
        if dst == self.rank:
            self._mailbox[key] = host
        else:
            self.traffic.peer += _nbytes(host)
            pending.append((dist.isend(host, dst, tag=self._tag(*key)), host))

    def _recv(self, from_stage: int, tag_stage: int, m: int, backward: bool, shape, dtype) -> torch.Tensor:
        key = (tag_stage, m, backward)
        src = self.plan.gpu_of_stage(from_stage)
        if src == self.rank:
            return self._mailbox.pop(key)
        buf = torch.empty(shape, dtype=dtype)
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
        """Run step ``step``; returns (sum of this worker's micro-batch losses, micro-batches counted)."""
        micro = self.batches.step(step)
        lr = lr_at(step, self.total_steps, self.peak_lr)
        last = self.n_stages - 1
        hidden_shape = (self.batches.micro_batch_size, self.batches.seq_len, self.store.config.hidden)
        pending: list = []
        loss_sum, loss_count = 0.0, 0
        host_inputs: dict[tuple[int, int], torch.Tensor] = {}
        kept: dict[tuple[int, int], tuple] = {}  # recompute off: (input, output, ledger, phase) on the device

        handles: dict[int, DeviceStage] = {}
        if self.my_stages:
            handles[self.my_stages[0]] = self.prefetcher.request(self.my_stages[0], 0)

        # ---------------- forward ----------------
        for k, s in enumerate(self.my_stages):
            self.memory.set_compute_reserve(0)  # nothing computes while we wait for the stage
            layers = handles[s].wait()
            self._reserve(s, "forward")
            if k + 1 < len(self.my_stages):
                nxt = self.my_stages[k + 1]
                handles[nxt] = self.prefetcher.request(nxt, transfer_priority(nxt, self.n_stages, "forward"))
            t0 = time.perf_counter()
            for m in range(self.M):
                if s == 0:
                    x_host = micro[m].tokens
                else:
                    x_host = self._recv(s - 1, s - 1, m, False, hidden_shape, self.dtype)
                targets = micro[m].targets.to(self.device) if s == last else None
                x = self._to_device(x_host, "stage input")
                if self.recompute:
                    host_inputs[(s, m)] = x_host
                    with torch.no_grad():
                        out = self._run_layers(layers, x, targets)
                    self._free(x)
                    del x
                else:
                    ledger: list[tuple[int, int]] = []
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    with self._saved_hooks(ledger):
                        out = self._run_layers(layers, x, targets)
                    kept[(s, m)] = (x, out, ledger, self.memory.phase)
                if s == last:
                    loss_sum += out.item()
                    loss_count += 1
                else:
                    self.memory.allocate(_nbytes(out), "stage output")
                    self._send(out, s + 1, s, m, False, pending)
                    self._free(out)
                if self.recompute:
                    del out
            self._observe(s, "forward")
            self.trace.span(f"F{s}", "compute", t0, time.perf_counter(), stage=s)
            if k + 1 < len(self.my_stages):
                self.prefetcher.release(handles.pop(s))

        # ---------------- backward ----------------
        order = self.my_stages[::-1]
        optimizer_jobs: list[Future] = []
        for k, s in enumerate(order):
            self.memory.set_compute_reserve(0)
            layers = handles[s].wait()
            self._reserve(s, "backward")
            if k + 1 < len(order):
                nxt = order[k + 1]
                handles[nxt] = self.prefetcher.request(nxt, transfer_priority(nxt, self.n_stages, "backward"))
            grad_phase = self.memory.allocate(self.plan.stages[s].param_bytes, f"gradients of stage {s}")
            t0 = time.perf_counter()
            for m in range(self.M):
                targets = micro[m].targets.to(self.device) if s == last else None
                ledger = []
                if self.recompute:
                    x_phase = self.memory.phase
                    x = self._to_device(host_inputs.pop((s, m)), "recompute input")
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    with self._saved_hooks(ledger):
                        out = self._run_layers(layers, x, targets)
                else:
                    x, out, ledger, x_phase = kept.pop((s, m))
                if s == last:
                    (out * (self.scaler.scale / self.M)).backward()
                else:
                    g = self._to_device(self._recv(s + 1, s, m, True, hidden_shape, self.dtype), "output gradient")
                    out.backward(g)
                    self._free(g)
                    del g
                self._free_ledger(ledger)
                if s > 0:
                    self._send(x.grad, s - 1, s - 1, m, True, pending)
                self.memory.free(_nbytes(x), x_phase)
                del x, out
            self._observe(s, "backward")
            self.trace.span(f"B{s}", "compute", t0, time.perf_counter(), stage=s)
            handle = handles.pop(s)
            grads = [p.grad for p in layers.parameters()]
            done = torch.cuda.Event() if self.device.type == "cuda" else None
            if done is not None:
                done.record()
            self.memory.will_free(self.plan.stages[s].param_bytes)
            optimizer_jobs.append(self.host_pool.submit(self._offload_and_update, s, grads, done, lr, grad_phase))
            del grads, layers
            # The gradients now belong to the offload job; the weights can go.
            self.prefetcher.release(handle)

        self.memory.set_compute_reserve(0)
        for job in optimizer_jobs:
            job.result()
        if self.tied:
            self._sum_tied_gradients()
        if self.scaler.enabled:
            self._finish_fp16_step(lr)
        else:
            for s in self.tied_stages & set(self.my_stages):
                self._update(s, lr)
        for work, _ in pending:
            work.wait()
        return loss_sum, loss_count

    def _offload_and_update(self, s: int, grads: list[torch.Tensor], done, lr: float, grad_phase: int) -> None:
        """Gradients -> host fp32 master grads, then (unless fp16 must agree on overflow first) AdamW."""
        if done is not None:
            done.synchronize()
        t0 = time.perf_counter()
        host = self.store.stages[s]
        nbytes = 0
        for p, g in zip(host.master.parameters(), grads):
            nbytes += _nbytes(g)
            p.grad = g.detach().to(device="cpu", dtype=torch.float32)
            if p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()
        self.traffic.d2h += nbytes
        self.memory.free(self.plan.stages[s].param_bytes, grad_phase, announced=True)
        t1 = time.perf_counter()
        self.trace.span(f"grads {s} to host", "offload", t0, t1, bytes=nbytes)
        if not self.scaler.enabled and s not in self.tied_stages:
            self._update(s, lr)
            self.trace.span(f"AdamW {s}", "optimizer", t1, time.perf_counter())

    def _tied_params(self) -> dict[str, torch.nn.Parameter]:
        """This worker's copies of the tied token table: {"embedding": ..., "head": ...}."""
        n_layers = self.plan.bounds[-1][1]
        wanted = {"embedding": (0, "layers.0.wte.weight"),
                  "head": (self.n_stages - 1, f"layers.{n_layers - 1}.lm_head.weight")}
        out = {}
        for role, (s, name) in wanted.items():
            if s in self.my_stages:
                host = self.store.stages[s]
                out[role] = dict(zip(host.names, host.master.parameters()))[name]
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

    def _update(self, s: int, lr: float) -> None:
        host = self.store.stages[s]
        set_lr(host.optimizer, lr)
        host.optimizer.step()
        host.optimizer.zero_grad(set_to_none=True)
        self.store.refresh_compute_copy(s)

    def _finish_fp16_step(self, lr: float) -> None:
        """fp16: every worker must agree on overflow before anyone updates."""
        local = any(not torch.isfinite(p.grad).all() for s in self.my_stages
                    for p in self.store.stages[s].master.parameters() if p.grad is not None)
        flag = torch.tensor([1.0 if local else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        overflow = bool(flag.item())
        for s in self.my_stages:
            host = self.store.stages[s]
            if overflow:
                host.optimizer.zero_grad(set_to_none=True)
                continue
            for p in host.master.parameters():
                p.grad.div_(self.scaler.scale)
            self._update(s, lr)
        self.scaler.update(overflow)

    def close(self) -> None:
        self.host_pool.shutdown(wait=True)
