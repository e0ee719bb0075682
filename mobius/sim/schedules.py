"""One training step of Mobius and of its baselines, as task graphs for :mod:`mobius.sim.engine`.

All use the same profile and topology:

* :func:`simulate_mobius`: the pipeline of ``mobius.stages.executor``, replaying each worker's
  operations (:func:`mobius.stages.ops.worker_ops`, the executor's own list).  Stage loads are split
  into the part that fits beside the running stage (prefetched once that stage is loaded) and the
  rest (copied once it is done).  Activations go device -> host -> device through both root
  complexes.  Stage inputs are re-uploaded for recomputation, gradients are offloaded after a
  stage's backward, and AdamW runs on the CPU.
* :func:`simulate_gpipe`: every stage resident (N stages, time-balanced), GPU optimizer; out of
  memory is reported, not simulated.
* :func:`simulate_zero3_offload`: DeepSpeed ZeRO-3 with parameter and optimizer offload, data
  parallel over the N GPUs.  Per layer, every GPU fetches the fp16 parameters from host memory,
  in forward and again in backward, with one layer of lookahead.  Activation checkpoints go to host
  and come back.  Full fp16 gradients go to host for the reduce, and CPU Adam updates each GPU's
  1/N share at the end.  This is the traffic of Mobius Eq. 2 (about 1.5·N times the fp32 model
  size) and ZeRO-Infinity §6.
* :func:`simulate_zero_infinity`: the same with the optimizer state (and, where the host cannot
  hold them, the parameters) on the box's drives, a forward and backward per micro-batch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from mobius.models.precision import element_bytes
from mobius.partition.baselines import balanced_bounds
from mobius.partition.cost import exchanged_bytes, held_activations, holding_stages, resident_by_slot, stage_costs
from mobius.partition.profile import ANALYTIC_ADAM_PARAMS_PER_S, Profile
from mobius.sim.engine import COMPUTE, CPU, D2H, DELAY, DISK_READ, DISK_WRITE, H2D, NET, SimResult, Simulator, link_for
from mobius.stages import ops
from mobius.stages.ops import Op, worker_ops

# GPU HBM bandwidth for GPipe's on-device optimizer step (bytes/s); 3090 Ti: ~1 TB/s.
GPU_HBM_BPS = 0.9e12


@dataclass
class SimOutcome:
    name: str
    step_s: float
    oom: bool = False
    reason: str = ""
    result: SimResult | None = None

    @property
    def traffic_bytes(self) -> float:
        return self.result.total_bytes() if self.result else 0.0


def simulate_mobius(profile: Profile, bounds: list[tuple[int, int]], topo, order: list[int], micro_batches: int,
                    recompute: bool = True, adam_params_per_s: float | None = None,
                    memory_bytes: list[int] | None = None, optimizer_lag: int = 0,
                    prefetch: bool = True, kept: tuple[int, ...] = (), clip: bool = False,
                    resident: tuple[int, ...] = (), device_adam_params_per_s: float = math.inf) -> SimOutcome:
    """One step of the Mobius pipeline as the runtime issues it, on its streams.  A stage's input (in
    backward its output gradient, and with recomputation its input again) is copied to the device
    on the compute stream, so it occupies the device before the compute, sharing the link and the
    root complex with the copies in flight (a recomputation runs before its output gradient is
    awaited); parameters arrive on a copy stream of their own; activations and gradients leave on
    copy streams of their own, sharing the link while both are in flight; an activation
    reaches the next worker ``profile.host.handoff_s`` after it reached the host.  AdamW runs at
    ``adam_params_per_s`` (default: the profile's host rate); with data-parallel replicas
    (``profile.host.replicas``) on 1/D of each stage, between the sum of its gradients and the
    broadcast of its weights, which share the node's network.  With ``optimizer_lag`` the CPU
    updates of a step run on while the next step computes (:func:`lagged_step_s`).  Without
    ``prefetch`` a stage's load starts once the previous one is done.  With ``recompute``, the
    stages ``kept`` keep their activations instead; kept activations take memory from the prefetches.
    With ``clip`` every update waits for the step's last gradients (the global norm); the step ends
    with the last of them (as the cost model's, :func:`mobius.partition.cost.evaluate`).  The stages
    ``resident`` stay on their GPUs with their optimizer state, never loaded or offloaded, and are
    updated there after their last backward, at ``device_adam_params_per_s``, before that GPU's
    next pass."""
    st = stage_costs(profile, bounds, recompute, resident=resident, kept=kept)
    gpu = [order[j % len(order)] for j in range(len(bounds))]
    mem = list(memory_bytes or [int(g.memory_gb * 1e9) for g in topo.gpus])
    held_for_good = resident_by_slot(st, len(order), element_bytes(profile.dtype))
    for slot, held in enumerate(held_activations(st, len(order), micro_batches,
                                                 holding_stages(recompute, kept, len(st)))):
        mem[order[slot]] -= held + held_for_good[slot]
    for j, c in enumerate(st):
        need = max(c.pass_bytes(False), c.pass_bytes(True))
        if need > mem[gpu[j]]:
            return SimOutcome("mobius", math.inf, oom=True, reason=f"stage {j} needs {need / 1e9:.1f} GB")
    step = _BoundStep(profile, st, topo, len(order), gpu, mem, micro_batches,
                      adam_params_per_s or profile.host.adam_params_per_s, prefetch, clip, device_adam_params_per_s)
    step.replay([worker_ops(len(st), [j for j in range(len(st)) if j % len(order) == slot], micro_batches, recompute,
                            prefetch, resident=frozenset(resident), kept=frozenset(kept))
                 for slot in range(len(order))])
    r = step.sim.run()
    return SimOutcome("mobius", lagged_step_s(r, profile.host) if optimizer_lag else r.step_s, result=r)


def lagged_step_s(r: SimResult, host) -> float:
    """The step with ``--optimizer-lag 1``: the next one starts loading once the GPUs' last compute
    is done (it reads the updates of the step before), while the gradients still leave, so it ends
    with its compute and weight loads, unless a GPU's outgoing copies, a worker's optimizer thread
    (its AdamW, and its exchanges alone on the network) or the network need longer than that."""
    device_end = max((t.end for t in r.tasks if t.kind in (COMPUTE, H2D)), default=0.0)
    outgoing: dict[int, list[tuple[float, float]]] = {}
    optimizer_busy: dict[int, float] = {}
    for t in r.tasks:
        if t.kind == D2H:
            outgoing.setdefault(t.gpu, []).append((t.start, t.end))
        elif t.kind in (CPU, NET):
            optimizer_busy[t.gpu] = optimizer_busy.get(t.gpu, 0.0) + (t.work if t.kind == CPU else
                                                                      t.work / host.network_bps)
    network = sum(t.work for t in r.tasks if t.kind == NET) / host.network_bps if host.replicas > 1 else 0.0
    return max(device_end, network, *optimizer_busy.values(), *map(_covered, outgoing.values()), 0.0)


def _covered(spans: list[tuple[float, float]]) -> float:
    """How long at least one of ``spans`` runs."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


class _BoundStep:
    """The task graph of one bound step (:func:`simulate_mobius`): each worker's operations as the
    runtime performs them (:func:`mobius.stages.ops.worker_ops`, the executor's own list), stage
    ``j`` on GPU ``gpu[j]`` for the whole step, ``n`` GPUs; ``F`` and ``B`` hold each stage's and
    micro-batch's compute."""

    def __init__(self, profile: Profile, st: list, topo, n: int, gpu: list[int], mem: list[int],
                 micro_batches: int, adam_params_per_s: float, prefetch: bool, clip: bool = False,
                 device_adam_params_per_s: float = math.inf):
        self.profile, self.st, self.n, self.gpu, self.mem = profile, st, n, gpu, mem
        self.clip, self.device_adam_params_per_s = clip, device_adam_params_per_s
        self.M, self.S = micro_batches, len(st)
        self.host, self.adam_params_per_s, self.prefetch = profile.host, adam_params_per_s, prefetch
        self.link = replace(link_for(topo), network_bw=profile.host.network_bps)
        self.sim = Simulator(self.link)
        self.F = [[None] * micro_batches for _ in st]
        self.B = [[None] * micro_batches for _ in st]
        self.loads: dict[tuple[int, bool], list[int]] = {}  # (stage, backward) -> its load's parts
        self.arrived: dict[tuple[int, int, bool], int] = {}  # RECV's key -> the hand-off that brings it
        self.optimizer: dict[int, int] = {}  # with replicas: each optimizer thread's last exchange
        self.computed: dict[int, int] = {}  # GPU -> its last compute so far (tasks are added in each GPU's order)
        self.offloads: dict[int, int] = {}  # stage -> its gradients' copy home

    def replay(self, ops_of_slot: list[list[Op]]) -> None:
        """Every slot's operations as tasks, each slot's in its order, as the executor performs them
        (an ``_op_*`` method each); a slot waits at a ``RECV`` until the operation that sends it has
        been added (the pipeline's own order of hand-offs); with ``clip``, every update after the
        step's last gradients (the global norm)."""
        perform = {ops.LOAD: self._load, ops.WAIT: self._op_wait, ops.RECV: _nothing, ops.COMPUTE: self._op_compute,
                   ops.RECOMPUTE: self._op_recompute, ops.SEND: self._op_send, ops.END: self._op_end,
                   ops.OFFLOAD: self._op_offload, ops.UPDATE: self._op_offload, ops.RELEASE: _nothing}
        state = [_SlotState() for _ in ops_of_slot]
        left = [deque(listed) for listed in ops_of_slot]
        while any(left):
            stuck = True
            for slot, queue in enumerate(left):
                while queue and (queue[0].kind != ops.RECV or (queue[0].stage, queue[0].mb, queue[0].backward)
                                 in self.arrived):
                    op = queue.popleft()
                    perform[op.kind](op, state[slot])
                    stuck = False
            if stuck:
                raise ValueError("the workers' operations wait for each other")
        if self.clip:  # the global norm needs every gradient; then each thread's stages in backward order
            norm = self.sim.add("global norm", DELAY, 0, 0.0, tuple(self.offloads.values()))
            for j in range(self.S - 1, -1, -1):
                self.update(j, norm, self._priority(j, True))

    def _priority(self, j: int, backward: bool) -> int:
        """Stage ``j``'s transfers: forward in stage order, then backward in reverse stage order."""
        return self.S + (self.S - 1 - j) if backward else j

    def _op_wait(self, op: Op, at: "_SlotState") -> None:
        """The runtime's work between two passes, after the GPU's previous one."""
        j, back, g = op.stage, op.backward, self.gpu[op.stage]
        at.weights = self.loads.get((j, back), [])
        # The stage's weights are in: its load this pass, or (kept from its forward) that forward's
        # end; the head's forwards run in this pass, so the next stage's prefetch waits for its last.
        at.weights_in = at.weights[-1] if at.weights else _AT_END if j == self.S - 1 else self.computed.get(g)
        at.begin = self.computed[g] = self.sim.add(f"{'B' if back else 'F'} switch S{j}", COMPUTE, g,
                                                   self.host.stage_switch_s, (self.computed.get(g),))
        if j == self.S - 1:  # the head: loaded for its forward, which runs with its backward
            at.weights = self.loads.get((j, False), [])

    def _op_compute(self, op: Op, at: "_SlotState") -> None:
        j, m, c, head = op.stage, op.mb, self.st[op.stage], op.stage == self.S - 1
        if not op.backward:  # the head's after the backward of the micro-batch before
            before = self.B[j][m - 1] if head and m else None
            deps = [*at.weights, at.begin, self.arrived.pop((j, m, False), None), before]
            self.F[j][m] = self.compute(f"F{j}.{m}", j, c.in_bytes, c.fwd_s, deps)
            return
        deps = [at.recomputed] if c.recomputed else [*at.weights, at.begin]
        self.B[j][m] = self.compute(f"B{j}.{m}", j, c.out_bytes, c.bwd_s - (c.fwd_s if c.recomputed else 0.0),
                                    [*deps, self.F[j][m] if head else self.arrived.pop((j, m, True))])

    def _op_recompute(self, op: Op, at: "_SlotState") -> None:
        c = self.st[op.stage]
        at.recomputed = self.compute(f"R{op.stage}.{op.mb}", op.stage, c.in_bytes, c.fwd_s, [*at.weights, at.begin])

    def _op_send(self, op: Op, at: "_SlotState") -> None:
        """To the next stage's worker through the host (an input gradient: to the previous one's)."""
        j, m, back, c = op.stage, op.mb, op.backward, self.st[op.stage]
        to, size, done = (j - 1, c.in_bytes, self.B[j][m]) if back else (j + 1, c.out_bytes, self.F[j][m])
        what = f"{'grad' if back else 'act'} S{j}.{m}"
        out = self.sim.add(f"{what} to host", D2H, self.gpu[j], size, (done,), self._priority(j, back) + 1,
                           "activations")
        self.arrived[(to, m, back)] = self.sim.add(f"{what} to S{to}", DELAY, self.gpu[to], self.host.handoff_s, (out,))

    def _op_end(self, op: Op, at: "_SlotState") -> None:
        j = op.stage
        at.ended = (self.B if op.backward else self.F)[j][self.M - 1]
        if at.weights_in is _AT_END:
            at.weights_in = self.F[j][self.M - 1]
        pending, at.pending = at.pending, None
        if isinstance(pending, Op):  # issued during the head's pass: now, all of it
            self._load(pending, at)
            pending, at.pending = at.pending, None
        if pending is not None:  # the rest of the next stage's weights, once this one is done
            self._load_rest(*pending, at.ended)

    def _op_offload(self, op: Op, at: "_SlotState") -> None:
        """Its gradients home and its update (a resident stage's ``UPDATE``: on its GPU)."""
        j, prio = op.stage, self._priority(op.stage, True)
        self.offloads[j] = self.sim.add(f"grads S{j} to host", D2H, self.gpu[j], self.st[j].offloaded_bytes,
                                        (self.B[j][self.M - 1],), prio, "gradients")
        if not self.clip:
            self.update(j, self.offloads[j], prio)

    def _load(self, op: Op, at: "_SlotState") -> None:
        """Stage ``op.stage``'s weights, in the runtime's order of loads (``op.priority``): a slot's
        first stage whole; a later one, what fits beside the running stage once that stage's
        weights are in, the rest once that stage is done (at its ``END``; at once where the load is
        issued after it, without ``prefetch``)."""
        if at.weights_in is _AT_END:  # issued during the head's pass: once its last forward is done
            at.pending = op
            return
        j, back = op.stage, op.backward
        self.loads[(j, back)] = []
        size = self.st[j].loaded_bytes
        if at.weights_in is None:
            self._load_part(op, size, ())
            return
        room = self.mem[self.gpu[j]] - self.st[j + self.n if back else j - self.n].pass_bytes(back)
        first = self._load_part(op, max(0.0, min(size, room)) if self.prefetch else 0.0, (at.weights_in,),
                                " (prefetch)")
        if self.prefetch:
            at.pending = (op, first)
        else:
            self._load_rest(op, first, at.ended)

    def _load_rest(self, op: Op, first: int, running_done: int) -> None:
        self._load_part(op, self.st[op.stage].loaded_bytes - self.sim.tasks[first].work, (first, running_done))

    def _load_part(self, op: Op, size: float, deps: tuple, what: str = "") -> int:
        j, back = op.stage, op.backward
        self.loads[(j, back)].append(self.sim.add(f"{'B' if back else 'F'} load S{j}{what}", H2D, self.gpu[j], size,
                                                  deps, op.priority, "params"))
        return self.loads[(j, back)][-1]

    def compute(self, name: str, j: int, upload_bytes: float, work: float, deps: list) -> int:
        """The stage inputs' upload, then the compute and the runtime's fixed per-micro-batch work of
        the pass.  The runtime issues the upload on the compute stream, so it starts after the
        GPU's compute before it; it shares the GPU's link and root complex with the weights
        streaming in meanwhile (timed at the link's full rate, it made every pass under contention
        shorter than the runtime's: the bound step 5-9% short on emulated boxes)."""
        g = self.gpu[j]
        if upload_bytes:
            deps = [self.sim.add(f"{name} inputs in", H2D, g, upload_bytes, (*deps, self.computed.get(g)), 0,
                                 "activations")]
        self.computed[g] = self.sim.add(name, COMPUTE, g, work + self.host.micro_batch_s, deps)
        return self.computed[g]

    def update(self, j: int, offloaded: int, prio: int) -> None:
        """Stage ``j``'s AdamW on the host once its gradients are there; with replicas, the
        optimizer thread's sum into the owners, AdamW on this host's share, and the broadcast.  A
        resident stage's runs on its GPU, between that GPU's passes."""
        st, host, sim, g = self.st, self.host, self.sim, self.gpu[j]
        params = st[j].grad_bytes / element_bytes(self.profile.dtype)
        if st[j].resident:
            self.computed[g] = sim.add(f"AdamW S{j} on GPU {g}", COMPUTE, g, params / self.device_adam_params_per_s,
                                       (offloaded, self.computed.get(g)))
            return
        adam = params / host.replicas / self.adam_params_per_s
        if host.replicas == 1:
            sim.add(f"AdamW S{j}", CPU, g, adam, (offloaded,))
            return
        exchanged = exchanged_bytes(st[j].grad_bytes / element_bytes(self.profile.dtype), host.replicas)
        summed = sim.add(f"sum S{j}", NET, g, exchanged, (offloaded, self.optimizer.get(g)), prio, "network")
        updated = sim.add(f"AdamW S{j}", CPU, g, adam, (summed,))
        self.optimizer[g] = sim.add(f"broadcast S{j}", NET, g, exchanged, (updated,), prio, "network")


_AT_END = object()  # a stage's weights count as in once its pass's last forward is done (the head's)


def _nothing(op: Op, at: "_SlotState") -> None:
    """An operation with no task of its own (a receive is its sender's hand-off; a release frees memory)."""


@dataclass
class _SlotState:
    """What one slot's operations hand each other while they are replayed."""

    weights: list = field(default_factory=list)  # the running stage's load (its parts)
    weights_in: int | object | None = None  # the running stage's weights are in (None: no stage yet)
    begin: int | None = None  # the running pass's switch
    ended: int | None = None  # the last pass's last compute
    recomputed: int | None = None  # the micro-batch's recomputed forward
    # the next stage's load that waits for the running stage: (its LOAD, its prefetch) for its rest,
    # or the whole LOAD (issued in the head's pass)
    pending: tuple | Op | None = None


def simulate_gpipe(profile: Profile, topo, micro_batches: int, recompute: bool = True) -> SimOutcome:
    n, M = topo.n, micro_batches
    costs = [l.fwd_s + l.bwd_s for l in profile.layers]
    bounds = balanced_bounds(costs, n)
    st = stage_costs(profile, bounds, recompute)
    elt = element_bytes(profile.dtype)
    for j, c in enumerate(st):
        params = c.param_bytes / elt
        # fp16 weights + fp16 grads + fp32 master, m, v (mixed precision: 16 B/param), the stashed
        # stage inputs of all micro-batches, one micro-batch's working memory.
        need = 16 * params + M * c.in_bytes + (c.mem_bwd - 2 * c.param_bytes)
        if need > topo.gpus[j].memory_gb * 1e9:
            return SimOutcome("gpipe", math.inf, oom=True,
                              reason=f"stage {j} needs {need / 1e9:.1f} GB > {topo.gpus[j].memory_gb:g} GB")
    sim = Simulator(link_for(topo))
    F = [[None] * M for _ in range(n)]
    B = [[None] * M for _ in range(n)]
    for j in range(n):
        for m in range(M):
            deps = [F[j][m - 1]] if m else []
            if j:
                out = sim.add(f"act {j - 1}.{m}", D2H, j - 1, st[j - 1].out_bytes, (F[j - 1][m],), j)
                deps.append(sim.add(f"act {j - 1}.{m} in", H2D, j, st[j - 1].out_bytes, (out,), j))
            F[j][m] = sim.add(f"F{j}.{m}", COMPUTE, j, st[j].fwd_s, deps)
    for j in range(n - 1, -1, -1):
        for m in range(M):
            deps = [B[j][m - 1]] if m else [F[n - 1][M - 1]]
            if j + 1 < n:
                out = sim.add(f"grad {j + 1}.{m}", D2H, j + 1, st[j].out_bytes, (B[j + 1][m],), 0)
                deps.append(sim.add(f"grad {j + 1}.{m} in", H2D, j, st[j].out_bytes, (out,), 0))
            B[j][m] = sim.add(f"B{j}.{m}", COMPUTE, j, st[j].bwd_s, deps)
        sim.add(f"optimizer {j}", COMPUTE, j, 16 * st[j].param_bytes / elt / GPU_HBM_BPS, (B[j][M - 1],))
    return SimOutcome("gpipe", (r := sim.run()).step_s, result=r)


def simulate_zero3_offload(profile: Profile, topo, micro_batches: int, recompute: bool = True,
                           adam_params_per_s: float = ANALYTIC_ADAM_PARAMS_PER_S) -> SimOutcome:
    n, L = topo.n, profile.n
    per_gpu = math.ceil(micro_batches / n)  # micro-batches each data-parallel rank runs
    layers = profile.layers
    elt = element_bytes(profile.dtype)
    sim = Simulator(link_for(topo))
    grad_done = {g: [] for g in range(n)}
    for g in range(n):
        fetch, comp = [None] * L, [None] * L
        for i in range(L):
            # One layer of lookahead: fetch layer i once layer i-1's compute has started
            # (approximated by layer i-2 having finished), so at most two layers are resident.
            deps = (fetch[i - 1], comp[i - 2] if i >= 2 else None)
            fetch[i] = sim.add(f"gather L{i}", H2D, g, layers[i].param_bytes, deps, i)
            comp[i] = sim.add(f"F L{i}", COMPUTE, g, per_gpu * layers[i].fwd_s, (fetch[i], comp[i - 1] if i else None))
            if i + 1 < L:
                sim.add(f"ckpt L{i} to host", D2H, g, per_gpu * layers[i].out_bytes, (comp[i],), i)
        bfetch, bcomp = [None] * L, [None] * L
        last = comp[L - 1]
        for k, i in enumerate(range(L - 1, -1, -1)):
            prio = L + k
            prev_fetch = bfetch[i + 1] if i + 1 < L else last
            two_back = bcomp[i + 2] if i + 2 < L else last
            bfetch[i] = sim.add(f"gather L{i} (bwd)", H2D, g, layers[i].param_bytes, (prev_fetch, two_back), prio)
            deps = [bfetch[i], bcomp[i + 1] if i + 1 < L else last]
            if i > 0:
                deps.append(sim.add(f"ckpt L{i - 1} back", H2D, g, per_gpu * layers[i - 1].out_bytes,
                                    (bfetch[i],), prio))
            bwd = layers[i].bwd_s + (layers[i].fwd_s if recompute else 0.0)
            bcomp[i] = sim.add(f"B L{i}", COMPUTE, g, per_gpu * bwd, deps)
            grad_done[g].append(sim.add(f"grads L{i} to host", D2H, g, layers[i].param_bytes, (bcomp[i],), prio))
    all_grads = [t for g in range(n) for t in grad_done[g]]
    params = sum(l.param_bytes for l in layers) / elt
    for g in range(n):
        sim.add("CPU Adam (1/N of the parameters)", CPU, g, params / n / adam_params_per_s, tuple(all_grads))
    return SimOutcome("deepspeed-zero3-offload", (r := sim.run()).step_s, result=r)


# ZeRO-Infinity moves each rank's optimizer state through its drives in this many pieces: the read
# of the next, the update of this one and the write of the last overlap.
ZERO_INFINITY_PIECES = 8


def simulate_zero_infinity(profile: Profile, topo, micro_batches: int, drive_gbps: tuple[float, float],
                           host_memory_bytes: float, recompute: bool = True,
                           adam_params_per_s: float = ANALYTIC_ADAM_PARAMS_PER_S) -> SimOutcome:
    """DeepSpeed ZeRO-Infinity (ZeRO-3 with the optimizer state on NVMe, and the parameters too
    where the host's memory does not hold them beside the fp32 gradients it accumulates: its best
    configuration for ``host_memory_bytes``), data parallel over the N GPUs, on the box's drives
    (``drive_gbps``: read and write, all drives together, shared by every rank).  As DeepSpeed runs
    gradient accumulation, each of a rank's micro-batches is a forward and a backward of its own:
    per layer and pass, each rank reads its 1/N partition of the 16-bit weights from the drives
    (parameters on NVMe), the layer is gathered to every GPU through the host (no peer-to-peer),
    one layer of lookahead; checkpoints go to the host and back; 16-bit gradients go to the host.
    Every micro-batch is the same, so one is simulated and counted ``ceil(M/N)`` times (their
    overlap at the boundaries left out).  Then each rank's optimizer: its 1/N of the
    fp32 master and both moments read from the drives (12 bytes a parameter), CPU Adam, those and
    the 16-bit weights written back (12 bytes and the weights' where they live there), in pieces
    that overlap."""
    n, L = topo.n, profile.n
    per_gpu = math.ceil(micro_batches / n)
    layers = profile.layers
    elt = element_bytes(profile.dtype)
    link = replace(link_for(topo), disk_read_bw=drive_gbps[0] * 1e9, disk_write_bw=drive_gbps[1] * 1e9)
    params = sum(l.param_bytes for l in layers) / elt
    on_disk = 1.0 if params * (elt + 4) > host_memory_bytes else 0.0  # the share of a layer each read moves
    sim = Simulator(link)
    for g in range(n):
        fetch, comp = [None] * L, [None] * L
        for i in range(L):
            read = sim.add(f"read L{i}", DISK_READ, g, on_disk * layers[i].param_bytes / n,
                           (comp[i - 2] if i >= 2 else None,), i)
            fetch[i] = sim.add(f"gather L{i}", H2D, g, layers[i].param_bytes, (read, fetch[i - 1]), i)
            comp[i] = sim.add(f"F L{i}", COMPUTE, g, layers[i].fwd_s, (fetch[i], comp[i - 1] if i else None))
            if i + 1 < L:
                sim.add(f"ckpt L{i} to host", D2H, g, layers[i].out_bytes, (comp[i],), i)
        bfetch, bcomp = [None] * L, [None] * L
        last = comp[L - 1]
        for k, i in enumerate(range(L - 1, -1, -1)):
            prio = L + k
            two_back = bcomp[i + 2] if i + 2 < L else last
            read = sim.add(f"read L{i} (bwd)", DISK_READ, g, on_disk * layers[i].param_bytes / n, (two_back,), prio)
            bfetch[i] = sim.add(f"gather L{i} (bwd)", H2D, g, layers[i].param_bytes,
                                (read, bfetch[i + 1] if i + 1 < L else last), prio)
            deps = [bfetch[i], bcomp[i + 1] if i + 1 < L else last]
            if i > 0:
                deps.append(sim.add(f"ckpt L{i - 1} back", H2D, g, layers[i - 1].out_bytes, (bfetch[i],), prio))
            bcomp[i] = sim.add(f"B L{i}", COMPUTE, g, layers[i].bwd_s + (layers[i].fwd_s if recompute else 0.0), deps)
            sim.add(f"grads L{i} to host", D2H, g, layers[i].param_bytes, (bcomp[i],), prio)
    micro_batch_s = sim.run().step_s
    share = params / n / ZERO_INFINITY_PIECES
    opt = Simulator(link)
    for g in range(n):
        read = adam = None
        for k in range(ZERO_INFINITY_PIECES):
            read = opt.add(f"state {k} from disk", DISK_READ, g, 12 * share, (read,), k)
            adam = opt.add(f"CPU Adam {k}", CPU, g, share / adam_params_per_s, (read, adam))
            opt.add(f"state {k} to disk", DISK_WRITE, g, (12 + on_disk * elt) * share, (adam,), k)
    return SimOutcome("deepspeed-zero-infinity", per_gpu * micro_batch_s + opt.run().step_s)
