"""The Mobius partition MIP (§3.2, Table 2, constraints 4-11) in PuLP, solved by HiGHS.

The equations are those of :mod:`mobius.partition.cost` (read its docstring first); here they
become linear constraints over the partition.  Two departures from the paper's B[i][j] encoding,
both exact:

* **Layer similarity in the formulation.**  Layers are grouped into runs of identical layers
  (``Profile.runs``: for a GPT, embedding / N blocks / head).  The decision variables are
  ``y[r][j]`` = how many layers of run ``r`` are in stages ``0..j`` (integer), so identical
  blocks are counted, not placed one by one: no symmetric copies of one solution, and a 66-layer
  model has 3 runs instead of 66x66 booleans.  Heterogeneous lists are runs of length 1.
* **Logical stages.**  ``K`` logical stages are allocated (at most the number of layers); used
  stages form a prefix (``u[j] >= u[j+1]``).  An unused stage has no layers, zero times and zero
  boundary activation (the last layer so far is the head, whose output is not transferred), so
  every constraint through it is vacuous; the backward load of stage ``j`` only exists when stage
  ``j+N`` is used (otherwise ``j`` is still resident), linearised with a big-M on bytes.

Constraints (8)-(10) are written as the paper means them (a start time is at least the finish of
what it depends on).  Units: seconds and GB, so coefficients stay within a few orders of magnitude.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from mobius.models.precision import element_bytes
from mobius.partition import highs
from mobius.partition.cost import GB, Machine, evaluate
from mobius.partition.profile import Profile



def default_effort(rows: int) -> int:
    """HiGHS's effort (limit checks, the search's nodes counted in: :mod:`mobius.partition.highs`)
    a partition solve of ``rows`` constraints takes unless told: a check at the root costs about
    the square of the rows (on 2 cores: a 14-layer model's ~1,200 rows reach the optimum in 80
    checks, 2-3 s; Llama-3.1-8B's 4,558 rows at 16 micro-batches take 15 s for 60 where the root
    takes them all, its 14,254 at 64 took 508 s for 60), so the count shrinks as the model grows,
    for a search of seconds; how far it goes is still the model's fact, never the machine's load."""
    return int(min(100, max(4, round(60 * (4500 / rows) ** 2))))



def _integer_start(bounds: list[tuple[int, int]], runs: list[tuple[int, int]], K: int) -> dict[str, float]:
    """Values of the integer variables that encode the partition ``bounds``."""
    start: dict[str, float] = {}
    ends = [hi for _, hi in bounds] + [bounds[-1][1]] * (K - len(bounds))
    for j in range(K):
        done = ends[j]
        prev = ends[j - 1] if j else 0
        start[f"u_{j}"] = 1.0 if j < len(bounds) else 0.0
        for r, (lo, hi) in enumerate(runs):
            in_run = min(max(done - lo, 0), hi - lo)
            start[f"y_{r}_{j}"] = float(in_run)
            start[f"h_{r}_{j}"] = 1.0 if in_run >= 1 else 0.0
            start[f"f_{r}_{j}"] = 1.0 if in_run == hi - lo else 0.0
            start[f"z_{r}_{j}"] = 1.0 if min(done, hi) > max(prev, lo) else 0.0
    return start


def _serial_bound_s(profile: Profile, machine: Machine, micro_batches: int, recompute: bool) -> float:
    """Seconds every operation of a step would take one after another, at the slowest rate of
    each kind: longer than any schedule's path (the big-M of the constraints that hold for the
    last stage only)."""
    n = machine.n
    slowest = min(min(machine.bandwidth), *(machine.link_bps(k) for k in range(n)),
                  *(machine.rc_bps(k) for k in range(n)), *(machine.upload_bps(k) for k in range(n)),
                  *(machine.upload_backward_bps(k) for k in range(n)),
                  *(machine.forward_d2h_bps(k) for k in range(n)), *(machine.backward_d2h_bps(k) for k in range(n)))
    elt = element_bytes(profile.dtype)
    total = 0.0
    for x in profile.layers:
        per_micro_batch = (2 * x.fwd_s + x.bwd_s + 2 * machine.micro_batch_s + 2 * machine.handoff_s
                           + 5 * x.out_bytes / slowest)
        total += (micro_batches * per_micro_batch + 2 * machine.stage_switch_s
                  + (2 * x.param_bytes + 2 * x.trained_bytes) / slowest
                  + x.trained_bytes / elt / machine.update_params_per_s)
    return total


@dataclass
class MipResult:
    bounds: list[tuple[int, int]]
    objective_s: float
    status: str
    solve_s: float
    gap: float  # relative MIP gap HiGHS reached
    n_variables: int
    n_constraints: int


class PartitionMip:
    """The MIP for one profile and machine, built in the order the paper states it: the variables
    and the expressions made of them (stage sizes, times and memory, :meth:`__init__`), the
    partition's structure and memory (4), the forward pass (5)-(10), the backward pass (11), the
    gradients' way home and the updates, and the objective, the step's end (:meth:`objective`)."""

    def __init__(self, profile: Profile, machine: Machine, micro_batches: int, recompute: bool,
                 max_stages: int | None):
        self.profile, self.machine, self.recompute = profile, machine, recompute
        self.n, self.M = machine.n, micro_batches
        self.runs = profile.runs()
        R, L = len(self.runs), profile.n
        self.R, self.L = R, L
        K = self.K = min(max_stages or L, L)
        self.length = [hi - lo for lo, hi in self.runs]
        first = [profile.layers[lo] for lo, _ in self.runs]
        self.p = [x.param_bytes / GB for x in first]
        self.g = [x.trained_bytes / GB for x in first]  # gradients (under LoRA, the adapters' only)
        self.f = [x.fwd_s for x in first]
        self.b = [x.bwd_s + (x.fwd_s if recompute else 0.0) for x in first]
        self.out = [x.out_bytes / GB for x in first]
        self.fw = [x.fwd_work_bytes / GB for x in first]
        self.bw_work = [x.bwd_work_bytes / GB for x in first]
        self.held = [x.held_bytes / GB for x in first]
        self.Bw = [machine.bandwidth[j % self.n] / GB for j in range(K)]  # GB/s
        self.G = [machine.memory[j % self.n] / GB for j in range(K)]
        self.total_p = sum(self.p[r] * self.length[r] for r in range(R))
        self.prob = pulp.LpProblem("mobius_partition", pulp.LpMinimize)
        self._variables()
        self._stage_expressions()

    def V(self, name: str, low=None, up=None, cat: str = "Continuous") -> pulp.LpVariable:
        return self.prob.add_variable(name, low, up, cat=cat)

    def _variables(self) -> None:
        R, K, M, V = self.R, self.K, self.M, self.V
        self.y = [[V(f"y_{r}_{j}", 0, self.length[r], cat="Integer") for j in range(K)] for r in range(R)]
        self.h = [[V(f"h_{r}_{j}", cat="Binary") for j in range(K)] for r in range(R)]  # run r started by stage j
        self.fin = [[V(f"f_{r}_{j}", cat="Binary") for j in range(K)] for r in range(R)]  # run r finished by j
        self.z = [[V(f"z_{r}_{j}", cat="Binary") for j in range(K)] for r in range(R)]  # stage j holds run r
        self.u = [V(f"u_{j}", cat="Binary") for j in range(K)]
        self.w = [V(f"w_{j}", 0) for j in range(K)]
        self.tf = [[V(f"tf_{j}_{m}", 0) for m in range(M)] for j in range(K)]
        self.tb = [[V(f"tb_{j}_{m}", 0) for m in range(M)] for j in range(K)]
        no_prefetch = None if self.machine.prefetch else 0  # --no-prefetch: nothing loads ahead
        self.pf = [V(f"pf_{j}", 0, no_prefetch) for j in range(K)]
        self.pb = [V(f"pb_{j}", 0, no_prefetch) for j in range(K)]
        self.lb = [V(f"lb_{j}", 0) for j in range(K)]

    def cnt(self, r: int, j: int):
        """Layers of run ``r`` in stage ``j``."""
        return self.y[r][j] - (self.y[r][j - 1] if j else 0)

    def act_in(self, j: int):
        return self.act[j - 1] if j else 0

    def per_stage(self, coefficient: list[float]) -> list:
        """``sum_r coefficient[r] * layers of run r in stage j``, for every stage ``j``."""
        return [pulp.lpSum(coefficient[r] * self.cnt(r, j) for r in range(self.R)) for j in range(self.K)]

    def _stage_expressions(self) -> None:
        """Each stage's bytes, times and memory as expressions of the variables."""
        R, K, n, machine, recompute, prob = self.R, self.K, self.n, self.machine, self.recompute, self.prob
        h, u = self.h, self.u
        self.S, F, Bk = self.per_stage(self.p), self.per_stage(self.f), self.per_stage(self.b)
        # Boundary activation of stage j: out of the run holding the last layer placed so far.
        self.act = [pulp.lpSum(self.out[r] * (h[r][j] - (h[r + 1][j] if r + 1 < R else 0)) for r in range(R))
                    for j in range(K)]
        act, act_in = self.act, self.act_in
        # What occupies the device per micro-batch (cost.on_device): compute, the copies on the compute
        # stream, the fixed per-micro-batch cost of each pass; a hand-off between workers (cost.evaluate's xfer).
        o = machine.micro_batch_s
        self.handoff, self.switch = (machine.handoff_s if n > 1 else 0.0), machine.stage_switch_s
        # GB/s of the compute stream's copies, in forward and in backward
        Up = [machine.upload_bps(j % n) / GB for j in range(K)]
        Ub = [machine.upload_backward_bps(j % n) / GB for j in range(K)]
        self.Fd = [F[j] + act_in(j) * (1.0 / Up[j]) + o * u[j] for j in range(K)]
        Bd = [Bk[j] + act[j] * (1.0 / Ub[j]) + (act_in(j) * (1.0 / Ub[j]) if recompute else 0)
              + o * (2 if recompute else 1) * u[j]
              for j in range(K)]
        # The last used stage (the head) runs each micro-batch's backward right after its forward
        # (cost.evaluate): last[j] = u[j] - u[j+1].  Its constraints hold where last[j] = 1 and are
        # lifted by ``big`` (longer than any schedule) elsewhere.
        self.last = [u[j] - (u[j + 1] if j + 1 < K else 0) for j in range(K)]
        self.big = 2 * _serial_bound_s(self.profile, machine, self.M, recompute) + 1.0
        if recompute:  # ... and never recomputes: its backward is spared the forward again (exact: the
            # solver takes all of ``spared`` there, as a shorter backward only loosens the constraints)
            spared = [self.V(f"spared_{j}", 0) for j in range(K)]
            for j in range(K):
                prob += spared[j] <= F[j] + act_in(j) * (1.0 / Ub[j]) + o * u[j]
                prob += spared[j] <= self.big * self.last[j]
            Bd = [Bd[j] - spared[j] for j in range(K)]
        self.Bd = Bd
        self.grad = self.per_stage(self.g)  # GB
        self.adam = [self.grad[j] * (GB / element_bytes(self.profile.dtype) / machine.update_params_per_s)
                     for j in range(K)]
        self.Wf = [self.S[j] + self.w[j] + 2 * act_in(j) for j in range(K)]
        self.kept = [pulp.lpSum(self.bw_work[r] * self.cnt(r, j) for r in range(R)) + 2 * act_in(j) + 2 * act[j]
                     for j in range(K)]
        self.Wb = [self.S[j] + pulp.lpSum((self.g[r] + self.held[r]) * self.cnt(r, j) for r in range(R)) + self.kept[j]
                   for j in range(K)]

    def structure_and_memory(self) -> None:
        """Stages partition the runs in order, every worker holds one, used stages form a prefix;
        (4) memory: without recomputation a slot keeps every micro-batch's activations of all its
        stages until their backward (cost.activations_overflow)."""
        prob, R, K, L, n, M = self.prob, self.R, self.K, self.L, self.n, self.M
        y, h, fin, z, u, length = self.y, self.h, self.fin, self.z, self.u, self.length
        for r in range(R):
            prob += y[r][K - 1] == length[r]
            for j in range(K):
                if j:
                    prob += y[r][j] >= y[r][j - 1]
                prob += y[r][j] >= h[r][j]
                prob += y[r][j] <= length[r] * h[r][j]
                prob += y[r][j] >= length[r] * fin[r][j]
                if r + 1 < R:
                    prob += y[r + 1][j] <= length[r + 1] * fin[r][j]  # contiguity: runs in order
                prob += self.cnt(r, j) <= length[r] * z[r][j]
                prob += self.w[j] >= self.fw[r] * z[r][j]
        for j in range(min(n, K)):  # every worker holds a stage (its process has nothing else to do)
            prob += u[j] == 1
        for j in range(K):
            total_j = pulp.lpSum(self.cnt(r, j) for r in range(R))
            prob += total_j >= u[j]
            prob += total_j <= L * u[j]
            if j + 1 < K:
                prob += u[j] >= u[j + 1]
            prob += self.Wf[j] <= self.G[j]
            prob += self.Wb[j] <= self.G[j]
            if not self.recompute:
                prob += self.Wb[j] + M * pulp.lpSum(self.kept[k] for k in range(j % n, K, n)) <= self.G[j]

    def forward(self) -> None:
        """(9) load, (5)-(7) prefetch, (10) order, (8) dependencies; a pass starts a switch after
        the slot's previous pass (cost.evaluate)."""
        prob, K, n, M, machine = self.prob, self.K, self.n, self.M, self.machine
        tf, S, Fd, u, pf, Bw, switch = self.tf, self.S, self.Fd, self.u, self.pf, self.Bw, self.switch
        for j in range(K):
            if j < n:  # the first loads all start at once (cost.Machine.first_load_s)
                prob += tf[j][0] >= switch * u[j]
                if machine.link:
                    prob += tf[j][0] >= S[j] * (GB / machine.link[j])
                    prob += tf[j][0] >= pulp.lpSum(S[k] for k in machine.first_wave_peers[j] if k < K) * (
                        GB / machine.rc_bandwidth[j])
                else:
                    prob += tf[j][0] >= S[j] * (1.0 / Bw[j])
            else:
                prob += tf[j][0] >= tf[j - n][M - 1] + Fd[j - n] + (S[j] - pf[j]) * (1.0 / Bw[j])
                prob += tf[j][0] >= tf[j - n][M - 1] + Fd[j - n] + switch * u[j]
                prob += pf[j] <= S[j]
                prob += pf[j] <= self.G[j] - self.Wf[j - n]
                prob += pf[j] <= Bw[j] * (Fd[j - n] + tf[j - n][M - 1] - tf[j - n][0])
            for m in range(M):
                if m:
                    prob += tf[j][m] >= tf[j][m - 1] + Fd[j]
                if j:
                    prob += tf[j][m] >= (tf[j - 1][m] + Fd[j - 1]
                                         + self.act[j - 1] * (GB / machine.forward_d2h_bps((j - 1) % n))
                                         + self.handoff * u[j])

    def backward(self) -> None:
        """(11) after the slot's forward pass (the head: each micro-batch after its forward, before
        the next one's), then the mirror image of the forward."""
        prob, K, n, M, machine = self.prob, self.K, self.n, self.M, self.machine
        tf, tb, Fd, Bd, u, last, big = self.tf, self.tb, self.Fd, self.Bd, self.u, self.last, self.big
        S, lb, pb, Bw, switch = self.S, self.lb, self.pb, self.Bw, self.switch
        for j in range(K - 1, -1, -1):
            if j + 1 < K:  # its own forward pass before, where the stage is used and not the last
                prob += tb[j][0] >= tf[j][M - 1] + Fd[j] + switch - big * (1 - u[j + 1])
            for m in range(M):
                prob += tb[j][m] >= tf[j][m] + Fd[j] - big * (1 - last[j])
                if m:
                    prob += tf[j][m] >= tb[j][m - 1] + Bd[j] - big * (1 - last[j])
            if j + n < K:
                prob += lb[j] >= S[j] - self.total_p * (1 - u[j + n])
                prob += tb[j][0] >= tb[j + n][M - 1] + Bd[j + n] + (lb[j] - pb[j]) * (1.0 / Bw[j])
                prob += tb[j][0] >= tb[j + n][M - 1] + Bd[j + n] + switch * u[j + n]
                prob += pb[j] <= lb[j]
                prob += pb[j] <= self.G[j] - self.Wb[j + n]
                prob += pb[j] <= Bw[j] * (Bd[j + n] + tb[j + n][M - 1] - tb[j + n][0])
            for m in range(M):
                if m:
                    prob += tb[j][m] >= tb[j][m - 1] + Bd[j]
                if j + 1 < K:
                    prob += tb[j][m] >= (tb[j + 1][m] + Bd[j + 1]
                                         + self.act[j] * (GB / machine.backward_d2h_bps((j + 1) % n))
                                         + self.handoff * u[j + 1])

    def objective(self) -> None:
        """Gradients home (cost.evaluate): through the stage's link, queued behind the offload
        before it under the same root complex.  The step ends when every stage's gradients are home
        and updated: a worker's optimizer thread updates its stages in backward order, each once
        its gradients are home.  With the lag, the updates leave the step; each worker's optimizer
        thread must still keep up.  The step is the objective."""
        prob, K, n, M, machine, adam = self.prob, self.K, self.n, self.M, self.machine, self.adam
        home = [self.V(f"home_{j}", 0) for j in range(K)]
        for j in range(K):
            prob += home[j] >= self.tb[j][M - 1] + self.Bd[j] + self.grad[j] * (GB / machine.link_bps(j % n))
            q = machine.previous_on_root_complex(j, K)
            if q is not None:
                prob += home[j] >= home[q] + self.grad[j] * (GB / machine.rc_bps(j % n))
        step = self.V("step", 0)
        if machine.optimizer_lag:
            for j in range(K):
                prob += step >= home[j]
            for k in range(n):
                prob += step >= pulp.lpSum(adam[j] for j in range(k, K, n))
        else:
            upd = [self.V(f"upd_{j}", 0) for j in range(K)]
            for j in range(K):
                prob += upd[j] >= home[j] + adam[j]
                if j + n < K:
                    prob += upd[j] >= upd[j + n] + adam[j]
                prob += step >= upd[j]
        prob += step

    def bounds_of(self, values: dict[str, float]) -> list[tuple[int, int]]:
        """The partition a solution's values encode: stage j ends after sum_r y[r][j] layers (runs
        are consumed in order)."""
        bounds, done = [], 0
        for j in range(self.K):
            cum = sum(round(values[self.y[r][j].name]) for r in range(self.R))
            if cum > done:
                bounds.append((done, cum))
                done = cum
        return bounds


def solve_partition(profile: Profile, machine: Machine, micro_batches: int, recompute: bool = True,
                    max_stages: int | None = None, effort: int | None = None, gap: float = 1e-3,
                    warm_start: list[tuple[int, int]] | None = None,
                    time_limit_s: float = highs.SAFETY_TIME_LIMIT_S) -> MipResult:
    """Optimal contiguous partition of ``profile`` into stages for ``machine`` (slots = GPUs).

    ``effort``: HiGHS's limit checks before it stops (:mod:`mobius.partition.highs`); None, by the
    model's size (:func:`default_effort`).
    ``warm_start``: a known feasible partition (the best baseline's) given to HiGHS as its first
    incumbent, so a solve stopped early is never worse than it.
    """
    mip = PartitionMip(profile, machine, micro_batches, recompute, max_stages)
    mip.structure_and_memory()
    mip.forward()
    mip.backward()
    mip.objective()
    start = _integer_start(warm_start, mip.runs, mip.K) if warm_start and len(warm_start) <= mip.K else {}
    t0 = time.perf_counter()
    effort = effort or default_effort(mip.prob.numConstraints())
    solved = highs.solve(mip.prob, start, effort, gap, time_limit_s)
    solve_s = time.perf_counter() - t0
    sizes = (solved.n_variables, solved.n_constraints)
    bounds = mip.bounds_of(solved.values) if solved.values is not None else []
    if not bounds or bounds[-1][1] != profile.n:  # none, or HiGHS proved it infeasible (values that are no partition)
        return MipResult([], float("inf"), solved.status, solve_s, solved.gap, *sizes)
    est = evaluate(profile, bounds, machine, micro_batches, recompute)
    return MipResult(bounds, est.step_s, solved.status, solve_s, solved.gap, *sizes)
