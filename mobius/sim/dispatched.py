"""The dispatched schedule, predicted: GPUs as a pool that every stage computation is handed to in
turn, instead of each stage bound to one GPU for the whole step (RoundPipe, Luo et al. 2026).

A step is a chain of *tasks*: the forward of each forward stage, then the backward of each
backward stage, last to first.  Forward and backward have partitions of their own: a backward
with recomputation costs about three forwards, so its stages hold about a third of the layers, and
every task takes about as long as the others.  Task ``i`` runs on GPU ``order[i % n]`` (the cross
mapping's order, so consecutive tasks sit under different root complexes), all micro-batches of
it while its weights are there; the next task's weights stream in meanwhile where memory allows.
Nothing stays on a GPU from one task to the next: a backward stage recomputes its forward from its
input, which the forward left on the host (at every backward boundary), so the schedule always
recomputes.  The last forward task holds the head: as in the bound schedule, each micro-batch's
backward of the last backward stage (which lies within it) runs right after its forward.

:func:`simulate_dispatched` is one step of it on :mod:`mobius.sim.engine`'s streams and links,
with the bound schedule's own costs (:func:`mobius.partition.cost.stage_costs`, the runtime's
calibrated per-micro-batch and stage-switch work, the hand-off between workers);
:func:`plan_dispatched` searches the two partitions' stage counts for the fastest step.  The
runtime does not run this schedule yet: what these give are predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mobius.models.precision import element_bytes
from mobius.partition.baselines import balanced_bounds
from mobius.partition.cost import stage_costs
from mobius.partition.profile import Profile
from mobius.sim.engine import COMPUTE, CPU, D2H, DELAY, H2D, SimResult, Simulator, link_for
from mobius.sim.schedules import lagged_step_s


@dataclass(frozen=True)
class DispatchedPlan:
    forward: list[tuple[int, int]]  # the forward stages' [start, end) layers
    backward: list[tuple[int, int]]  # the backward stages'; the last lies within the last forward stage
    order: list[int]  # task i runs on GPU order[i % n]
    micro_batches: int
    step_s: float  # predicted (simulated)
    result: SimResult | None = None

    def gpu_of_tasks(self) -> list[tuple[str, int]]:
        """Which GPU runs each task, in the step's order ("F3", "B0", ...)."""
        tasks = [f"F{j}" for j in range(len(self.forward))] + [f"B{k}" for k in range(len(self.backward) - 2, -1, -1)]
        return [(name, self.order[i % len(self.order)]) for i, name in enumerate(tasks)]


def valid_partitions(forward: list[tuple[int, int]], backward: list[tuple[int, int]]) -> bool:
    """Both cover the same layers, and the head's backward lies within the last forward stage."""
    return (forward[0][0] == backward[0][0] and forward[-1][1] == backward[-1][1]
            and backward[-1][0] >= forward[-1][0])


def simulate_dispatched(profile: Profile, forward: list[tuple[int, int]], backward: list[tuple[int, int]], topo,
                        order: list[int], micro_batches: int, memory_bytes: list[int] | None = None,
                        adam_params_per_s: float | None = None, optimizer_lag: int = 0) -> SimResult | None:
    """One step of the dispatched schedule; None where a task does not fit its GPU's memory.  With
    ``optimizer_lag`` the step's AdamW runs on while the next step computes (the result's
    ``step_s`` as :func:`mobius.sim.schedules.lagged_step_s` says)."""
    if not valid_partitions(forward, backward):
        raise ValueError(f"backward partition {backward} does not end within forward partition {forward}")
    n, M = len(order), micro_batches
    fwd = stage_costs(profile, forward, recompute=False)
    bwd = stage_costs(profile, backward, recompute=True)
    head = replace(bwd[-1], recomputed=False, bwd_s=bwd[-1].bwd_s - bwd[-1].fwd_s)  # right after its forward
    mem = memory_bytes or [int(g.memory_gb * 1e9) for g in topo.gpus]
    # The tasks in the step's order: (kind, stage index, what it computes, what it needs on the device).
    tasks = [("F", j, c, c.mem_fwd + (head.mem_bwd if j == len(fwd) - 1 else 0)) for j, c in enumerate(fwd)]
    tasks += [("B", k, bwd[k], bwd[k].mem_bwd) for k in range(len(bwd) - 2, -1, -1)]
    gpu = [order[i % n] for i in range(len(tasks))]
    if any(need > mem[gpu[i]] for i, (*_, need) in enumerate(tasks)):
        return None
    host = profile.host
    adam_rate = adam_params_per_s or host.adam_params_per_s
    link = link_for(topo)
    sim = Simulator(link)
    starts_backward = {lo for lo, _ in backward[1:]}
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> its output on the host
    last_on: dict[int, tuple[int, int]] = {}  # GPU -> (its previous task's index, that task's last compute)
    loaded_on: dict[int, int] = {}  # GPU -> its previous task's weights, there

    def load(i: int, size: float) -> list[int]:
        """Task ``i``'s weights: once the GPU's current task has its own, what fits beside that task
        streams in while it computes; the rest once it is done."""
        g, prev = gpu[i], last_on.get(gpu[i])
        early = max(0.0, min(size, mem[g] - tasks[prev[0]][3])) if prev else size
        a = sim.add(f"load T{i} (prefetch)", H2D, g, early, (loaded_on.get(g),), i, "params")
        b = sim.add(f"load T{i}", H2D, g, size - early, (a, prev[1] if prev else None), i, "params")
        loaded_on[g] = b
        return [a, b]

    def compute(name: str, i: int, upload: float, work: float, deps: list) -> int:
        g = gpu[i]
        return sim.add(name, COMPUTE, g, work + upload / link.gpu_bw[g] + host.micro_batch_s, deps)

    def to_next(name: str, i: int, nbytes: float, after: int) -> int:
        """An output leaves for the host, and reaches the next task's worker a hand-off later."""
        out = sim.add(f"{name} to host", D2H, gpu[i], nbytes, (after,), i + 1, "activations")
        return sim.add(f"{name} handed off", DELAY, gpu[i], host.handoff_s, (out,))

    for i, (kind, s, c, _) in enumerate(tasks):
        loaded = load(i, c.param_bytes)
        begin = sim.add(f"T{i} switch", COMPUTE, gpu[i], host.stage_switch_s, (last_on[gpu[i]][1],)
                        if gpu[i] in last_on else ())
        # The inputs of the backward stages that start inside a forward stage go to the host too.
        kept = sum(profile.layers[lo - 1].out_bytes for lo in starts_backward if c.start < lo < c.end)
        last = None
        for m in range(M):
            if kind == "F":
                deps = [*loaded, begin, done.get(("F", s - 1, m))]
                last = compute(f"F{s}.{m}", i, c.in_bytes, c.fwd_s, deps)
                if kept:
                    sim.add(f"F{s}.{m} inputs kept", D2H, gpu[i], kept, (last,), i + 1, "activations")
                if s == len(fwd) - 1:  # the head's backward, at once
                    last = compute(f"B{len(bwd) - 1}.{m}", i, 0.0, head.bwd_s, [last])
                    done[("B", len(bwd) - 1, m)] = to_next(f"grad B{len(bwd) - 1}.{m}", i, head.in_bytes, last)
                else:
                    done[("F", s, m)] = to_next(f"act F{s}.{m}", i, c.out_bytes, last)
            else:
                upload = c.out_bytes + c.in_bytes  # its output's gradient, and its input to recompute from
                last = compute(f"B{s}.{m}", i, upload, c.bwd_s, [*loaded, begin, done[("B", s + 1, m)]])
                if s > 0:
                    done[("B", s, m)] = to_next(f"grad B{s}.{m}", i, c.in_bytes, last)
        last_on[gpu[i]] = (i, last)
        if kind == "B" or s == len(fwd) - 1:  # a backward's gradients leave after its last micro-batch
            trained = c if kind == "B" else head
            off = sim.add(f"grads T{i} to host", D2H, gpu[i], trained.grad_bytes, (last,), len(tasks) + i,
                          "gradients")
            sim.add(f"AdamW T{i}", CPU, gpu[i], trained.grad_bytes / element_bytes(profile.dtype) / adam_rate, (off,))
    result = sim.run()
    return replace(result, step_s=lagged_step_s(result, host)) if optimizer_lag else result


def plan_dispatched(profile: Profile, topo, order: list[int], micro_batches: int,
                    memory_bytes: list[int] | None = None, adam_params_per_s: float | None = None,
                    optimizer_lag: int = 0) -> DispatchedPlan | None:
    """The fastest dispatched step found over the two partitions' stage counts (each partition
    time-balanced, exactly, for its count): forward stages from one to four a GPU, backward stages
    from as many to three times as many, in steps of half the GPU count (each simulation of an 8-GPU
    step takes about a second).  None where no pair fits."""
    n = len(order)
    fwd_costs = [l.fwd_s for l in profile.layers]
    bwd_costs = [l.fwd_s + l.bwd_s for l in profile.layers]  # recomputed
    stride = max(1, n // 2)
    best = None
    for sf in sorted({min(k, profile.n) for k in range(1, 4 * n + 1, stride)}):
        forward = balanced_bounds(fwd_costs, sf)
        for sb in sorted({min(k, profile.n) for k in range(max(2, sf), 3 * sf + 1, stride)}):
            backward = balanced_bounds(bwd_costs, sb)
            if not valid_partitions(forward, backward):
                continue
            result = simulate_dispatched(profile, forward, backward, topo, order, micro_batches, memory_bytes,
                                         adam_params_per_s, optimizer_lag)
            if result is not None and math.isfinite(result.step_s) and (best is None or result.step_s < best.step_s):
                best = DispatchedPlan(forward, backward, list(order), micro_batches, result.step_s, result)
    return best
