"""The cost model of one Mobius training step for a given partition (Mobius §3.2, Table 2).

This module is the bound schedule's analytic answer to "how long does this partition take": the MIP
encodes the same equations as linear constraints, the baselines and the exhaustive checker call
:func:`evaluate` directly.  It is an approximation of the schedule's operations: the simulator
(:mod:`mobius.sim`) times those, and is what ``--schedule auto`` compares.

Stage ``j`` runs on pipeline slot ``j mod N`` with host<->device bandwidth ``B_j`` (GB/s, after the
mapping's expected root-complex sharing) and memory ``G_j``.  With ``S_j`` its parameter bytes,
``T^f_j``/``T^b_j`` its per-micro-batch forward/backward time and ``a_j`` its boundary activation:

* memory (4): ``W^f_j = S_j + max_l fwd_work_l + 2 a_{j-1}`` and
  ``W^b_j = 2 S_j + Σ_l bwd_work_l + 2 a_{j-1} + 2 a_j`` must fit in ``G_j``;
* prefetch (5)-(6): while stage ``j-N`` computes, up to
  ``P_j = min(S_j, G - W_{j-N}, B_j · D_{j-N})`` bytes of stage ``j`` are copied in, where
  ``D`` is the span stage ``j-N`` computes (7);
* load (9): stage ``j`` starts no earlier than ``end(j-N) + (S_j - P_j) / B_j``; the first ``N``
  stages load at time 0 with nothing to hide behind; in backward the last ``N`` stages are still
  resident;
* order (8): micro-batch ``m`` of stage ``j`` starts after stage ``j-1`` finished it, its
  activation reached host memory (``a/B_src``; no peer-to-peer) and the other worker got it
  (``h``, the hand-off latency); (10) one micro-batch at a time; (11) a stage's backward after
  the slot's forward pass; the last stage (the head) runs each micro-batch's backward right
  after its forward, before the next micro-batch's forward, and never recomputes.

What the runtime showed, calibrated: a stage's input (and in backward its output
gradient, and with recomputation its input again) is copied to the device *on the compute
stream*, so a micro-batch occupies the device for ``a/B_dst`` on top of its compute, plus a fixed
``o`` per micro-batch in each pass (the runtime's own work; backward with recomputation is two
passes), and a stage's pass starts no earlier than ``w`` after the slot's previous pass ended (the
switch: release, wait, working memory, gradient buffer; it overlaps the rest of the load); each
stage's gradients then leave the device (at its link's rate, the offloads of one root complex
queueing for its bandwidth in backward order) and AdamW updates them on the host
(``g_j / (e · R_adam)`` for ``e`` bytes per element), one optimizer thread per worker.  ``h``,
``o``, ``w`` and ``R_adam`` are measured with the profile
(:class:`~mobius.partition.profile.HostCosts`; ``h``, ``o`` and ``w`` by running the runtime,
:mod:`mobius.stages.calibrate`).

Every bound is non-decreasing in earlier start times, so the earliest schedule is optimal for a
fixed partition: the MIP's optimum for that partition equals this recurrence.  Objective: the step
time, the latest of every stage's update ``u_j = max(home_j, u_{j+N}) + adam_j``, where
``home_j = max(t^b_{j,M} + T^b_j + g_j/link_j, home_q + g_j/B_rc)`` and ``q`` is the stage offloading
before ``j`` under its root complex (one optimizer thread per worker updates its stages in backward
order, each once its gradients are home; with ``--optimizer-lag``: the latest ``home_j`` and each
worker's optimizer thread's total work).

Contention (measured under --emulate): copies of one direction share their GPU's link
and their root complex's bandwidth.  Stage loads use a share of the root complex among all the
GPUs under it (``B_j``, by their links' busy fractions: every slot loads in the same phase); the
copies on the critical path — stage inputs, output gradients and recomputed inputs on the compute
stream, activations and activation gradients leaving the device — use per-slot rates taken from
the partition's *own* schedule (:func:`settle`: evaluate, count the copies in flight beside each
of its copies, evaluate again with those rates).  In the MIP these rates are constants (those of
the best partition known when it is built); its answer is then settled and compared like any
other candidate.
"""

from __future__ import annotations

import heapq
import math
from itertools import repeat
from dataclasses import dataclass, field, replace

import numpy as np

from mobius.boundary.errors import InputError
from mobius.models.precision import element_bytes
from mobius.partition.profile import HostCosts, Profile
from mobius.runtime.spec import Lane
from mobius.swap.disk import MASTER_BYTES, MOMENT_BYTES

GB = 1e9


@dataclass(frozen=True)
class Machine:
    """What the cost model needs of the mapped topology, per pipeline slot."""

    bandwidth: tuple[float, ...]  # bytes/s per slot
    memory: tuple[int, ...]  # bytes per slot
    prefetch: bool = True  # False (--no-prefetch): a stage loads only once the previous one is released
    handoff_s: float = 0.0  # latency of an activation between two workers, beyond its copies
    micro_batch_s: float = 0.0  # fixed device time per micro-batch per stage in each pass (the runtime's own work)
    stage_switch_s: float = 0.0  # device time between two passes of one slot (the runtime's own work)
    adam_params_per_s: float = math.inf  # host AdamW rate of one worker's optimizer thread
    device_adam_params_per_s: float = math.inf  # AdamW on a device, for the stages kept resident there
    replicas: int = 1  # data-parallel replicas: each host updates 1/replicas of every stage
    network_bps: float = 0.0  # the node's network to the other replicas, shared by its workers
    optimizer_lag: int = 0  # 1: the updates run while the next step computes (off the critical path)
    # --max-grad-norm where updates wait for the norm (mobius.planning.pipeline.clipping_waits): no
    # update starts before the step's last gradient is home
    clip: bool = False
    # The first load of every slot starts at once; those under one root complex share its bandwidth.
    link: tuple[float, ...] = ()  # bytes/s of each slot's own link (empty: ``bandwidth``)
    first_wave_peers: tuple[tuple[int, ...], ...] = ()  # per slot: the slots under its root complex
    rc_bandwidth: tuple[float, ...] = ()  # per slot: its root complex's host bandwidth, bytes/s
    # Per slot, bytes/s beside the other copies in flight (:func:`copy_rates`; empty: ``bandwidth``):
    # the copies on the compute stream in forward (stage inputs) and in backward (output gradients,
    # recomputed inputs); activations leaving the device in forward, activation gradients in backward.
    upload: tuple[float, ...] = ()
    upload_backward: tuple[float, ...] = ()
    d2h_forward: tuple[float, ...] = ()
    d2h_backward: tuple[float, ...] = ()
    # The disk tier (mobius.swap.disk): the stages whose AdamW moments wait on disk between updates,
    # those whose fp32 master weights wait there too, and the seconds a byte of them takes there and
    # back for one worker, its drives shared (reads and writes in flight together: a drive's read and
    # write queues are its own).
    on_disk: tuple[int, ...] = ()
    masters_on_disk: tuple[int, ...] = ()
    disk_s_per_byte: float = 0.0
    # And the stages whose compute weights wait there too: each load reads them whole into a staging
    # buffer first (one worker's share of the drives' read rate), then copies them to its GPU, so the
    # two times add; each update writes them back.
    weights_on_disk: tuple[int, ...] = ()
    disk_read_s_per_byte: float = 0.0

    def first_load_s(self, j: int, sizes: list[float]) -> float:
        """When slot ``j``'s first stage (``sizes[j]`` bytes; ``sizes`` of the first stage of every
        slot) is on the device: fair sharing of its root complex, capped by its link."""
        if not self.link:
            return sizes[j] / self.bandwidth[j]
        together = sum(sizes[k] for k in self.first_wave_peers[j] if k < len(sizes))
        return max(sizes[j] / self.link[j], together / self.rc_bandwidth[j])

    @property
    def n(self) -> int:
        return len(self.bandwidth)

    @property
    def update_params_per_s(self) -> float:
        """Parameters per second of a host update as the MIP charges it (a linear term per stage):
        with replicas, the exchanges on the node's link shared by all of its workers at once, a
        bound :func:`evaluate` refines by queueing them."""
        return replica_update_rate(self.adam_params_per_s, self.replicas, self.network_bps / self.n)

    def _or_bandwidth(self, per_slot: tuple[float, ...], slot: int) -> float:
        """A per-slot rate, or the slot's ``bandwidth`` where the machine has none (a hand-made one)."""
        return per_slot[slot] if per_slot else self.bandwidth[slot]

    def upload_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.upload, slot)

    def upload_backward_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.upload_backward, slot)

    def forward_d2h_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.d2h_forward, slot)

    def backward_d2h_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.d2h_backward, slot)

    def link_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.link, slot)

    def rc_bps(self, slot: int) -> float:
        return self._or_bandwidth(self.rc_bandwidth, slot)

    def root_complex_slots(self, slot: int) -> tuple[int, ...]:
        """The slots under ``slot``'s root complex (itself included); without root-complex data (a
        hand-made machine), only itself."""
        return self.first_wave_peers[slot] if self.first_wave_peers else (slot,)

    def previous_on_root_complex(self, j: int, stages: int) -> int | None:
        """The stage whose gradient offload comes just before stage ``j``'s under its root complex:
        the nearest later stage (backward runs from the last stage) on a slot of the same root
        complex."""
        peers = self.root_complex_slots(j % self.n)
        return next((q for q in range(j + 1, stages) if q % self.n in peers), None)


@dataclass
class StageCost:
    start: int
    end: int
    param_bytes: int
    fwd_s: float
    bwd_s: float
    out_bytes: int
    in_bytes: int
    mem_fwd: int
    mem_bwd: int
    grad_bytes: int  # the trained parameters' gradients (under LoRA, the adapters')
    held_bytes: int = 0  # held once per pass whatever M (the head's weight-gradient sum), in mem_bwd
    resident: bool = False  # kept on the device with its optimizer state, updated there (never swapped)
    recomputed: bool = False  # its backward redoes its forward (bwd_s includes it)

    @property
    def kept_bytes(self) -> int:
        """What one micro-batch's forward leaves on the device for its backward."""
        return self.mem_bwd - self.param_bytes - self.grad_bytes - self.held_bytes

    @property
    def loaded_bytes(self) -> int:
        """What a swap brings to the device (nothing for a resident stage, once it is there)."""
        return 0 if self.resident else self.param_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Gradients that leave the device for the host's AdamW (none for a resident stage)."""
        return 0 if self.resident else self.grad_bytes

    def pass_bytes(self, backward: bool) -> int:
        """Device memory a pass of this stage needs beyond what resident stages hold for good."""
        mem = self.mem_bwd if backward else self.mem_fwd
        return mem - (self.param_bytes + (self.grad_bytes if backward else 0) if self.resident else 0)

    def resident_bytes(self, element_bytes: int) -> int:
        """What a resident stage holds on the device for good: its weights and gradients, fp32
        master weights and gradients of what trains when it computes in 16 bits, AdamW's two fp32
        moments (:mod:`mobius.stages.device_optimizer`)."""
        trained = self.grad_bytes // element_bytes
        return self.param_bytes + self.grad_bytes + trained * ((8 if element_bytes != 4 else 0) + 8)


@dataclass
class StepEstimate:
    step_s: float
    feasible: bool
    stages: list[StageCost]
    prefetch_fwd: list[float]  # bytes prefetched while the previous stage on the GPU computes
    prefetch_bwd: list[float]
    reason: str = ""
    # The host<->device copies of the schedule: (slot, direction, start, end, kind), kind a key of
    # :data:`STREAM_OF`.
    copies: list[tuple[int, str, float, float, str]] = field(default_factory=list)


def on_device(st: list[StageCost], machine: Machine) -> list[StageCost]:
    """The stages' per-micro-batch times as the device is occupied: compute plus the copies the
    runtime issues on the compute stream (input; output gradient; input again to recompute) and
    the fixed per-micro-batch cost of each pass (backward with recomputation: two)."""
    n = machine.n
    out = []
    for j, c in enumerate(st):
        bw, bw_b = machine.upload_bps(j % n), machine.upload_backward_bps(j % n)
        up_f = c.in_bytes / bw
        up_b = (c.out_bytes + (c.in_bytes if c.recomputed else 0)) / bw_b
        out.append(replace(c, fwd_s=c.fwd_s + up_f + machine.micro_batch_s,
                           bwd_s=c.bwd_s + up_b + machine.micro_batch_s * (2 if c.recomputed else 1)))
    return out


def adam_s(c: StageCost, machine: Machine, element_bytes: int, disk_bytes: int = 0) -> float:
    """Host AdamW of stage ``c`` on one worker: its share of the parameters, with replicas; with
    ``disk_bytes`` of state a parameter on disk, at least their way there and back (read ahead and
    written behind, overlapped with the updates: the longer of the two)."""
    params = c.grad_bytes / element_bytes / machine.replicas
    return max(params / machine.adam_params_per_s, params * disk_bytes * machine.disk_s_per_byte)


def disk_bytes_per_param(machine: Machine, j: int, element_bytes: int) -> int:
    """Bytes each trained parameter of stage ``j`` keeps on disk: its two moments (fp32), its
    master weight where that waits there too, and its compute weight (``element_bytes``) where that
    does (an update writes it and reads none of it; counted both ways, a bound)."""
    if j not in machine.on_disk:
        return 0
    return MOMENT_BYTES + MASTER_BYTES * (j in machine.masters_on_disk) + element_bytes * (j in machine.weights_on_disk)


def exchanged_bytes(params: float, replicas: int) -> float:
    """What one replica's network carries each way for one exchange over ``params`` trained
    parameters (their fp32 gradients summed into their owners, or the owners' fp32 weights
    broadcast): (D-1)/D of 4 bytes each, as a bandwidth-optimal reduce or broadcast moves."""
    return 4 * params * (replicas - 1) / replicas


def exchange_s(c: StageCost, machine: Machine, element_bytes: int) -> float:
    """One of stage ``c``'s two exchanges between replicas, alone on the node's network."""
    if machine.replicas == 1:
        return 0.0
    return exchanged_bytes(c.grad_bytes / element_bytes, machine.replicas) / machine.network_bps


def host_updates(home: list[float], adam: list[float], exchange: list[float], n: int,
                 resident: list[bool]) -> list[float]:
    """When each stage's host update is done.  Each worker's optimizer thread takes its stages one at
    a time in the order their gradients come home (backward order): with replicas, its gradients'
    sum over the network, AdamW on its share, the weights' broadcast.  The node's network carries
    one exchange at a time at its full rate, first come first served (as fair sharing finishes the
    last at the same time); a resident stage is updated on its device, done when "home"."""
    s_count = len(home)
    updated = list(home)
    mine = [[j for j in range(s_count - 1, -1, -1) if j % n == k and not resident[j]] for k in range(n)]
    # (ready, order, worker, position in its list, broadcast?) of the exchanges that may start
    waiting = [(home[m[0]], k, k, 0, False) for k, m in enumerate(mine) if m]
    heapq.heapify(waiting)
    network_free, order = 0.0, n
    while waiting:
        ready, _, k, i, broadcast = heapq.heappop(waiting)
        j = mine[k][i]
        done = max(ready, network_free) + exchange[j]
        network_free = done
        if not broadcast:
            heapq.heappush(waiting, (done + adam[j], order, k, i, True))
        else:
            updated[j] = done
            if i + 1 < len(mine[k]):
                heapq.heappush(waiting, (max(home[mine[k][i + 1]], done), order, k, i + 1, False))
        order += 1
    return updated


def stage_costs(profile: Profile, bounds: list[tuple[int, int]], recompute: bool = True,
                resident: tuple[int, ...] = (), kept: tuple[int, ...] = ()) -> list[StageCost]:
    """The stages of ``bounds``; those in ``resident`` stay on their device, updated there.  With
    ``recompute`` every stage but the last and those ``kept`` recomputes its forward in backward: the
    last (the head and its loss) runs each micro-batch's backward right after its forward
    (:mod:`mobius.stages.ops`), so it has nothing to recompute; a kept stage leaves every
    micro-batch's activations on its device for its backward, as every stage does without ``recompute``."""
    out = []
    for j, (lo, hi) in enumerate(bounds):
        recomputed = recompute and j < len(bounds) - 1 and j not in kept
        ls = profile.layers[lo:hi]
        s = sum(l.param_bytes for l in ls)
        g = sum(l.trained_bytes for l in ls)
        held = sum(l.held_bytes for l in ls)
        a_in = profile.layers[lo - 1].out_bytes if lo > 0 else 0
        a_out = ls[-1].out_bytes
        fwd = sum(l.fwd_s for l in ls)
        bwd = sum(l.bwd_s for l in ls) + (fwd if recomputed else 0.0)
        mem_f = s + max(l.fwd_work_bytes for l in ls) + 2 * a_in
        mem_b = s + g + held + sum(l.bwd_work_bytes for l in ls) + 2 * a_in + 2 * a_out
        out.append(StageCost(lo, hi, s, fwd, bwd, a_out, a_in, mem_f, mem_b, g, held, j in resident, recomputed))
    return out


def resident_by_slot(stages: list[StageCost], slots: int, element_bytes: int) -> list[int]:
    """Bytes each slot's resident stages hold for good."""
    out = [0] * slots
    for j, c in enumerate(stages):
        if c.resident:
            out[j % slots] += c.resident_bytes(element_bytes)
    return out


def activations_overflow(stages: list[StageCost], memory: list[float], micro_batches: int,
                         holding: list[int]) -> tuple[int, int] | None:
    """A slot holds what every forward of its ``holding`` stages (those that do not recompute) left
    for backward, for all micro-batches, beside its largest stage: (slot, bytes needed) where that
    exceeds the slot's ``memory`` (what its resident stages leave), else None."""
    n = len(memory)
    held = held_activations(stages, n, micro_batches, holding)
    for slot in range(min(n, len(stages))):
        need = max(c.pass_bytes(True) for c in stages[slot::n]) + held[slot]
        if need > memory[slot]:
            return slot, need
    return None


def held_activations(stages: list[StageCost], n: int, micro_batches: int, holding: list[int]) -> list[int]:
    """Per slot: the activations its ``holding`` stages keep for their backward, every micro-batch's
    (at the turn from forward to backward, all at once)."""
    out = [0] * n
    for j in holding:
        out[j % n] += micro_batches * stages[j].kept_bytes
    return out


def holding_stages(recompute: bool, kept: tuple[int, ...], count: int) -> list[int]:
    """The stages whose activations stay on their device from forward to backward: every stage
    without recomputation (the head's too: a bound), else the ``kept`` ones."""
    return list(range(count)) if not recompute else sorted(kept)


def host_traffic_bytes(stages: list[StageCost], micro_batches: int, slots: int) -> float:
    """Bytes a step moves between host and devices: each stage loaded for forward and again for
    backward (each slot's last stage stays), every boundary activation and its gradient down and
    up again (with recomputation the stage inputs go up once more), the gradients down."""
    k = len(stages)
    loads = sum(c.loaded_bytes for c in stages) + sum(c.loaded_bytes for c in stages[:max(0, k - slots)])
    activations = sum(2 * c.out_bytes for c in stages[:-1]) + sum(2 * c.in_bytes for c in stages[1:])
    again = sum(c.in_bytes for c in stages[1:] if c.recomputed)
    return loads + micro_batches * (activations + again) + sum(c.offloaded_bytes for c in stages)


def step_bounds(stages: list[StageCost], micro_batches: int, slots: int, pcie_bps: float,
                adam_params_per_s: float, element_bytes: int) -> dict[Lane, float]:
    """First principles: no step is shorter than any of its lanes' total work with every device
    of that lane busy: compute (spread over the GPUs), host<->device bytes (over the host's PCIe
    bandwidth), host AdamW (every worker's optimizer thread at once).  Seconds per lane."""
    compute = micro_batches * sum(c.fwd_s + c.bwd_s for c in stages) / slots
    params = sum(c.offloaded_bytes for c in stages) / element_bytes  # the resident stages update on their device
    return {Lane.COMPUTE: compute, Lane.PCIE: host_traffic_bytes(stages, micro_batches, slots) / pcie_bps,
            Lane.HOST_ADAM: params / (adam_params_per_s * slots)}


def recomputation_s(stages: list[StageCost], micro_batches: int, slots: int) -> float:
    """Of the compute floor: the forwards the recomputing stages run again in backward, spread over
    the GPUs (what the memory that forces recomputation costs)."""
    return micro_batches * sum(c.fwd_s for c in stages if c.recomputed) / slots


def replica_update_rate(adam_params_per_s: float, data_parallel: int, network_bps: float) -> float:
    """Parameters per second of a stage's update on one host's optimizer thread when ``data_parallel``
    replicas share it (:mod:`mobius.stages.replicas`): the fp32 gradients summed into their owners,
    AdamW on the 1/D the host owns, the fp32 weights broadcast back, one after the other.  Each sum
    and broadcast moves (D-1)/D of 4 bytes per parameter each way over the node's network; its
    latency, a few microseconds per tensor, is left out."""
    if data_parallel == 1:
        return adam_params_per_s
    network_s = 2 * exchanged_bytes(1, data_parallel) / network_bps
    return 1 / (1 / (adam_params_per_s * data_parallel) + network_s)


def human_bytes(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.2f} MB"


def check_layers_fit(profile: Profile, machine: Machine) -> None:
    """Infeasible input: a single layer (with its working memory) larger than the smallest GPU."""
    budget = min(machine.memory)
    for i in range(profile.n):
        c = stage_costs(profile, [(i, i + 1)])[0]
        need = max(c.mem_fwd, c.mem_bwd)
        if need > budget:
            raise InputError(f"layer {profile.layers[i].name} ({profile.layers[i].kind}) needs {human_bytes(need)} "
                             f"of device memory with its working memory, but the budget is {human_bytes(budget)}")


def evaluate(profile: Profile, bounds: list[tuple[int, int]], machine: Machine, micro_batches: int,
             recompute: bool = True, resident: tuple[int, ...] = (), kept: tuple[int, ...] = ()) -> StepEstimate:
    """Step time of the partition ``bounds`` (``[start, end)`` layer ranges, in order), with the
    stages ``resident`` kept on their devices and updated there: never loaded or offloaded, their
    weights, gradients and AdamW state taking their slot's memory for good, their update on the
    device (``g_j / (e · R_device)``) delaying the slot's next backward pass; with ``recompute``,
    the stages ``kept`` keep their activations instead.  Activations kept take their slot's memory
    from the prefetches as well."""
    n = machine.n
    elt = element_bytes(profile.dtype)
    compute_only = stage_costs(profile, bounds, recompute, resident, kept)
    st = on_device(compute_only, machine)
    held = resident_by_slot(st, n, elt)
    free = [machine.memory[k] - held[k] for k in range(n)]  # what the swapped stages share
    holding = holding_stages(recompute, kept, len(st))
    reason = _does_not_fit(st, held, free, n, micro_batches, holding)
    if reason:
        return StepEstimate(float("inf"), False, st, [], [], reason=reason)
    acts = held_activations(st, n, micro_batches, holding)
    s = _Schedule(st, machine, micro_batches, [free[j % n] - acts[j % n] for j in range(len(st))], elt)
    s.forward()
    s.backward()
    home = s.gradients_home()
    s.pass_copies(compute_only, home)
    adam = [0.0 if c.resident else adam_s(c, machine, elt, disk_bytes_per_param(machine, j, elt))
            for j, c in enumerate(st)]
    exchange = [0.0 if c.resident else exchange_s(c, machine, elt) for c in st]
    if machine.optimizer_lag:  # the updates leave the critical path; the gradients must still come home
        # each worker's optimizer, and the node's network for all of them
        per_thread = [sum(adam[j] + 2 * exchange[j] for j in range(k, len(st), n)) for k in range(n)]
        return StepEstimate(max(home + per_thread + [2 * sum(exchange)]), True, compute_only, s.pf, s.pb,
                            copies=s.copies)
    if machine.clip:  # every update waits for the global norm: the last gradient home, on any worker
        home = [max(home)] * len(st)
    updated = host_updates(home, adam, exchange, n, [c.resident for c in st])
    return StepEstimate(max(updated), True, compute_only, s.pf, s.pb, copies=s.copies)


def _does_not_fit(st: list[StageCost], held: list[int], free: list[int], n: int, micro_batches: int,
                  holding: list[int]) -> str:
    """Why the stages do not fit their slots' memory (each pass beside the resident stages and
    every micro-batch's saved activations of the ``holding`` stages), or ``""``."""
    for j, c in enumerate(st):
        need = max(c.pass_bytes(False), c.pass_bytes(True))
        if need > free[j % n]:
            beside = f" beside {human_bytes(held[j % n])} of resident stages" if held[j % n] else ""
            return f"stage {j} needs {human_bytes(need)} > {human_bytes(free[j % n])}{beside}"
    overflow = activations_overflow(st, free, micro_batches, holding) if holding else None
    if overflow:
        slot, need = overflow
        return (f"worker {slot} would hold {need / 2**20:.0f} MiB (its stages' saved activations for all "
                f"{micro_batches} micro-batches beside its largest stage) in a {free[slot] / 2**20:.0f} MiB budget")
    return ""


class _Schedule:
    """The step's event times (:func:`evaluate`): each stage's forward ``tf[j][m]`` and backward
    ``tb[j][m]`` start per micro-batch, the bytes prefetched ahead of each pass (``pf``, ``pb``), and
    the host<->device copies of the schedule (``copies``: slot, direction, start, end, kind)."""

    def __init__(self, st: list[StageCost], machine: Machine, micro_batches: int, mem: list[int], elt: int):
        self.st, self.machine, self.M, self.mem = st, machine, micro_batches, mem
        n, count = machine.n, len(st)
        self.n, self.count = n, count
        self.bw = [machine.bandwidth[j % n] for j in range(count)]
        for j in machine.weights_on_disk:  # read whole from the drives, then copied: the times add
            self.bw[j] = 1 / (1 / self.bw[j] + machine.disk_read_s_per_byte)
        self.device_adam = [c.grad_bytes / elt / machine.device_adam_params_per_s if c.resident else 0.0 for c in st]
        self.handoff = machine.handoff_s if n > 1 else 0.0
        self.tf = [[0.0] * micro_batches for _ in range(count)]
        self.tb = [[0.0] * micro_batches for _ in range(count)]
        self.pf, self.pb = [0.0] * count, [0.0] * count
        self.copies: list[tuple[int, str, float, float, str]] = []

    def _load(self, j: int, span_start: float, span: float, released: float, after: StageCost,
              backward: bool) -> float:
        """Stage ``j``'s load while the slot's previous pass (of ``after``, ``span`` long from
        ``span_start``, released at ``released``) runs: what fits is prefetched, the rest follows
        the release.  Returns when the stage is ready; records the prefetched bytes and the copies."""
        c, bw = self.st[j], self.bw[j]
        ahead = (max(0.0, min(c.loaded_bytes, self.mem[j] - after.pass_bytes(backward), bw * span))
                 if self.machine.prefetch else 0.0)
        (self.pb if backward else self.pf)[j] = ahead
        ready = released + (c.loaded_bytes - ahead) / bw
        # The prefetch starts with the previous stage's pass, the rest once it is released.
        self.copies += [(j % self.n, "h2d", span_start, span_start + ahead / bw, "load"),
                        (j % self.n, "h2d", released, ready, "load")]
        return max(ready, released + self.machine.stage_switch_s)

    def forward(self) -> None:
        st, n, tf, tb, machine = self.st, self.n, self.tf, self.tb, self.machine
        last = self.count - 1
        first = [float(c.loaded_bytes) for c in st[:n]]
        for j, c in enumerate(st):
            if j < n:
                ready = machine.first_load_s(j, first) + (
                    c.loaded_bytes * machine.disk_read_s_per_byte if j in machine.weights_on_disk else 0.0)
                self.copies.append((j, "h2d", 0.0, ready, "load"))
                ready = max(ready, machine.stage_switch_s)
            else:
                prev = st[j - n]
                ready = self._load(j, tf[j - n][0], prev.fwd_s + tf[j - n][-1] - tf[j - n][0],
                                   tf[j - n][-1] + prev.fwd_s, prev, backward=False)
            # The activation: to the host and handed off (its upload is on the compute stream).
            arrives = st[j - 1].out_bytes / machine.forward_d2h_bps((j - 1) % n) + self.handoff if j else 0.0
            for m in range(self.M):
                t = ready
                if m:  # the last stage runs each micro-batch's backward right after its forward
                    t = max(t, tb[j][m - 1] + c.bwd_s if j == last else tf[j][m - 1] + c.fwd_s)
                if j:
                    t = max(t, tf[j - 1][m] + st[j - 1].fwd_s + arrives)
                tf[j][m] = t
                if j == last:
                    tb[j][m] = t + c.fwd_s

    def backward(self) -> None:
        st, n, tf, tb, machine, count = self.st, self.n, self.tf, self.tb, self.machine, self.count
        for j in range(count - 2, -1, -1):
            c = st[j]
            if j >= count - n:  # still resident from its forward pass
                ready = tf[j][-1] + c.fwd_s + machine.stage_switch_s
            else:
                nxt = st[j + n]
                ready = self._load(j, tb[j + n][0], nxt.bwd_s + tb[j + n][-1] - tb[j + n][0],
                                   tb[j + n][-1] + nxt.bwd_s + self.device_adam[j + n], nxt, backward=True)
            returns = c.out_bytes / machine.backward_d2h_bps((j + 1) % n) if j < count - 1 else 0.0
            for m in range(self.M):
                t = ready
                if m:
                    t = max(t, tb[j][m - 1] + c.bwd_s)
                if j < count - 1:
                    t = max(t, tb[j + 1][m] + st[j + 1].bwd_s + returns + self.handoff)
                tb[j][m] = t

    def gradients_home(self) -> list[float]:
        """When each stage's gradients are on the host: they leave once its backward is done,
        through its link; the offloads of the GPUs under one root complex queue for its bandwidth
        in backward order.  A resident stage's are "home" once its device has updated it."""
        st, machine, count = self.st, self.machine, self.count
        home = [0.0] * count
        for j in range(count - 1, -1, -1):
            c = st[j]
            home[j] = self.tb[j][-1] + c.bwd_s + self.device_adam[j] + c.offloaded_bytes / machine.link_bps(j % self.n)
            q = machine.previous_on_root_complex(j, count)
            while q is not None and st[q].resident:  # no offload of its own to queue behind
                q = machine.previous_on_root_complex(q, count)
            if q is not None and not c.resident:
                home[j] = max(home[j], home[q] + c.grad_bytes / machine.rc_bps(j % self.n))
        return home

    def pass_copies(self, compute_only: list[StageCost], home: list[float]) -> None:
        """The copies each micro-batch's passes issue (uploads, activations and their gradients),
        and each stage's gradients home: a stage's copies of one kind for all its micro-batches at
        once (a kind's copies of a slot stay in stage, then micro-batch, order)."""
        machine, st = self.machine, self.st
        for j, c in enumerate(compute_only):
            k = j % self.n
            up_f, up_b = c.in_bytes, c.out_bytes + (c.in_bytes if c.recomputed else 0)
            tf, tb = np.asarray(self.tf[j]), np.asarray(self.tb[j])
            runs = []
            if up_f:
                runs.append(("h2d", tf, tf + up_f / machine.upload_bps(k), "upload"))
            if up_b:
                runs.append(("h2d", tb, tb + up_b / machine.upload_backward_bps(k), "upload backward"))
            if j + 1 < self.count:
                a = tf + st[j].fwd_s
                runs.append(("d2h", a, a + c.out_bytes / machine.forward_d2h_bps(k), "activation"))
            if j and c.in_bytes:
                a = tb + st[j].bwd_s
                runs.append(("d2h", a, a + c.in_bytes / machine.backward_d2h_bps(k), "activation gradient"))
            for d, starts, ends, kind in runs:
                self.copies.extend(zip(repeat(k), repeat(d), starts.tolist(), ends.tolist(), repeat(kind)))
            self.copies.append((k, "d2h", home[j] - c.offloaded_bytes / machine.link_bps(k), home[j], "gradients"))


# The runtime's stream of each kind of copy: copies of one GPU on one stream run one after another,
# they do not share its link (mobius.stages: compute, h2d-params, d2h-activations, d2h-gradients).
STREAM_OF = {"upload": "compute", "upload backward": "compute", "load": "params", "activation": "activations",
             "activation gradient": "activations", "gradients": "gradients"}


class _Overlap:
    """Sum over a set of intervals of their overlap with any ``[a, b]``, in O(log n): the integral of
    how many intervals cover t is F(t) = sum over starts before t of (t - start) less the same over
    ends, read off sorted starts and ends and their prefix sums (summed in order)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        self.starts, self.ends = np.sort(starts), np.sort(ends)
        self.start_sums, self.end_sums = _prefix(self.starts), _prefix(self.ends)

    def with_each(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The overlap with each ``[a[i], b[i]]``, all at once."""
        return self._integral(b) - self._integral(a)

    def _integral(self, t: np.ndarray) -> np.ndarray:
        i, j = np.searchsorted(self.starts, t, side="left"), np.searchsorted(self.ends, t, side="left")
        return (t * i - self.start_sums[i]) - (t * j - self.end_sums[j])


def _prefix(xs: np.ndarray) -> np.ndarray:
    """0 and the running sums of ``xs``, each the sum of those before it in order."""
    return np.concatenate([[0.0], np.cumsum(xs)])


def copy_rates(machine: Machine, est: StepEstimate) -> dict[str, tuple[float, ...]]:
    """Per slot, bytes/s of its forward and backward compute-stream uploads, forward activations and
    backward activation gradients beside the other copies of ``est``'s schedule: PCIe (and
    --emulate) shares a link fairly among its copies of one direction, and a root complex among
    the copies of all its GPUs.  A copy counts each other copy of its direction by the fraction of
    its span they overlap (those on its own stream queue instead); a slot's rate is the mean over
    its copies, by time (their sums taken in the schedule's order)."""
    n = machine.n
    link = [machine.link_bps(k) for k in range(n)]
    names = ("upload", "upload_backward", "d2h_forward", "d2h_backward")
    if not est.copies:
        return {name: tuple(link) for name in names}
    slot_of, direction, start, end, kind_of = (np.asarray(x) for x in zip(*est.copies))
    real = end > start
    kinds, inverse = np.unique(kind_of, return_inverse=True)
    stream_of = np.asarray([STREAM_OF[k] for k in kinds.tolist()])[inverse]
    overlap, streams = {}, {"h2d": set(), "d2h": set()}
    for d in ("h2d", "d2h"):
        mine = real & (direction == d)
        for slot in range(n):
            here = mine & (slot_of == slot)
            for s in sorted(set(stream_of[here].tolist())):
                group = here & (stream_of == s)
                overlap[d, slot, s] = _Overlap(start[group], end[group])
                streams[d].add(s)
    out = {}
    for kind, d, name in zip(("upload", "upload backward", "activation", "activation gradient"),
                             ("h2d", "h2d", "d2h", "d2h"), names):
        ideal, slowed = [0.0] * n, [0.0] * n
        mine = STREAM_OF[kind]
        of_kind = real & (kind_of == kind)
        for slot in range(n):
            here = of_kind & (slot_of == slot)
            if not here.any():
                continue
            a, b = start[here], end[here]
            # Each copy's overlap with the slot's other streams and with its root complex's other
            # slots (summed in the order the streams come).
            own, others = np.zeros(len(a)), np.zeros(len(a))
            for s in sorted(streams[d]):
                if s != mine and (d, slot, s) in overlap:
                    own += overlap[d, slot, s].with_each(a, b)
            for s2 in machine.root_complex_slots(slot):
                for s in sorted(streams[d]):
                    if s2 != slot and (d, s2, s) in overlap:
                        others += overlap[d, s2, s].with_each(a, b)
            span = b - a
            shared = (1 + (own + others) / span) * link[slot] / machine.rc_bps(slot)
            slowdown = np.maximum(np.maximum(1 + own / span, shared), 1.0)
            ideal[slot] = float(np.cumsum(span)[-1])
            slowed[slot] = float(np.cumsum(span * slowdown)[-1])
        out[name] = tuple(link[k] * ideal[k] / slowed[k] if slowed[k] else link[k] for k in range(n))
    return out


def settle(profile: Profile, bounds: list[tuple[int, int]], topo, mapping, micro_batches: int, recompute: bool,
           prefetch: bool = True, host: HostCosts | None = None, optimizer_lag: int = 0,
           rounds: int = 2, resident: tuple[int, ...] = (), clip: bool = False,
           kept: tuple[int, ...] = ()) -> tuple[Machine, StepEstimate]:
    """The machine and step of ``bounds`` (with ``resident`` stages, and ``kept`` ones) under the
    contention of their own schedule: the schedule's copies decide the rates its copies get,
    ``rounds`` times."""
    machine = machine_for(topo, mapping, prefetch, host, optimizer_lag, clip=clip)
    est = evaluate(profile, bounds, machine, micro_batches, recompute, resident, kept)
    for _ in range(rounds):
        if not est.feasible:
            break
        duty = link_duty(profile, bounds, machine, micro_batches, recompute, est.step_s, resident, kept)
        rates = copy_rates(machine, est)
        machine = machine_for(topo, mapping, prefetch, host, optimizer_lag, duty, rates=rates, clip=clip)
        est = evaluate(profile, bounds, machine, micro_batches, recompute, resident, kept)
    # A root complex whose slots' copies of a step, together, outlast the step carries them at its
    # full bandwidth all along: its links are busy the whole step (duty 1), however little of the
    # step each would be busy alone at its own link's speed.  (Duties from the links alone let four
    # GPUs that each copy for a quarter of the step share a root complex as if a quarter busy, and a
    # plan mostly of swapping stages came out below its own PCIe floor.)
    if not est.feasible:
        return machine, est
    carried = link_bytes(profile, bounds, machine.n, micro_batches, recompute, resident, kept)
    saturated = [sum(carried[p] for p in machine.root_complex_slots(k)) > est.step_s * machine.rc_bps(k)
                 for k in range(machine.n)]
    if any(saturated):
        duty = tuple(1.0 if full else d for full, d in zip(saturated, _duty(carried, machine, est.step_s)))
        machine = machine_for(topo, mapping, prefetch, host, optimizer_lag, duty, rates=copy_rates(machine, est),
                              clip=clip)
        est = evaluate(profile, bounds, machine, micro_batches, recompute, resident, kept)
    return machine, est


def link_duty(profile: Profile, bounds: list[tuple[int, int]], machine: Machine, micro_batches: int,
              recompute: bool, step_s: float, resident: tuple[int, ...] = (),
              kept: tuple[int, ...] = ()) -> tuple[float, ...]:
    """Per slot: the fraction of a ``step_s`` step its link carries host -> device copies (stage loads,
    inputs, output gradients, recompute inputs) of the partition ``bounds``, at its link's speed."""
    return _duty(link_bytes(profile, bounds, machine.n, micro_batches, recompute, resident, kept), machine, step_s)


def _duty(carried: list[float], machine: Machine, step_s: float) -> tuple[float, ...]:
    """Per slot: the fraction of ``step_s`` its link takes to carry ``carried`` bytes at its own speed."""
    return tuple(min(1.0, b / machine.link_bps(k) / max(step_s, 1e-12)) for k, b in enumerate(carried))


def link_bytes(profile: Profile, bounds: list[tuple[int, int]], n: int, micro_batches: int, recompute: bool,
               resident: tuple[int, ...] = (), kept: tuple[int, ...] = ()) -> list[float]:
    """Per slot of ``n``: the host -> device bytes of a step of the partition ``bounds``."""
    carried = [0.0] * n
    st = stage_costs(profile, bounds, recompute, resident, kept)
    for j, c in enumerate(st):
        loads = c.loaded_bytes * (1 if j >= len(st) - n else 2)  # the last stages stay for backward
        acts = micro_batches * (c.in_bytes + c.out_bytes + (c.in_bytes if c.recomputed else 0))
        carried[j % n] += loads + acts
    return carried


def machine_for(topo, mapping, prefetch: bool = True, host: "HostCosts | None" = None,
                optimizer_lag: int = 0, duty: tuple[float, ...] | None = None,
                rates: dict[str, tuple[float, ...]] | None = None, clip: bool = False) -> Machine:
    """Per-slot bandwidth and memory of a mapped topology.

    A GPU's expected bandwidth for its stage loads is its share of its root complex among the other
    GPUs under it, each counted by the fraction of the step its link is busy (``duty``,
    :func:`link_duty`; default 1: always): two GPUs that copy a fifth of the time each do not halve
    each other's bandwidth.  Every GPU under the root complex counts, not only those of the
    neighbouring slots: every slot loads its next stage while it computes, all in the same phase of
    the step, and a load outlasts several hops of the pipeline (--emulate measured it: a load met
    the slot two away as often as the neighbour).  So mapping does not spare the loads; cross
    mapping spares the copies on the critical path between neighbouring stages, whose rates
    (``rates``, :func:`copy_rates`, as :class:`Machine` field names) come from the schedule.
    (Counting only the neighbours, the model predicted cross over sequential mapping at +17.1% on
    8x3090-4+4 and +8.3% on topo2+2, where the runtime measured +13.3% and +2.9%.)
    """
    n = topo.n
    bws, mems = [], []
    for k in range(n):
        g = mapping.order[k]
        rc = topo.root_complex_of(g)
        concurrent = 1 + sum(duty[slot] if duty else 1.0 for slot in range(n)
                             if slot != k and topo.root_complex_of(mapping.order[slot]) == rc)
        bws.append(topo.host_bandwidth_share(g, concurrent) * GB)
        mems.append(int(topo.gpus[g].memory_gb * GB))
    rc_of = [topo.root_complex_of(mapping.order[k]) for k in range(n)]
    host = host or HostCosts()
    return Machine(tuple(bws), tuple(mems), prefetch, host.handoff_s, host.micro_batch_s, host.stage_switch_s,
                   host.adam_params_per_s, host.device_adam_params_per_s, host.replicas, host.network_bps,
                   optimizer_lag, clip,
                   link=tuple(topo.gpus[mapping.order[k]].link_bandwidth_gbps * GB for k in range(n)),
                   first_wave_peers=tuple(tuple(i for i in range(n) if rc_of[i] == rc_of[k]) for k in range(n)),
                   rc_bandwidth=tuple(topo.rc(rc_of[k]).host_bandwidth_gbps * GB for k in range(n)),
                   **(rates or {}))
