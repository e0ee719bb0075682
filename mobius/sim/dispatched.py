"""The dispatched schedule, predicted: GPUs as a pool that every stage computation is handed to in
turn, instead of each stage bound to one GPU for the whole step (RoundPipe, Luo et al. 2026).  The
schedule itself, as data, is :mod:`mobius.stages.tasks`'s (the runtime, :mod:`mobius.stages.dispatch`,
runs the same task list); its search, :mod:`mobius.planning.dispatched`, simulates candidates here.

Forward and backward have partitions of their own: a backward with recomputation costs about three
forwards, so its stages hold about a third of the layers, and every task takes about as long as
the others.  Three things keep the pool busy, and the simulation models each:

* **The head's task is split by micro-batches** over ``head_gpus`` GPUs, each loading its weights;
  the host sums their gradients before the stage's one AdamW update.  Its stage may hold the last
  blocks too, whose backward then runs in its fused pass without recomputation.
* **A kept tail**: the ``kept`` forward stages before the last are their own backward stages, whose
  backward runs on the GPU that ran their forward, from every micro-batch's activations kept there
  (checked against that GPU's memory beside the tasks it runs meanwhile), without recomputation.
* **Steps overlap**: the next step's tasks start on the GPUs that are done while this step's last
  tasks run elsewhere, each load waiting for the updates it reads (with ``--optimizer-lag 1``,
  those of the step two before; without, those of this step, whose last backward stages are
  the first forward stages' layers: the loads of later stages stream in meanwhile).  The step is
  the steady state: the time between the ends of consecutive steps, over
  :data:`OVERLAPPED_STEPS`, each overlapping the next one's start (one more step is simulated
  after them).  A step alone ends with its last update: emulated on ``8x3090-4+4`` without the
  lag, that was 18% over the measured step, the steady state 3.5% under it.

With data-parallel replicas (``profile.host.replicas``) each box runs this on its share of the
micro-batches, and a stage's update is the sum over the replicas, the owners' AdamW of 1/D of it
and the broadcast back, the sums and the broadcasts each in one order over the box's network.

:func:`simulate_dispatched` runs it on :mod:`mobius.sim.engine`'s streams and links, with the bound
schedule's own costs (:func:`mobius.partition.cost.stage_costs`, the runtime's calibrated
per-micro-batch and stage-switch work, the hand-off between workers).
"""

from __future__ import annotations

import math
from dataclasses import replace

from mobius.models.precision import element_bytes
from mobius.partition.cost import StageCost, exchanged_bytes, stage_costs
from mobius.partition.profile import Profile
from mobius.sim.engine import COMPUTE, CPU, D2H, DELAY, H2D, NET, SimResult, Simulator, link_for
from mobius.stages.tasks import Task, step_tasks, valid_partitions

OVERLAPPED_STEPS = 3  # two steady-state steps between their ends (and one more after)


def simulate_dispatched(profile: Profile, forward: list[tuple[int, int]], backward: list[tuple[int, int]], topo,
                        order: list[int], micro_batches: int, memory_bytes: list[int] | None = None,
                        adam_params_per_s: float | None = None, optimizer_lag: int = 0, kept: int = 0,
                        head_gpus: int = 1, steps: int | None = None, resident=(),
                        whole_step: bool = False) -> SimResult | None:
    """One step of the dispatched schedule; None where a task does not fit its GPU's memory beside
    what the kept and resident stages hold there.  The steady state of ``steps`` steps (default
    :data:`OVERLAPPED_STEPS`; 1: a step alone, ending with its last update, or with the lag its
    device work), unless a host thread's AdamW of a step takes longer.  ``resident``: (kept
    forward stage, GPU) pairs whose weights stay on that GPU, updated there (only without the
    lag).  ``whole_step`` (clipping, fp16, where the updates cannot start before the step's
    decision: :func:`mobius.planning.pipeline.updates_wait_for_the_step`): every host update of a
    step waits for all of the step's gradients (its norm, its overflow vote)."""
    if not valid_partitions(forward, backward, kept):
        raise ValueError(f"backward partition {backward} does not end within forward partition {forward}, "
                         f"or its last {kept} stages before the head's are not forward stages")
    if resident and optimizer_lag:
        raise ValueError("resident stages update on their GPUs at once: not with an optimizer lag")
    head_gpus = max(1, min(head_gpus, micro_batches))
    steps = steps or OVERLAPPED_STEPS
    simulated = simulated_steps(steps)
    tasks = step_tasks(forward, backward, kept, head_gpus, order, micro_batches, simulated, resident=resident)
    fwd = stage_costs(profile, forward, recompute=False)
    bwd = stage_costs(profile, backward, recompute=True)
    no_recompute = stage_costs(profile, backward, recompute=False)
    mem = memory_bytes or [int(g.memory_gb * 1e9) for g in topo.gpus]
    if not _fits(tasks, fwd, no_recompute, mem, micro_batches, _held(fwd, resident, profile.dtype, len(mem)),
                 {j for j, _ in resident}):
        return None
    step = _StepOnSimulator(profile, topo, tasks, fwd, bwd, no_recompute, mem, backward, kept, head_gpus,
                            adam_params_per_s or profile.host.adam_params_per_s, optimizer_lag,
                            ({j for j, _ in resident}, {backward.index(forward[j]) for j, _ in resident}),
                            whole_step)
    for i, t in enumerate(tasks):
        step.run_task(i, t)
    step.release(math.inf)
    result = step.sim.run()
    computing: dict[int, float] = {}
    for t in result.tasks:
        if t.kind == COMPUTE:
            computing[t.gpu] = computing.get(t.gpu, 0.0) + t.work
    compute = max(computing.values(), default=0.0) / simulated
    if steps == 1 and not optimizer_lag:  # a step alone, ending with its last update
        return replace(result, compute_s=compute)
    device, floor = _steady_step_s(result, step.step_of, steps, simulated, profile.host.network_bps, compute)
    return replace(result, step_s=max(device, floor), device_s=device, floor_s=floor, compute_s=compute)


class _StepOnSimulator:
    """The tasks issued on :mod:`mobius.sim.engine`'s streams, one after the other."""

    def __init__(self, profile: Profile, topo, tasks: list[Task], fwd: list[StageCost], bwd: list[StageCost],
                 no_recompute: list[StageCost], mem: list[int], backward, kept: int, head_gpus: int,
                 adam_rate: float, optimizer_lag: int, resident: tuple[set[int], set[int]], whole_step: bool):
        self.profile, self.host = profile, profile.host
        self.link = replace(link_for(topo), network_bw=profile.host.network_bps)
        self.sim = Simulator(self.link)
        self.tasks, self.fwd, self.bwd, self.no_recompute, self.mem = tasks, fwd, bwd, no_recompute, mem
        self.head_gpus, self.adam_rate = head_gpus, adam_rate
        self.starts_backward = {backward[k][0] for k in range(1, len(backward) - 1 - kept)}  # those that recompute
        self.step_of: dict[int, int] = {}  # simulator task -> step
        self.ready: dict[tuple[str, int, int], int] = {}  # (F|B, stage, micro-batch) -> its output on the host
        self.last_on: dict[int, tuple[int, int]] = {}  # GPU -> (device bytes its last task needs, its last compute)
        self.computed: dict[int, int] = {}  # GPU -> its last micro-batch's compute
        self.loaded_on: dict[int, int] = {}  # GPU -> its last task's weights, there
        self.head_grads: dict[int, list[tuple[int, int]]] = {}  # step -> the head task's (GPU, gradient copy)
        self.updates: dict[tuple[int, int], int] = {}  # (step, backward stage) -> its AdamW (and broadcast)
        self.exchanges: dict[str, int] = {}  # with replicas: "sum", "broadcast" -> the last, in every replica's order
        self.lag = optimizer_lag
        # Clipping or fp16: every host update of a step waits for all of its gradients (its norm, its
        # vote); per step, what they wait for and the updates held ((task, its index, parameters)).
        self.whole_step = whole_step
        self.gates: dict[int, list[int]] = {}
        self.held: dict[int, list[tuple[Task, int, int, float]]] = {}
        # The resident stages, by their forward and by their backward index: weights stay, updated there.
        self.resident_fwd, self.resident_bwd = resident

    def add(self, t: Task, *args, **options) -> int:
        tid = self.sim.add(*args, **options)
        self.step_of[tid] = t.step
        return tid

    def costs(self, t: Task) -> StageCost:
        return self.fwd[t.stage] if t.kind in "FH" else (self.bwd if t.recomputes else self.no_recompute)[t.stage]

    def there(self, t: Task) -> bool:
        """Whether a task's weights are on its GPU already: a kept stage's backward finds its
        forward's there, a resident stage's forward those of the step before."""
        return (t.kind == "B" and not t.recomputes) or (t.kind == "F" and t.stage in self.resident_fwd)

    def run_task(self, i: int, t: Task) -> None:
        self.release(t.step)  # a step's loads may wait for the updates of the steps before
        c, g = self.costs(t), t.gpu
        # Weights: what fits beside the GPU's current task streams in while it computes, the rest after.
        prev = self.last_on.get(g)
        param_bytes = 0 if self.there(t) else c.param_bytes
        early = max(0.0, min(param_bytes, self.mem[g] - prev[0])) if prev else param_bytes
        a = self.add(t, f"load T{i} (prefetch)", H2D, g, early, (self.loaded_on.get(g), *self.updated(t, c)), i,
                     "params")
        b = self.add(t, f"load T{i}", H2D, g, param_bytes - early, (a, prev[1] if prev else None), i, "params")
        self.loaded_on[g] = b
        begin = self.add(t, f"T{i} switch", COMPUTE, g, self.host.stage_switch_s, (prev[1],) if prev else ())
        last = None
        for m in t.micro_batches:
            if t.kind == "B":
                last = self.backward(i, t, c, m, [a, b, begin])
            else:
                last = self.forward(i, t, c, m, [a, b, begin])
        self.last_on[g] = (_device_bytes(t, self.fwd, self.no_recompute), last)
        if t.kind != "F":
            self.update(i, t, self.no_recompute[-1] if t.kind == "H" else c, last)

    def compute(self, t: Task, name: str, upload: float, work: float, deps: list) -> int:
        """A micro-batch's pass on the task's GPU, after its inputs' upload: a transfer on the GPU's
        link between the GPU's compute before and this one (the runtime uploads them on the compute
        stream), sharing its root complex with the other GPUs' copies; the weights streaming in on
        its own link meanwhile give way to it (:mod:`mobius.swap.upload_gate`)."""
        g = t.gpu
        if upload:
            deps = [self.add(t, f"{name} inputs in", H2D, g, upload, (*deps, self.computed.get(g)), 0, "activations",
                             urgent=True)]
        self.computed[g] = self.add(t, name, COMPUTE, g, work + self.host.micro_batch_s, deps)
        return self.computed[g]

    def handed_on(self, i: int, t: Task, name: str, nbytes: float, after: int) -> int:
        """An output leaves for the host, and reaches the next task's worker a hand-off later."""
        out = self.add(t, f"{name} to host", D2H, t.gpu, nbytes, (after,), i + 1, "activations")
        return self.add(t, f"{name} handed off", DELAY, t.gpu, self.host.handoff_s, (out,))

    def forward(self, i: int, t: Task, c: StageCost, m: int, loaded: list) -> int:
        """Micro-batch ``m`` through a forward stage; the head's task runs its backward at once."""
        last = self.compute(t, f"F{t.stage}.{m}", c.in_bytes, c.fwd_s, [*loaded, self.ready.get(("F", t.stage - 1, m))])
        kept_inputs = sum(self.profile.layers[lo - 1].out_bytes for lo in self.starts_backward if c.start < lo < c.end)
        if kept_inputs:  # the inputs of the backward stages that start within it, for their recomputation
            self.add(t, f"F{t.stage}.{m} inputs kept", D2H, t.gpu, kept_inputs, (last,), i + 1, "activations")
        if t.kind == "F":
            self.ready[("F", t.stage, m)] = self.handed_on(i, t, f"act F{t.stage}.{m}", c.out_bytes, last)
            return last
        head, k = self.no_recompute[-1], len(self.bwd) - 1
        last = self.compute(t, f"B{k}.{m}", 0.0, head.bwd_s, [last])
        self.ready[("B", k, m)] = self.handed_on(i, t, f"grad B{k}.{m}", head.in_bytes, last)
        return last

    def backward(self, i: int, t: Task, c: StageCost, m: int, loaded: list) -> int:
        """Its output's gradient, and the input it recomputes from (a kept stage has it there)."""
        upload = c.out_bytes + (c.in_bytes if t.recomputes else 0)
        last = self.compute(t, f"B{t.stage}.{m}", upload, c.bwd_s, [*loaded, self.ready[("B", t.stage + 1, m)]])
        if t.stage > 0:
            self.ready[("B", t.stage, m)] = self.handed_on(i, t, f"grad B{t.stage}.{m}", c.in_bytes, last)
        return last

    def updated(self, t: Task, c: StageCost) -> list[int]:
        """The updates a task's weights wait for: those of the backward stages with its layers, from
        the step ``1 + lag`` before (a step simulated: the steps before it were done)."""
        before = t.step - 1 - self.lag
        return [u for (step, k), u in self.updates.items()
                if step == before and self.bwd[k].start < c.end and c.start < self.bwd[k].end]

    def update(self, i: int, t: Task, trained: StageCost, last: int) -> None:
        """A backward's gradients leave after its last micro-batch for the host's AdamW; the head's
        parts are summed on the host before its one update.  A resident stage's AdamW runs on its
        GPU, on the compute stream."""
        params = trained.grad_bytes / element_bytes(self.profile.dtype)
        k = len(self.bwd) - 1 if t.kind == "H" else t.stage  # the backward stage whose gradients these are
        if t.kind == "B" and k in self.resident_bwd:
            self.computed[t.gpu] = self.updates[(t.step, k)] = self.add(
                t, f"AdamW T{i} on the GPU", COMPUTE, t.gpu, params / self.host.device_adam_params_per_s, (last,))
            self.last_on[t.gpu] = (self.last_on[t.gpu][0], self.computed[t.gpu])
            return
        # Their staging buffers on the host are free once the step before's update of them has read
        # them: until then the gradients wait on the GPU, and so does the thread that drives it.
        staged = self.updates.get((t.step - 1, k))
        if staged is not None:
            last = self.computed[t.gpu] = self.add(t, f"T{i} staging free", DELAY, t.gpu, 0.0, (last, staged))
            self.last_on[t.gpu] = (self.last_on[t.gpu][0], last)
        off = self.add(t, f"grads T{i} to host", D2H, t.gpu, trained.grad_bytes, (last,), len(self.tasks) + i,
                       "gradients")
        after = (off,)
        if t.kind == "H":
            self.head_grads.setdefault(t.step, []).append((t.gpu, off))
            if len(self.head_grads[t.step]) < self.head_gpus:
                return
            after = tuple(off for _, off in self.head_grads[t.step])
        if self.host.replicas > 1:
            # Summed over the replicas into the owners, 1/D of it stepped here, broadcast back: the
            # box's network carries the sums and the broadcasts, each in one order (a thread each).
            x = self.exchanges
            x["sum"] = self.add(t, f"sum T{i}", NET, 0, exchanged_bytes(params, self.host.replicas),
                                (*after, x.get("sum")), i, "sums")
            after = (x["sum"],)
        if self.whole_step:  # its AdamW waits for the step's last gradients (release)
            self.gates.setdefault(t.step, []).extend(after)
            self.held.setdefault(t.step, []).append((t, i, k, params))
            return
        self.adamw(t, i, k, params, after)

    def adamw(self, t: Task, i: int, k: int, params: float, after: tuple) -> None:
        """Backward stage ``k``'s AdamW on the host (1/D of it with replicas, then the broadcast
        back), after ``after``; the head's, its parts summed in it, is the dearer for each part."""
        replicas, x = self.host.replicas, self.exchanges
        split = self.host.split_update_factor(self.head_gpus) if t.kind == "H" else 1.0
        # The head's parts' update is split over the threads of the GPUs that computed them.
        lanes = [g for g, _ in self.head_grads[t.step]] if t.kind == "H" else [t.gpu]
        slices = [self.add(t, f"AdamW T{i}", CPU, g, params * split / replicas / self.adam_rate / len(lanes), after)
                  for g in lanes]
        adam = slices[0] if len(slices) == 1 else self.add(t, f"T{i} updated", DELAY, t.gpu, 0.0, tuple(slices))
        self.updates[(t.step, k)] = adam
        if replicas > 1:
            self.updates[(t.step, k)] = x["broadcast"] = self.add(
                t, f"broadcast T{i}", NET, 0, exchanged_bytes(params, replicas), (adam, x.get("broadcast")), i,
                "broadcasts")

    def release(self, before: int) -> None:
        """The held updates of the steps before ``before``, each once every gradient of its step is
        home (summed over the replicas): clipping's norm, fp16's vote."""
        for step in sorted(s for s in self.held if s < before):
            gates = tuple(self.gates.pop(step))
            for t, i, k, params in self.held.pop(step):
                self.adamw(t, i, k, params, gates)


def dispatched_fits(profile: Profile, forward: list[tuple[int, int]], backward: list[tuple[int, int]],
                    mem: list[int], order: list[int], micro_batches: int, kept: int = 0, head_gpus: int = 1,
                    resident=()) -> bool:
    """Whether every task of a step fits its GPU's memory ``mem`` beside what the kept and resident
    stages hold there."""
    head_gpus = max(1, min(head_gpus, micro_batches))
    tasks = step_tasks(forward, backward, kept, head_gpus, order, micro_batches, resident=resident)
    fwd = stage_costs(profile, forward, recompute=False)
    no_recompute = stage_costs(profile, backward, recompute=False)
    return _fits(tasks, fwd, no_recompute, mem, micro_batches, _held(fwd, resident, profile.dtype, len(mem)),
                 {j for j, _ in resident})


def _held(fwd: list[StageCost], resident, dtype, gpus: int) -> dict[int, int]:
    """What the resident stages keep on each GPU for good: their weights, gradients and AdamW state."""
    held = dict.fromkeys(range(gpus), 0)
    for j, g in resident:
        held[g] += resident_bytes(fwd[j], dtype)
    return held


def _fits(tasks: list[Task], fwd: list[StageCost], no_recompute: list[StageCost], mem: list[int],
          micro_batches: int, held: dict[int, int], resident: set[int]) -> bool:
    """Every task fits its GPU beside what stays there (tasks in issue order): ``held``, the
    resident stages' state on each GPU; a kept stage's weights and every micro-batch's activations
    from the forward that kept them to the end of their backward."""
    held = dict(held)
    shift = len(no_recompute) - len(fwd)
    for t in tasks:
        c = fwd[t.stage] if t.kind in "FH" else no_recompute[t.stage]
        kept_backward = t.kind == "B" and not t.recomputes
        weights_held = kept_backward or (t.kind == "F" and t.stage in resident)
        keeping = t.kind == "F" and t.keeps
        if keeping:  # every micro-batch's, beyond the one the pass itself counts
            held[t.gpu] += micro_batches * no_recompute[t.stage + shift].kept_bytes
        if _device_bytes(t, fwd, no_recompute) - (c.param_bytes if weights_held else 0) + held[t.gpu] > mem[t.gpu]:
            return False
        if keeping and t.stage not in resident:  # its weights stay for its backward
            held[t.gpu] += c.param_bytes
        if kept_backward:
            resident_here = _fwd_index(fwd, c) in resident
            held[t.gpu] -= micro_batches * c.kept_bytes + (0 if resident_here else c.param_bytes)
    return True


def _fwd_index(fwd: list[StageCost], c: StageCost) -> int:
    """The forward stage with ``c``'s layers."""
    return next(j for j, f in enumerate(fwd) if (f.start, f.end) == (c.start, c.end))


def resident_bytes(c: StageCost, dtype) -> int:
    """What a resident stage keeps on its GPU for good: its weights, its gradients and AdamW's two
    moments, and in 16 bits an fp32 master and its gradient (:mod:`mobius.stages.device_optimizer`)."""
    params = c.grad_bytes // element_bytes(dtype)
    return c.param_bytes + c.grad_bytes + 8 * params + (8 * params if element_bytes(dtype) != 4 else 0)


def _device_bytes(t: Task, fwd: list[StageCost], no_recompute: list[StageCost]) -> int:
    """What a task's pass holds on its GPU: a forward's; the head's forward and backward, its
    weights once (the runtime reserves both passes' working memory beside them); a backward's, one
    micro-batch at a time, recomputed or not."""
    if t.kind == "F":
        return fwd[t.stage].mem_fwd
    if t.kind == "H":
        return fwd[t.stage].mem_fwd + no_recompute[-1].mem_bwd - no_recompute[-1].param_bytes
    return no_recompute[t.stage].mem_bwd


def simulated_steps(steps: int) -> int:
    """How many steps are simulated for a steady state of ``steps``: one step more than those
    measured (in a run each step overlaps its successor's first tasks, and a last step without one
    would end early and make the steady state look shorter)."""
    return steps + 1 if steps > 1 else 1


def _steady_step_s(result: SimResult, step_of: dict[int, int], steps: int, simulated: int,
                   network_bps: float, compute_s: float) -> tuple[float, float]:
    """The time between the ends of the first and the ``steps``-th steps' device work (and their
    exchanges between replicas), per step, of ``simulated`` steps (one step: its device work's
    end), never less than ``compute_s``, what the busiest GPU computes a step; and the floor under
    it, a host thread's AdamW or the network's exchanges of one step.

    Overlapped steps settle into a cycle of several, not into one repeated step: Llama-3.1-8B on
    8x4090-4+4 at 64 micro-batches ends its steps 12.42, 12.39, 12.40 then 13.54 s apart, over and
    over (12.69 s on average), so the first steps' ends alone measured 12.41 s, under the 12.55 s
    each GPU computes a step.  What a GPU computes is a bound no cycle beats."""
    ends = [0.0] * simulated
    adam: dict[int, float] = {}
    for t in result.tasks:
        if t.kind not in (CPU, DELAY):
            ends[step_of[t.id]] = max(ends[step_of[t.id]], t.end)
        if t.kind == CPU:
            adam[t.gpu] = adam.get(t.gpu, 0.0) + t.work
    network = sum(t.work for t in result.tasks if t.kind == NET) / network_bps if network_bps else 0.0
    device = ends[0] if steps == 1 else (ends[steps - 1] - ends[0]) / (steps - 1)
    device = max(device, compute_s)
    return device, max(max(adam.values(), default=0.0) / simulated, network / simulated)

