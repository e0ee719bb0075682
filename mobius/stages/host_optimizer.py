"""Gradients off the device and AdamW on the CPU, overlapped with the rest of backward.

During a stage's backward, autograd accumulates into one flat device buffer (parameters' ``.grad``
are views of it).  After the stage's last micro-batch the buffer leaves the device on a copy stream
of its own (``d2h-gradients``) into the stage's host staging buffer; a background thread (the
``optimizer`` host stream) waits for it, converts it into the fp32 master gradients and runs fused
AdamW on the stage's master weights, then refreshes the compute-dtype copy the next load reads —
while the device runs the next stage's backward.  Updates that must wait for every stage's
gradients (the tied embedding's sum, fp16's overflow vote) run in :meth:`HostOptimizer.finish_step`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from mobius.metrics import Trace
from mobius.optim import DynamicLossScaler, set_lr
from mobius.runtime.device import Device, Event, Stream
from mobius.stages.tied import TiedEmbedding
from mobius.stages.transport import Transport
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.store import HostStageStore, view


class HostOptimizer:
    def __init__(self, store: HostStageStore, device: Device, memory: DeviceMemory, traffic: Traffic, trace: Trace,
                 scaler: DynamicLossScaler, tied: TiedEmbedding, transport: Transport):
        self.store, self.device, self.memory, self.traffic, self.trace = store, device, memory, traffic, trace
        self.scaler, self.tied, self.transport = scaler, tied, transport
        self.compute = device.compute
        self.grads_out = device.new_stream("d2h-gradients")
        self.host = device.host_stream("optimizer")  # what the optimizer thread does to host buffers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-optimizer")
        self._jobs: list[Future] = []

    def gradients_for(self, s: int, layers: nn.ModuleList) -> tuple[torch.Tensor, int]:
        """One zeroed device buffer for stage ``s``'s gradients, accounted; autograd accumulates
        into views of it.  Returns (buffer, its memory phase)."""
        host = self.store.stages[s]
        phase = self.memory.allocate(host.param_bytes, f"gradients of stage {s}")
        grads = self.device.empty(host.compute.numel(), host.compute.dtype, name=f"gradients of stage {s}")
        grads.zero_()
        for p, slot in zip(layers.parameters(), host.slots):
            p.grad = view(grads, slot)
        return grads, phase

    def offload(self, s: int, layers: nn.ModuleList, grads: torch.Tensor, phase: int, lr: float) -> None:
        """Stage ``s``'s backward is done: its gradients leave on their own stream and the optimizer
        thread takes over once they are home."""
        host = self.store.stages[s]
        # Autograd accumulates in place into a gradient that obeys the parameter's layout; should
        # it have replaced one, its values go back into the flat buffer.
        for p, slot in zip(layers.parameters(), host.slots):
            mine = view(grads, slot)
            if p.grad is not None and p.grad.data_ptr() != mine.data_ptr():
                mine.copy_(p.grad)
            p.grad = None
        self.grads_out.wait(self.compute.record())
        self.grads_out.copy(host.grad_staging, grads, name=f"gradient staging of stage {s}")
        self.traffic.d2h += host.param_bytes
        arrived = self.grads_out.record()
        self.memory.will_free(host.param_bytes)
        self._jobs.append(self._pool.submit(self._to_master_and_update, s, arrived, lr, phase))

    def _to_master_and_update(self, s: int, arrived: Event, lr: float, phase: int) -> Event:
        """On the optimizer thread: once the gradients are home, fp32 master gradients, then
        (unless the update must wait for the whole step) AdamW.  Returns the event after it."""
        t0 = time.perf_counter()
        self.host.wait(arrived)
        host = self.store.stages[s]
        self.host.reads(host.grad_staging)
        if host.grad_staging.data_ptr() != host.master_grad.data_ptr():
            host.master_grad.copy_(host.grad_staging)
        host.attach_master_grads()
        self.memory.free(host.param_bytes, phase, announced=True)
        t1 = time.perf_counter()
        self.trace.span(f"grads {s} to host", "offload", t0, t1, bytes=host.param_bytes)
        if not self.scaler.enabled and s not in self.tied.stages:
            self._update(s, lr, self.host)
            self.trace.span(f"AdamW {s}", "optimizer", t1, time.perf_counter())
        return self.host.record()

    def finish_step(self, lr: float, host: Stream) -> None:
        """Every offload of the step has been issued: wait for the updates (the next step's loads
        read the refreshed weights), then the updates that needed every stage's gradients, on
        ``host`` (the calling thread's stream)."""
        for job in self._jobs:
            self.compute.wait(job.result())
        self._jobs.clear()
        host.wait(self.compute.record())  # after the step's device work
        self.tied.sum_gradients()
        if self.scaler.enabled:
            self._finish_fp16(lr, host)
        else:
            for s in self.tied.stages & set(self.store.stages):
                self._update(s, lr, host)

    def _update(self, s: int, lr: float, on: Stream) -> None:
        """AdamW on the host, then the compute-dtype copy the next load reads (written on ``on``)."""
        host = self.store.stages[s]
        set_lr(host.optimizer, lr)
        host.optimizer.step()
        host.optimizer.zero_grad(set_to_none=True)
        on.writes(host.compute, name=f"host weights of stage {s}")
        self.store.refresh_compute_copy(s)

    def _finish_fp16(self, lr: float, host: Stream) -> None:
        """fp16: every worker must agree on overflow before anyone updates."""
        local = any(not torch.isfinite(p.grad).all() for st in self.store.stages.values()
                    for p in st.master_params if p.grad is not None)
        overflow = self.transport.any_rank(local)
        for s, st in self.store.stages.items():
            if overflow:
                st.optimizer.zero_grad(set_to_none=True)
                continue
            for p in st.master_params:
                p.grad.div_(self.scaler.scale)
            self._update(s, lr, host)
        self.scaler.update(overflow)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.grads_out.synchronize()
