"""The dispatched schedule's two partitions as a MIP (PuLP, solved by HiGHS, as :mod:`.mip` is for
the bound schedule): for one shape of :mod:`mobius.sim.dispatched` (the stage counts of the layers
before the kept tail, forward and backward, the kept tail, the head's GPUs), where to cut each.

A time-balanced partition gives every stage the same compute; but a dispatched task also waits for
its weights, which stream in over its GPU's link while the GPU's previous task computes, and for
its inputs, which the task before it on another GPU sends; the first stages start the step and the
last ones end it.  The MIP weighs these as the simulator does, over the tasks of one step
(:func:`mobius.stages.tasks.step_tasks`, the caller's: which GPU runs each task follows from the
stage counts alone, so those of any partitions with the shape's counts):

* **Partition.**  ``yf[r][j]`` / ``yb[r][k]``: how many layers of run ``r`` (``Profile.runs``, as in
  :mod:`.mip`) the forward stages ``0..j`` / backward stages ``0..k`` hold, runs consumed in order,
  every stage non-empty.
* **Passes.**  ``t[i][m]``: when task ``i`` starts micro-batch ``m``; a pass takes its compute, its
  inputs' upload on the compute stream and the runtime's per-micro-batch work.  It starts after the
  task's previous micro-batch, after the pass before it in the chain (its output's copy to the host
  and the hand-off), after the GPU's previous task (and the switch), and once its weights are in.
* **Weights.**  Each GPU's loads follow one another on its link; what fits beside the GPU's previous
  task (``early[i]``) loads while that task computes, the rest once it is done.
* **Updates.**  A backward's gradients go home after its last pass and its AdamW runs on its GPU's
  host thread, the updates one after another (with clipping or fp16, each after the step's last
  gradients are home).  Without the optimizer lag the step ends with the last update; with it the
  step is the device work's end, or a host thread's AdamW if longer.

Where the simulator models more, the MIP assumes: each GPU's link at its fair share of its root
complex when every GPU under it streams at once (a dispatched step keeps them all streaming); every
cut in the partitioned layers passing the largest of their outputs and every pass's working memory
the largest of theirs (exact for a GPT: its blocks and its embedding emit one hidden state); the
kept tail's activations, held on their GPUs, left to the simulation.  :func:`mobius.planning.dispatched.plan_dispatched`
simulates what the MIP returns beside the time-balanced partitions and keeps the faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from mobius.models.precision import element_bytes
from mobius.partition import highs
from mobius.partition.cost import GB, stage_costs
from mobius.partition.profile import Profile

# HiGHS's limit checks a dispatched solve may take: its root LP is large, and its first checks come
# seconds apart (8B at 64 micro-batches: the 5th after 3 s on 2 cores, the 20th after 15 s).
DISPATCHED_EFFORT = 5


@dataclass
class DispatchedCut:
    forward: list[tuple[int, int]]  # the forward partition, the kept tail and the head's stage included
    backward: list[tuple[int, int]]
    objective_s: float  # the MIP's own step (the simulator's is what the plan compares)
    status: str
    solve_s: float


def _run_counts(prob: pulp.LpProblem, runs: list[tuple[int, int]], stages: int, name: str) -> list[list]:
    """Integer ``y[r][j]``: layers of run ``r`` in stages ``0..j``; runs consumed in order, every stage
    non-empty.  Returns ``y``."""
    length = [hi - lo for lo, hi in runs]
    y = [[prob.add_variable(f"{name}_{r}_{j}", 0, length[r], cat="Integer") for j in range(stages)]
         for r in range(len(runs))]
    done = [[prob.add_variable(f"{name}done_{r}_{j}", cat="Binary") for j in range(stages)] for r in range(len(runs))]
    for r in range(len(runs)):
        prob += y[r][stages - 1] == length[r]
        for j in range(stages):
            if j:
                prob += y[r][j] >= y[r][j - 1]
            prob += y[r][j] >= length[r] * done[r][j]
            if r + 1 < len(runs):
                prob += y[r + 1][j] <= length[r + 1] * done[r][j]
    for j in range(stages):
        prob += pulp.lpSum(y[r][j] - (y[r][j - 1] if j else 0) for r in range(len(runs))) >= 1
    return y


def _counts_of(bounds: list[tuple[int, int]], runs: list[tuple[int, int]], name: str) -> dict[str, float]:
    """The values of ``_run_counts``'s integers that encode ``bounds`` (a warm start)."""
    start = {}
    for j, (_, end) in enumerate(bounds):
        for r, (lo, hi) in enumerate(runs):
            start[f"{name}_{r}_{j}"] = float(min(max(end - lo, 0), hi - lo))
            start[f"{name}done_{r}_{j}"] = 1.0 if end >= hi else 0.0
    return start


def _bounds_of(values: dict[str, float], runs: list[tuple[int, int]], stages: int, name: str) -> list[tuple[int, int]]:
    ends = [sum(round(values[f"{name}_{r}_{j}"]) for r in range(len(runs))) for j in range(stages)]
    return list(zip([0, *ends[:-1]], ends))


class _Model:
    """The MIP of one shape (see the module's docstring), built task by task in issue order."""

    def __init__(self, profile: Profile, topo, tasks: list, kept: int, stages_fwd: int, stages_bwd: int,
                 memory_bytes: list[int], adam_params_per_s: float, optimizer_lag: int, whole_step: bool):
        self.host, self.tasks = profile.host, tasks
        layers = profile.n
        cut = layers - 1 - kept
        self.runs = [(lo, min(hi, cut)) for lo, hi in profile.runs() if lo < cut]
        self.sf, self.sb = stages_fwd, stages_bwd
        self.rest = [(cut + k, cut + k + 1) for k in range(kept)] + [(layers - 1, layers)]
        self.tail_fwd = stage_costs(profile, self.rest, recompute=False)
        self.prob = prob = pulp.LpProblem("mobius_dispatched_partition", pulp.LpMinimize)
        self.yf = _run_counts(prob, self.runs, stages_fwd, "yf")
        self.yb = _run_counts(prob, self.runs, stages_bwd, "yb")
        first = [profile.layers[lo] for lo, _ in self.runs]
        self.f = [x.fwd_s for x in first]
        self.b = [x.fwd_s + x.bwd_s for x in first]  # recomputed
        self.p = [x.param_bytes / GB for x in first]
        self.g = [x.trained_bytes / GB for x in first]
        self.held = [x.held_bytes / GB for x in first]
        self.bwd_work = [x.bwd_work_bytes / GB for x in first]
        prefix = profile.layers[:cut]
        self.act = max(x.out_bytes for x in prefix) / GB
        self.fwd_work = max(x.fwd_work_bytes for x in prefix) / GB
        # Each GPU's share of its root complex with every GPU under it streaming, capped by its link.
        under = {}
        for gpu in topo.gpus:
            under[gpu.root_complex] = under.get(gpu.root_complex, 0) + 1
        rc_bw = {rc.id: rc.host_bandwidth_gbps for rc in topo.root_complexes}
        self.bw = {gpu.index: min(gpu.link_bandwidth_gbps, rc_bw[gpu.root_complex] / under[gpu.root_complex])
                   for gpu in topo.gpus}  # GB/s
        self.G = [m / GB for m in memory_bytes]
        self.adam_s_per_gb = GB / element_bytes(profile.dtype) / adam_params_per_s
        self.lag, self.whole_step = optimizer_lag, whole_step

    def cnt(self, y, r: int, j: int):
        return y[r][j] - (y[r][j - 1] if j else 0)

    def sum_over(self, y, j: int, per_layer: list[float]):
        return pulp.lpSum(per_layer[r] * self.cnt(y, r, j) for r in range(len(self.runs)))

    def describe(self, t):
        """(micro-batch time, weights to load, gradients home, device memory of its pass): numbers
        for the kept tail and the head, expressions of the partition for the stages before."""
        o, a = self.host.micro_batch_s, self.act
        tail_index = t.stage - (self.sf if t.kind in "FH" else self.sb)
        if t.kind == "F" and tail_index < 0:
            j, y = t.stage, self.yf
            weights = self.sum_over(y, j, self.p)
            upload = a if j else 0.0
            return (self.sum_over(y, j, self.f) + upload / self.bw[t.gpu] + o, weights, 0.0,
                    weights + self.fwd_work + 2 * upload)
        if t.kind == "B" and tail_index < 0:
            k, y = t.stage, self.yb
            weights, grads = self.sum_over(y, k, self.p), self.sum_over(y, k, self.g)
            upload = a + (a if k else 0.0)
            memory = (weights + grads + self.sum_over(y, k, self.held) + self.sum_over(y, k, self.bwd_work)
                      + 2 * upload)
            return self.sum_over(y, k, self.b) + upload / self.bw[t.gpu] + 2 * o, weights, grads, memory
        c = self.tail_fwd[tail_index]
        upload = c.in_bytes / GB
        if t.kind == "F":
            return c.fwd_s + upload / self.bw[t.gpu] + o, c.param_bytes / GB, 0.0, c.mem_fwd / GB
        if t.kind == "H":
            return (c.fwd_s + c.bwd_s + upload / self.bw[t.gpu] + 2 * o, c.param_bytes / GB, c.grad_bytes / GB,
                    (c.mem_fwd + c.mem_bwd - c.param_bytes) / GB)  # its weights once
        # A kept stage's backward: its weights and its forward's activations are there.
        return c.bwd_s + (c.out_bytes / GB) / self.bw[t.gpu] + o, 0.0, c.grad_bytes / GB, c.mem_bwd / GB

    def build(self) -> None:
        prob, host = self.prob, self.host
        V = prob.add_variable
        handoff = host.handoff_s
        step = V("step", 0)
        last_on: dict[int, tuple[object, object]] = {}  # GPU -> (its last task's end, that task's memory)
        load_done: dict[int, pulp.LpVariable] = {}  # GPU -> its last load's end
        # (F|B, micro-batch) -> the latest pass of its chain: (its start, its duration)
        pass_of: dict[tuple[str, int], tuple[pulp.LpVariable, object]] = {}
        homes, updates = [], []
        adam_lane: dict[int, object] = {}
        head_home: list = []
        head_lanes: list[int] = []  # the GPUs of the head's parts, whose host threads split its update
        head_parts = sum(t.kind == "H" for t in self.tasks)
        for i, t in enumerate(self.tasks):
            d, weights, grads, memory = self.describe(t)
            prob += memory <= self.G[t.gpu]
            bw, g = self.bw[t.gpu], t.gpu
            first = [V(f"t_{i}_{m}", 0) for m in t.micro_batches]
            # Weights: after the GPU's previous load; what does not fit beside its previous task after it.
            loaded = V(f"loaded_{i}", 0)
            prob += loaded >= (load_done[g] if g in load_done else 0) + weights * (1.0 / bw)
            load_done[g] = loaded
            prob += first[0] >= loaded
            if g in last_on:
                before_end, before_memory = last_on[g]
                early = V(f"early_{i}", 0)
                prob += early <= weights
                prob += early <= self.G[g] - before_memory
                prob += first[0] >= before_end + host.stage_switch_s + (weights - early) * (1.0 / bw)
            # Passes: in micro-batch order, each after its input's pass (the head's input is the
            # forward chain's, and its pass, ending with its backward, goes on in the backward chain).
            takes, gives = ("F", "F") if t.kind == "F" else ("F", "B") if t.kind == "H" else ("B", "B")
            for n, (m, x) in enumerate(zip(t.micro_batches, first)):
                if n:
                    prob += x >= first[n - 1] + d
                if (takes, m) in pass_of:
                    source_start, source_d = pass_of[(takes, m)]
                    prob += x >= source_start + source_d + self.act * (1.0 / bw) + handoff
                pass_of[(gives, m)] = (x, d)
            end = V(f"end_{i}", 0)
            prob += end >= first[-1] + d
            prob += step >= end
            last_on[g] = (end, memory)
            if t.kind == "F":
                continue
            home = V(f"home_{i}", 0)
            prob += home >= end + grads * (1.0 / bw)
            homes.append(home)
            if t.kind == "H":  # one update, once every part's gradients are home, in a slice a part's thread
                head_home.append(home)
                head_lanes.append(g)
                if len(head_home) < head_parts:
                    continue
                adam = grads * self.adam_s_per_gb * self.host.split_update_factor(head_parts) / head_parts
                updates += [(f"{i}_{lane}", lane, adam, tuple(head_home)) for lane in head_lanes]
                continue
            updates.append((str(i), g, grads * self.adam_s_per_gb, (home,)))
        for i, g, adam, after in updates:
            updated = V(f"updated_{i}", 0)
            for h in (homes if self.whole_step else after):
                prob += updated >= h + adam
            if g in adam_lane:
                prob += updated >= adam_lane[g] + adam
            adam_lane[g] = updated
            if not self.lag:
                prob += step >= updated
        if self.lag:  # each host thread's AdamW of a step within the step
            for g in {g for _, g, _, _ in updates}:
                prob += step >= pulp.lpSum(adam for _, h, adam, _ in updates if h == g)
        prob += step

    def warm_start(self, forward: list[tuple[int, int]], backward: list[tuple[int, int]]) -> dict[str, float]:
        return {**_counts_of(forward[:self.sf], self.runs, "yf"), **_counts_of(backward[:self.sb], self.runs, "yb")}


def solve_dispatched(profile: Profile, topo, tasks: list, kept: int, stages_fwd: int, stages_bwd: int,
                     memory_bytes: list[int], adam_params_per_s: float, optimizer_lag: int = 0,
                     whole_step: bool = False, warm: tuple[list[tuple[int, int]], list[tuple[int, int]]] | None = None,
                     effort: int = DISPATCHED_EFFORT, gap: float = 1e-3,
                     time_limit_s: float = highs.SAFETY_TIME_LIMIT_S) -> DispatchedCut | None:
    """The forward and backward partitions of the shape (``stages_fwd`` / ``stages_bwd`` stages
    before the ``kept`` tail; ``tasks``, one step's, as :func:`mobius.stages.tasks.step_tasks` gives
    them for the shape) that the MIP finds fastest within ``effort`` (HiGHS's limit checks), from
    ``warm`` (a known pair of partitions of the whole model); None where it finds none."""
    if stages_fwd < 1 or stages_bwd < 1 or profile.n - 1 - kept < max(stages_fwd, stages_bwd):
        return None
    model = _Model(profile, topo, tasks, kept, stages_fwd, stages_bwd, memory_bytes, adam_params_per_s,
                   optimizer_lag, whole_step)
    model.build()
    t0 = time.perf_counter()
    solved = highs.solve(model.prob, model.warm_start(*warm) if warm else {}, effort, gap, time_limit_s)
    if solved.values is None:
        return None
    forward = _bounds_of(solved.values, model.runs, stages_fwd, "yf") + model.rest
    backward = _bounds_of(solved.values, model.runs, stages_bwd, "yb") + model.rest
    return DispatchedCut(forward, backward, solved.values["step"], solved.status, time.perf_counter() - t0)
