"""Gradients off the device and AdamW on the CPU, overlapped with the rest of backward.

During a stage's backward, autograd accumulates into one flat device buffer (parameters' ``.grad``
are views of it).  After the stage's last micro-batch the buffer leaves the device on a copy stream
of its own (``d2h-gradients``) into the stage's host staging buffer; a background thread (the
``optimizer`` host stream) waits for it and runs fused AdamW on the stage's master weights in one
pass with the gradients' conversion to fp32 and the refresh of the compute-dtype copy the next load
reads (:func:`~mobius.runtime.optim.host_update`; where updates start before their step's
decision, with replicas, a tied table or state on disk, they are converted as they come home) —
while the device runs the next stage's backward.  Updates that must wait for every stage's
gradients (the tied embedding's sum, fp16's overflow vote) are issued by
:meth:`HostOptimizer.finish_step`.

With ``--optimizer-lag 1`` the next step does not wait for this step's updates: they write the
compute buffer the step after next reads (:mod:`mobius.swap.store`), and run on while the next
step computes, off the critical path (the semantics of :mod:`mobius.reference`).

Without a lag, replicas or the disk tier, the updates that clipping's global norm or fp16's
overflow vote hold back need not wait for them (a tied table's copies still wait for each other):
each stage's update runs as its gradients come home, and the step's decision afterwards keeps it,
takes it back or redoes it clipped (:mod:`mobius.stages.step_decision`, shared with the dispatched
schedule).

With data-parallel replicas (:mod:`mobius.stages.replicas`) the optimizer thread sums each stage's
gradients into their owner replicas before the update and broadcasts the owners' weights after it:
each host steps AdamW for its share of the parameters only.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import nn

from mobius.metrics import Trace
from mobius.runtime.device import Device, Event, Stream
from mobius.runtime.optim import DynamicLossScaler, host_update, host_update_path, not_finite, set_lr, squares
from mobius.stages.replicas import ReplicaGroup
from mobius.stages.step_decision import StepDecisions
from mobius.stages.tied import TiedEmbedding
from mobius.stages.transport import Transport
from mobius.swap.disk import DiskState
from mobius.swap.memory import DeviceMemory, Traffic
from mobius.swap.store import HostStageStore, view


class ResidentUpdates(Protocol):
    """The updates of the stages kept on the device (:class:`~mobius.stages.device_optimizer.DeviceOptimizer`)
    where clipping holds them back until the step's global norm is known."""

    def squares(self) -> float:
        """The sum of squares of the held-back stages' gradients."""

    def apply(self, clip: float) -> None:
        """Their updates, with gradients scaled by ``clip``."""


class HostOptimizer:
    def __init__(self, store: HostStageStore, device: Device, memory: DeviceMemory, traffic: Traffic, trace: Trace,
                 scaler: DynamicLossScaler, tied: TiedEmbedding, transport: Transport,
                 replicas: ReplicaGroup | None = None, disk: DiskState | None = None):
        self.store, self.device, self.memory, self.traffic, self.trace = store, device, memory, traffic, trace
        self.disk = disk  # where optimizer state waits between updates (--offload-dir), or None: in memory
        self.scaler, self.tied, self.transport, self.replicas = scaler, tied, transport, replicas
        self.lag = store.lag
        self.compute = device.compute
        self.grads_out = device.new_stream("d2h-gradients", "d2h")
        self.host = device.host_stream("optimizer")  # what the optimizer thread does to host buffers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-optimizer")
        self._to_master_jobs: list[Future] = []  # this step's
        self._deferred: list[int] = []  # this step's stages whose update waits for the whole step
        self._updates: dict[int, list[Future]] = {}  # step -> its update jobs
        self._last_job: dict[int, Future] = {}  # stage -> the last job that reads its gradient buffers
        # stages whose gradients wait in their 16-bit staging for their update's pass (its next
        # offload waits for that update: the set changes for a stage only between the two)
        self._in_pass: set[int] = set()
        self._busy = [0.0, 0]  # wall seconds of host updates and parameters they updated, since last taken
        self._busy_lock = threading.Lock()
        self.decisions = StepDecisions(store.rule, self.lag, scaler, replicas is not None)
        self.path = host_update_path(store.rule.max_grad_norm, self.lag, scaler.enabled, replicas is not None)

    def gradients_for(self, s: int, layers: nn.ModuleList) -> tuple[torch.Tensor, int]:
        """One zeroed device buffer for stage ``s``'s gradients, accounted; autograd accumulates
        into views of it.  Returns (buffer, its memory phase)."""
        host = self.store.stages[s]
        phase = self.memory.allocate(host.grad_bytes, f"gradients of stage {s}")
        grads = self.device.empty(host.grad_staging.numel(), host.grad_staging.dtype, name=f"gradients of stage {s}")
        grads.zero_()
        for p, slot in zip(layers.parameters(), host.grad_slots()):
            if slot is not None:
                p.grad = view(grads, slot)
        return grads, phase

    def waits_for_the_step(self, s: int) -> bool:
        """Whether stage ``s``'s update waits for the whole step (tied sum, fp16 overflow vote, the
        global norm it is clipped by)."""
        return self.scaler.enabled or s in self.tied.stages or bool(self.store.rule.max_grad_norm)

    def _speculative(self, s: int) -> bool:
        """Whether stage ``s``'s update this step runs before the decision (:class:`StepDecisions`): not a
        tied table's (it waits for the other copy), none with the disk tier (a redo would read the
        state through the drives again; the plan counts every update waiting)."""
        return self.decisions.speculating and s not in self.tied.stages and self.disk is None

    def _converts_in_pass(self, s: int) -> bool:
        """Whether stage ``s``'s update makes its fp32 gradients from the 16-bit staging in its own
        pass: where the run's path does (:func:`~mobius.runtime.optim.host_update_path`: no update
        made before its step's decision, no replicas), but not a tied table's or one with state on
        disk (whose update reads the fp32 gradients)."""
        host = self.store.stages[s]
        return (self.path.converts and s not in self.tied.stages
                and not host.master_on_disk and not (self.disk is not None and self.disk.holds(s))
                and host.grad_staging.data_ptr() != host.master_grad.data_ptr())

    def needs_the_host(self, s: int) -> bool:
        """Whether stage ``s``'s update needs what only the host's optimizer has: the tied sum, the
        fp16 overflow vote (a resident stage's device update cannot take part)."""
        return self.scaler.enabled or s in self.tied.stages

    def offload(self, s: int, layers: nn.ModuleList, grads: torch.Tensor, phase: int, step: int, lr: float) -> None:
        """Stage ``s``'s backward of step ``step`` is done: its gradients leave on their own stream
        and the optimizer thread takes over once they are home."""
        host = self.store.stages[s]
        if not host.trains:
            return
        # Autograd accumulates in place into a gradient that obeys the parameter's layout; should
        # it have replaced one, its values go back into the flat buffer.
        for p, slot in zip(layers.parameters(), host.grad_slots()):
            if slot is not None:
                mine = view(grads, slot)
                if p.grad is not None and p.grad.data_ptr() != mine.data_ptr():
                    mine.copy_(p.grad)
            p.grad = None
        if s in self._last_job:  # with a lag, last step's update of this stage may still read them
            self.grads_out.wait(self._last_job.pop(s).result())
        self.grads_out.wait(self.compute.record())
        self.grads_out.copy(host.grad_staging, grads, name=f"gradient staging of stage {s}")
        self.traffic.d2h += host.grad_bytes
        arrived = self.grads_out.record()
        self.memory.will_free(host.grad_bytes)
        if self._converts_in_pass(s):
            self._in_pass.add(s)
        else:
            self._in_pass.discard(s)
        job = self._pool.submit(self._to_master, s, arrived, phase)
        self._to_master_jobs.append(job)
        self._last_job[s] = job
        if self._speculative(s):
            self._deferred.append(s)
            self._submit_update(s, step, lr, unscale=self.scaler.scale if self.scaler.enabled else None,
                                speculative=True)
        elif self.waits_for_the_step(s):
            self._deferred.append(s)
        else:
            self._submit_update(s, step, lr)

    def _submit_update(self, s: int, step: int, lr: float, unscale: float | None = None, apply: bool = True,
                       clip: float = 1.0, reduced: bool = False, speculative: bool = False) -> None:
        job = self._pool.submit(self._update, s, step, lr, unscale, apply, clip, reduced, speculative)
        self._updates.setdefault(step, []).append(job)
        self._last_job[s] = job

    def _to_master(self, s: int, arrived: Event, phase: int) -> Event:
        """On the optimizer thread: once the gradients are home, the fp32 master gradients."""
        t0 = time.perf_counter()
        self.host.wait(arrived)
        host = self.store.stages[s]
        self.host.reads(host.grad_staging)
        # else the disk tier attaches them with the master for the update, or the update converts them
        if not host.master_on_disk and s not in self._in_pass:
            if host.grad_staging.data_ptr() != host.master_grad.data_ptr():
                self._timed(host.master_grad.copy_, host.grad_staging)
            host.attach_master_grads()
        self.memory.free(host.grad_bytes, phase, announced=True)
        self.trace.span(f"grads {s} to host", "offload", t0, time.perf_counter(), bytes=host.grad_bytes)
        return self.host.record()

    def _update(self, s: int, step: int, lr: float, unscale: float | None, apply: bool, clip: float = 1.0,
                reduced: bool = False, speculative: bool = False) -> Event:
        """On the optimizer thread: AdamW with step ``step``'s gradients (unless ``apply`` is off: an
        fp16 step skipped for overflow, which every replica skips: the vote is the whole run's), then
        the compute-dtype copy the step ``step + 1 + lag`` reads.  ``speculative``: before the
        step's vote and norm, with its gradients unscaled, their squares taken first (or, where one
        is not finite, no update at all) and the gradients kept; such a stage comes back here with
        the step's decision: its update kept, taken back (a step the vote skips), or taken back and
        redone with its gradients clipped."""
        host = self.store.stages[s]
        if not host.trains:
            return self.host.record()
        first = speculative or self.decisions.updated_first(s)
        if not self._timed(self.decisions.goes_ahead, s, host.optimizer, speculative, unscale, apply and clip == 1.0,
                           self.device):
            return self.host.record()
        if first:  # its gradients are unscaled: by the update made first (or for the one taken back)
            unscale = None
        if apply and self.replicas is not None and not reduced:
            self.replicas.reduce_gradients(host)
        t0, cpu0, numel = time.perf_counter(), time.thread_time(), 0
        buffer = self.store.buffer_updated_by(step)
        on_disk = self.disk is not None and self.disk.holds(s)
        compute = host.compute_buffers[buffer]
        # the compute copy written in the update's pass, where it is not the master itself
        refreshed = (apply and host.optimizer is not None and not on_disk and self.path.refreshes
                     and compute.data_ptr() != host.master.data_ptr())
        if apply and host.optimizer is not None:
            updated = [p for group in host.optimizer.param_groups for p in group["params"]]
            set_lr(host.optimizer, lr)
            numel = self.disk.numel(s) if on_disk else sum(p.numel() for p in updated)
            began = time.perf_counter()
            with self.device.host_update_span(numel):
                if on_disk:  # block by block through the drives, the compute copy of a master there with it
                    self.disk.update(s, lr, unscale, clip, compute)
                else:
                    if s in self._in_pass:
                        self.host.reads(host.grad_staging)
                    host_update(host.optimizer, host.master, compute if refreshed else None,
                                (host.grad_staging,) if s in self._in_pass else (), unscale, clip)
            if not on_disk:  # the host's AdamW rate (an update through the drives runs at theirs)
                with self._busy_lock:
                    self._busy[0] += time.perf_counter() - began
                    self._busy[1] += numel
        elif on_disk:  # an fp16 step skipped: a master on disk still gives the compute copy its values
            self.disk.update(s, lr, unscale, clip, compute, apply=False)
        if host.optimizer is not None and not speculative:
            host.optimizer.zero_grad(set_to_none=True)
        # Its CPU seconds too: workers that share a machine's cores stretch each other's wall time.
        self.trace.span(f"AdamW {s}", "optimizer", t0, time.perf_counter(), cpu_s=time.thread_time() - cpu0,
                        params=numel)
        if apply and self.replicas is not None:
            self.replicas.broadcast_weights(host)
        self.host.writes(compute, name=f"host weights of stage {s}")
        if not host.master_on_disk and not refreshed:
            self.store.refresh_compute_copy(s, buffer)
        return self.host.record()

    def _timed(self, fn, *args):
        """``fn(*args)``, its seconds counted as the host update's (:meth:`take_busy`)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._busy_lock:
                self._busy[0] += time.perf_counter() - t0

    def take_busy(self) -> tuple[float, int]:
        """Wall seconds of the host updates this worker ran in memory since the last call (their
        passes, and where the gradients are converted ahead, the conversions and the step's checks
        of them: what the plan charges by the run's path), and the parameters they updated: what
        the run compares with its plan's host AdamW lane."""
        with self._busy_lock:
            busy, self._busy = tuple(self._busy), [0.0, 0]
        return busy

    def finish_step(self, step: int, lr: float, host: Stream,
                    resident: ResidentUpdates | None = None) -> float | None:
        """Every offload of step ``step`` has been issued.  The updates that need every stage's
        gradients (the tied sum, fp16's overflow vote, the global norm clipping scales them by) are
        decided here, on ``host`` (the calling thread's stream), ``resident``'s (the stages updated
        on the device, held back for the norm) with them; then the compute stream waits for the
        updates the next step's loads read: this step's, or with a lag the previous step's (this
        step's run on during the next).  Returns the step's global gradient norm where it clips."""
        norm = None
        if any(self.waits_for_the_step(s) for s in self.store.stages) or self.store.rule.max_grad_norm:
            for job in self._to_master_jobs:
                host.wait(job.result())
            self.tied.sum_gradients()
            deferred, self._deferred = self._deferred, []
            if self.decisions.speculating:  # the updates made before the vote and the norm checked their gradients
                for job in self._updates.get(step, []):
                    job.result()
            waited = [s for s in deferred if not self.decisions.updated_first(s)]
            unscale = self.scaler.scale if self.scaler.enabled else None
            overflow = self.scaler.enabled and self.transport.any_rank(self._timed(self._overflowed, waited))
            reduced = bool(self.replicas is not None and self.store.rule.max_grad_norm and not overflow)
            if reduced:  # the norm is the replicas' sum's: reduce into the owners first
                for job in [self._pool.submit(self.replicas.reduce_gradients, self.store.stages[s])
                            for s in deferred if self.store.stages[s].trains]:
                    job.result()
            # every process's share: its stages' (its replica's owned part of them), and resident ones
            clip, norm = self.decisions.decide(
                step, overflow, lambda: self._timed(self._squares, waited) / (unscale or 1.0) ** 2
                + (resident.squares() if resident is not None else 0.0), self.transport.sum_all)
            for s in deferred:
                self._submit_update(s, step, lr, unscale=unscale, apply=not overflow, clip=clip, reduced=reduced)
            if resident is not None:
                resident.apply(clip)
        self._to_master_jobs.clear()
        for job in self._updates.pop(step - self.lag, []):
            self.compute.wait(job.result())
        return norm

    def _overflowed(self, waited: list[int]) -> bool:
        """Whether a gradient of this process's is not finite: one an update made before the vote
        found (:meth:`_update`), or one of the ``waited`` stages' (every trained one, before a
        replica's sum: each replica votes on its own)."""
        return None in self.decisions.speculated.values() or not_finite(
            g for s in waited for g in (self.store.stages[s].updated_gradients(True) if s in self._in_pass
                                        else self.store.stages[s].gradients()))

    def _squares(self, stages: list[int]) -> float:
        """This process's share of the sum of squares of the step's gradients: those of the
        parameters its AdamW updates (its stages' trained ones; with replicas, those it owns,
        summed over the replicas), the tied table counted once (its head copy holds the same sum)."""
        duplicate = self.tied.head_copy()
        hosts = [self.store.stages[s] for s in stages]
        on_disk = [g for host in hosts if host.master_on_disk for g in host.gradients()]  # not bound: as staged
        return squares(on_disk) + squares(g for s, host in zip(stages, hosts) if not host.master_on_disk
                                          for g in host.updated_gradients(s in self._in_pass, duplicate))

    def drain(self) -> None:
        """Wait for every update issued so far (before a checkpoint or the final weights are read)."""
        for step in sorted(self._updates):
            for job in self._updates.pop(step):
                self.compute.wait(job.result())

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.grads_out.synchronize()
        if self.disk is not None:
            self.disk.close()
