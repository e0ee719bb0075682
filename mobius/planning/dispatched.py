"""The dispatched schedule's search (RoundPipe's schedule, :mod:`mobius.sim.dispatched`): the shape
of the fastest step found, each candidate simulated, as :mod:`mobius.planning.planner` searches the
bound schedule's.  A search of simulations over time-balanced partitions (evened over the GPUs'
turn), then the MIP's partitions (:mod:`mobius.partition.dispatched_mip`) of the fastest shapes,
then the head's stage deepened; where neither the lag, replicas nor fp16 forbids it, the kept stages that pay
for it resident on their GPUs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from mobius.partition.baselines import balanced_bounds
from mobius.partition.cost import stage_costs
from mobius.partition.dispatched_mip import DISPATCHED_EFFORT, solve_dispatched
from mobius.partition.profile import Profile
from mobius.runtime.spec import StepPrediction
from mobius.sim.dispatched import OVERLAPPED_STEPS, dispatched_fits, simulate_dispatched, simulated_steps
from mobius.sim.engine import CPU, SimResult
from mobius.stages.tasks import DispatchedShape, step_tasks, tasks_in_turn

REFINED = 3  # the tails and head splits fastest at two stages a GPU whose stage counts the search varies
STEADY_CANDIDATES = 5  # the plans fastest as single steps whose steady state the search compares
# Past SAMPLED, the plans fastest by their samples' steady state that are simulated whole: the
# samples rank them, not always in the order of the whole step (Llama-3.1-8B on 8x4090-4+4 at 256
# micro-batches without the lag, the host update charged 40 bytes a parameter: the third by its
# samples was 6% faster whole than the first)
WHOLE_CANDIDATES = 3
# The deepened heads' plans are simulated whole (but those that their busiest GPU's compute rules
# out): their samples rank them no better than by chance (Llama-3.1-8B on 8x4090-4+4 at 256
# micro-batches without the lag: 9 layers on 4 GPUs sampled at 23.4 s, whole 26.9 s, the fastest;
# 9 on 8 sampled at 21.7, whole 46.6).  The fastest DEEP_FINALISTS of them are compared with the
# best plan of a one-layer head.
DEEP_FINALISTS = 3
# Past this many micro-batches the search compares its plans' whole steps at this count (the
# one-layer heads' WHOLE_CANDIDATES, the deepened heads'), and simulates only the WHOLE_FINALISTS
# fastest there whole at the run's: a whole simulation costs what its micro-batches do
# (Llama-3.1-8B on 8 GPUs at 1,024 without the lag: 19 whole simulations, 64 s of the search's 75).
RANKED_AT = 256
WHOLE_FINALISTS = 2
MIP_SHAPES = 2  # the fastest shapes whose partitions the MIP cuts again
# Past twice the larger of these micro-batch counts the search compares plans by their steps at
# these two, extrapolated (the simulation's time grows with the micro-batches); the plan it keeps is
# then simulated whole.
SAMPLED = (16, 32)
# The MIP cuts for a step of at most this many micro-batches: its variables grow with them (Llama-3.1-8B
# on 8 GPUs: 7 s a solve at 256, minutes at 1,024), and the plan it gives is timed at the run's
# count, as every candidate is.
MIP_MICRO_BATCHES = 2 * SAMPLED[-1]
BALANCED, MIP = "time-balanced", "MIP"


@dataclass(frozen=True)
class DispatchedPlan:
    forward: list[tuple[int, int]]  # the forward stages' [start, end) layers
    backward: list[tuple[int, int]]  # the backward stages'; the last lies within the last forward stage
    order: list[int]  # the GPUs in turn
    micro_batches: int
    step_s: float  # predicted (simulated)
    kept: int = 0  # forward stages before the last whose backward runs where they ran, from kept activations
    head_gpus: int = 1  # GPUs the last forward stage's micro-batches are split over
    result: SimResult | None = None
    compute_s: float = 0.0  # what its busiest GPU computes a step: no steady state is shorter
    resident: tuple[tuple[int, int], ...] = ()  # kept stages on one GPU for good, updated there: (stage, GPU)
    partitioned_by: str = BALANCED  # or MIP: how its partitions were cut
    # Where its host updates start before clipping's norm: the step after one that clipped and a
    # step that clips (StepPrediction; set by the planner, :func:`waiting_step`).
    waiting_step_s: float | None = None
    clipped_step_s: float | None = None

    @property
    def head_layers(self) -> int:
        """The layers of the head's stage: the head and the blocks whose backward its pass runs."""
        return self.forward[-1][1] - self.forward[-1][0]

    def steps(self) -> StepPrediction:
        """Its predicted step, with those of steps that clip and of the steps after them."""
        return StepPrediction(self.step_s, self.waiting_step_s, self.clipped_step_s)

    def shape(self, profile: Profile) -> DispatchedShape:
        """What a run executes of this plan, with each task's micro-batch time on ``profile``'s GPUs
        (as the simulation charged it: what an emulated GPU takes)."""
        recomputing = len(self.backward) - 1 - self.kept
        fwd = stage_costs(profile, self.forward, recompute=False)
        bwd = stage_costs(profile, self.backward, recompute=True)
        no_recompute = stage_costs(profile, self.backward, recompute=False)
        backward = [(bwd if k < recomputing else no_recompute)[k] for k in range(len(self.backward))]
        # A kept stage's forward leaves every micro-batch's activations on its GPU.
        first_kept = len(self.forward) - 1 - self.kept
        shift = len(self.backward) - len(self.forward)
        forward_bytes = [c.mem_fwd - c.param_bytes
                         + (self.micro_batches * no_recompute[j + shift].kept_bytes if j >= first_kept else 0)
                         for j, c in enumerate(fwd[:-1])] + [fwd[-1].mem_fwd - fwd[-1].param_bytes]
        return DispatchedShape(self.forward, self.backward, self.order, self.kept, self.head_gpus,
                               [c.fwd_s for c in fwd], [c.bwd_s for c in backward],
                               forward_bytes, [c.mem_bwd - c.param_bytes for c in backward], list(self.resident))

    def gpu_of_tasks(self) -> list[tuple[str, int]]:
        """Which GPU runs each task of the first step, in order ("F3", "H.1", "B0", ...)."""
        return [(t.name, t.gpu) for t in step_tasks(self.forward, self.backward, self.kept, self.head_gpus,
                                                    self.order, self.micro_batches, resident=self.resident)]


def plan_dispatched(profile: Profile, topo, order: list[int], micro_batches: int,
                    memory_bytes: list[int] | None = None, adam_params_per_s: float | None = None,
                    optimizer_lag: int = 0, tied: bool = False, whole_step: bool = False,
                    mip_shapes: int = MIP_SHAPES, mip_effort: int = DISPATCHED_EFFORT,
                    deep_head: bool = True) -> DispatchedPlan | None:
    """The fastest dispatched step found: first the kept tail (one-layer stages, half the GPU count
    at a time, as long as they fit) and the head's GPUs, with two stages a GPU in each partition of
    the layers before the tail (one layer a stage where those do not fit); then, for the
    :data:`REFINED` best of those, the two partitions' stage counts (each partition time-balanced,
    exactly, for its count), all as single steps; then, for the ``mip_shapes`` best of all, the
    MIP's partitions with their stage counts (:mod:`mobius.partition.dispatched_mip`, each solve
    stopped at ``mip_effort`` limit checks).  The steady state of the :data:`STEADY_CANDIDATES`
    fastest time-balanced plans and the MIP's decides (past :data:`SAMPLED` from samples, then
    the :data:`WHOLE_CANDIDATES` best simulated whole).  Then (``deep_head``) the head's stage
    deepened by the last blocks (as deep as it fits, and shallower), over half the GPUs or all,
    without a kept tail, in a few stage counts before it, simulated whole where their busiest GPU's
    compute does not rule them out: the :data:`DEEP_FINALISTS` fastest kept where faster.  Without the lag (nor
    replicas, nor fp16), the kept stages to keep resident on the GPUs their forwards ran on
    (:func:`resident_for`).  A few dozen simulations and two solves: a few seconds for 8 GPUs, at any
    number of micro-batches (past :data:`SAMPLED`, the search simulates its plans at those counts).
    None where nothing fits.  ``tied``: the model's token table is tied to its head (the
    embedding's stage, whose update waits for the head's gradients, stays on the host);
    ``whole_step``: clipping or fp16 (:func:`simulate_dispatched`)."""
    n, layers = len(order), profile.n
    fwd_costs = [l.fwd_s for l in profile.layers]
    bwd_costs = [l.fwd_s + l.bwd_s for l in profile.layers]  # recomputed

    memory = memory_bytes or [int(g.memory_gb * 1e9) for g in topo.gpus]
    # The search meets a plan again (a count its stage counts clip to, a shape refined again, a
    # sample taken as a whole step): each is simulated once.  The simulator is deterministic.
    simulations: dict[tuple, SimResult | None] = {}

    def simulated(tail: int, heads: int, forward, backward, steps: int = 1, by: str = BALANCED,
                  exact: bool = False, at: int | None = None) -> DispatchedPlan | None:
        """The plan's step: simulated whole (``exact``, or few micro-batches), at ``at`` micro-batches
        (whole) where given, else from samples."""
        def run(m: int) -> SimResult | None:
            key = (tail, heads, tuple(forward), tuple(backward), steps, m)
            if key not in simulations:
                r = simulate_dispatched(profile, forward, backward, topo, order, m, memory_bytes, adam_params_per_s,
                                        optimizer_lag, tail, heads, steps, whole_step=whole_step)
                simulations[key] = r if r is not None and math.isfinite(r.step_s) else None
            return simulations[key]

        if at or exact or micro_batches <= 2 * SAMPLED[-1]:
            m = at or micro_batches
            r = run(m)
            return r and DispatchedPlan(forward, backward, list(order), m, r.step_s, tail, heads, r,
                                        r.compute_s, partitioned_by=by)
        if not dispatched_fits(profile, forward, backward, memory, order, micro_batches, tail, heads):
            return None
        if not all(samples := [run(m) for m in SAMPLED]):
            return None
        return DispatchedPlan(forward, backward, list(order), micro_batches, _extrapolated_s(samples, micro_batches),
                              tail, heads, compute_s=samples[-1].compute_s * micro_batches / SAMPLED[-1],
                              partitioned_by=by)

    def partitions(tail: int, sf: int, sb: int, depth: int = 1) -> tuple[list, list] | None:
        cut = layers - depth - tail  # the tail's one-layer stages, then the head's ``depth`` layers
        if cut < 1:
            return None
        sf, sb = min(sf, cut), min(sb, cut)
        rest = [(cut + k, cut + k + 1) for k in range(tail)] + [(layers - depth, layers)]
        return balanced_bounds(fwd_costs[:cut], sf) + rest, balanced_bounds(bwd_costs[:cut], sb) + rest

    def balanced(tail: int, heads: int, sf: int, sb: int, depth: int = 1, steps: int = 1) -> DispatchedPlan | None:
        cut = partitions(tail, sf, sb, depth)
        if not cut:
            return None
        evened = turn_balanced(profile, *cut, tail, heads, order, micro_batches, layers - depth - tail)
        return (evened != cut and simulated(tail, heads, *evened, steps)) or simulated(tail, heads, *cut, steps)

    seen: list[DispatchedPlan] = []
    for tail in range(0, layers - 1, max(1, n // 2)):
        # Where two stages a GPU do not fit, one layer a stage may.
        # (no more of the head's GPUs than micro-batches: each needs one)
        found = [p for heads in sorted({min(h, micro_batches) for h in (1, min(2, n), math.ceil(n / 2))})
                 if (p := balanced(tail, heads, 2 * n, 2 * n) or balanced(tail, heads, layers, layers))]
        if not found and tail:
            break  # a longer tail fits no better
        seen += found
    if not seen:
        return None
    for tail, heads in {(p.kept, p.head_gpus) for p in sorted(seen, key=lambda p: p.step_s)[:REFINED]}:
        for sf in sorted({max(1, n // 2), n, 2 * n, 3 * n, layers}):
            for sb in sorted({sf, sf + (sf + 1) // 2, 2 * sf}):
                if p := balanced(tail, heads, sf, sb):
                    seen.append(p)
    # The MIP's cuts of the fastest shapes, from their time-balanced ones.
    for p in sorted(seen, key=lambda p: p.step_s)[:mip_shapes]:
        tasks = step_tasks(p.forward, p.backward, p.kept, p.head_gpus, order, min(micro_batches, MIP_MICRO_BATCHES))
        found = solve_dispatched(profile, topo, tasks, p.kept, len(p.forward) - 1 - p.kept,
                                 len(p.backward) - 1 - p.kept, memory,
                                 adam_params_per_s or profile.host.adam_params_per_s, optimizer_lag, whole_step,
                                 warm=(p.forward, p.backward), effort=mip_effort)
        if found and (found.forward, found.backward) != (p.forward, p.backward) and \
                (q := simulated(p.kept, p.head_gpus, found.forward, found.backward, by=MIP)):
            seen.append(q)
    # The steady state of the plans fastest alone decides (the MIP's beside, not instead of, the
    # fastest time-balanced ones: it cuts for a step alone).
    fastest = sorted((p for p in seen if p.partitioned_by == BALANCED), key=lambda p: p.step_s)
    candidates = {}
    for p in fastest[:STEADY_CANDIDATES] + [p for p in seen if p.partitioned_by == MIP]:
        candidates.setdefault((p.kept, p.head_gpus, tuple(p.forward), tuple(p.backward)), p.partitioned_by)
    ranked = sorted((p for (tail, heads, fwd, bwd), by in sorted(candidates.items())
                     if (p := simulated(tail, heads, list(fwd), list(bwd), OVERLAPPED_STEPS, by))),
                    key=lambda p: p.step_s)
    # Past RANKED_AT micro-batches whole steps are compared at that count, then the fastest at the run's.
    ranked_at = RANKED_AT if micro_batches > RANKED_AT else None
    at_ranked = (ranked_at or micro_batches) / micro_batches  # a step's compute there, of the run's
    best = ranked[0]
    if best.result is None:  # ranked from samples: the few best simulated whole, the fastest kept
        best = min((simulated(p.kept, p.head_gpus, p.forward, p.backward, OVERLAPPED_STEPS, p.partitioned_by, True,
                              ranked_at) for p in ranked[:WHOLE_CANDIDATES]), key=lambda p: p.step_s)
    # The head's stage deepened by the last blocks: their backward then runs in the head's fused
    # pass, from one micro-batch's activations at a time, without recomputation, split over half
    # the GPUs or all of them (a deep head on fewer sets the pace).  As deep as it fits (the
    # deeper, the less a step computes), two thirds and four ninths of that (without the lag the
    # next step's loads wait for the deep stage's long update: Llama-3.1-8B on 8x4090-4+4 at 256
    # micro-batches, 9 layers were fastest there, 15 with the lag), each with the partitions before
    # it in a few stage counts, since the turns of the tasks over the GPUs balance some counts and
    # not others; without a kept tail (it and the deep stage's pass would hold their activations
    # on the same GPUs).  A group of its own, ranked by their whole steady states (their single
    # steps mislead, a long drain ends them, and so do their samples: see DEEP_FINALISTS), in the
    # order of their samples; not one whose busiest GPU computes no less than the fastest plan
    # found takes (nor will after resident stages, which compute the same).
    sampled: list[DispatchedPlan] = []
    for heads in sorted({min(h, micro_batches) for h in (math.ceil(n / 2), n)}) if deep_head else ():
        deepest = 1
        while (cut := partitions(0, n, n, deepest + 1)) and \
                dispatched_fits(profile, *cut, memory, order, micro_batches, 0, heads):
            deepest += 1
        for depth, (sf, sb) in itertools.product(sorted({d for d in (deepest, deepest * 2 // 3, deepest * 4 // 9)
                                                          if d > 1}),
                                                 sorted({(max(1, n // 4), max(1, n // 2)),
                                                         (max(1, n // 2), max(1, n // 2)), (max(1, n // 2), n),
                                                         (n, n)})):
            if p := balanced(0, heads, sf, sb, depth, OVERLAPPED_STEPS):
                sampled.append(p)
    deep: list[DispatchedPlan] = []
    for p in sorted(sampled, key=lambda p: p.step_s):
        if p.result is None:
            if p.compute_s * at_ranked >= min(q.step_s for q in [best, *deep]):
                continue
            p = simulated(p.kept, p.head_gpus, p.forward, p.backward, OVERLAPPED_STEPS, exact=True, at=ranked_at)
        if p:
            deep.append(p)
    finalists = [best] + sorted(deep, key=lambda p: p.step_s)[:DEEP_FINALISTS]
    if ranked_at:  # the fastest at RANKED_AT, whole at the run's count
        finalists = [q for p in sorted(finalists, key=lambda p: p.step_s)[:WHOLE_FINALISTS]
                     if (q := simulated(p.kept, p.head_gpus, p.forward, p.backward, OVERLAPPED_STEPS,
                                        p.partitioned_by, True))]
    if not optimizer_lag and profile.host.replicas == 1 and profile.dtype != "fp16":  # fp16's vote is the host's
        finalists = [resident_for(p, profile, topo, memory_bytes, adam_params_per_s, tied, whole_step)
                     for p in finalists]
    return min(finalists, key=lambda p: p.step_s)


def turn_balanced(profile: Profile, forward: list[tuple[int, int]], backward: list[tuple[int, int]], kept: int,
                  head_gpus: int, order: list[int], micro_batches: int, cut: int) -> tuple[list, list]:
    """``forward`` and ``backward`` with their cuts before layer ``cut`` moved, a layer at a time,
    while that lowers what the busiest GPU computes over a whole turn of the GPUs: each stage
    balanced alone is not enough, since the turn gives each GPU the same places in every step
    where the step's tasks and the GPUs share a factor (Llama-3.1-8B on 8x4090-4+4: 10 tasks over
    8 GPUs, blocks of backward stages 4, 5, 4, 5 put both fives on the same four GPUs, which
    computed 10% more than the others).  What a GPU computes: each of its tasks' micro-batches
    times the task's layers' passes (the head's task: its forward and its backward, a backward
    stage without its forward where it is kept, with it where it recomputes)."""
    fwd = [l.fwd_s for l in profile.layers]
    bwd = [l.bwd_s for l in profile.layers]
    gpus = len(order)
    in_turn = tasks_in_turn(forward, backward, kept, head_gpus)
    turn = gpus // math.gcd(in_turn, gpus)  # steps until the turn starts where it started
    runs: dict[str, dict[int, int]] = {}  # task name -> GPU -> its micro-batches over the turn
    for t in step_tasks(forward, backward, kept, head_gpus, order, micro_batches, turn):
        on = runs.setdefault(t.name, {})
        on[t.gpu] = on.get(t.gpu, 0) + len(t.micro_batches)

    def busiest(fw: list[tuple[int, int]], bw: list[tuple[int, int]]) -> tuple[float, float]:
        head = sum(fwd[fw[-1][0]:fw[-1][1]]) + sum(bwd[bw[-1][0]:bw[-1][1]])
        work = {f"F{j}": sum(fwd[lo:hi]) for j, (lo, hi) in enumerate(fw[:-1])}
        work.update({f"B{k}": sum(bwd[lo:hi]) + (sum(fwd[lo:hi]) if k < len(bw) - 1 - kept else 0.0)
                     for k, (lo, hi) in enumerate(bw[:-1])})
        load = dict.fromkeys(order, 0.0)
        for name, on in runs.items():
            for g, m in on.items():
                load[g] += m * (head if name.startswith("H") else work[name])
        return max(load.values()), sum(x * x for x in load.values())

    best, parts = busiest(forward, backward), [list(forward), list(backward)]
    while True:
        moves = []
        for which, bounds in enumerate(parts):
            for j in range(len(bounds) - 1):
                if bounds[j][1] >= cut:
                    break
                for by in (-1, 1):
                    edge = bounds[j][1] + by
                    if bounds[j][0] < edge < bounds[j + 1][1]:
                        moved = [*bounds[:j], (bounds[j][0], edge), (edge, bounds[j + 1][1]), *bounds[j + 2:]]
                        trial = [moved, parts[1]] if which == 0 else [parts[0], moved]
                        moves.append((busiest(*trial), trial))
        if not moves or (step := min(moves, key=lambda m: m[0]))[0] >= best:
            return parts[0], parts[1]
        best, parts = step


def waiting_step(plan: DispatchedPlan, profile: Profile, topo, memory_bytes: list[int] | None = None,
                 adam_params_per_s: float | None = None) -> tuple[float, float]:
    """``plan``'s step (without the lag) where every host update waits for the step's last gradient,
    as the steps after one that clipped do, and its busiest host thread's AdamW seconds a step (what
    a step that clips takes back before it redoes them)."""
    r = simulate_dispatched(profile, plan.forward, plan.backward, topo, plan.order, plan.micro_batches, memory_bytes,
                            adam_params_per_s, 0, plan.kept, plan.head_gpus, resident=plan.resident, whole_step=True)
    threads: dict[int, float] = {}
    for t in r.tasks:
        if t.kind == CPU:
            threads[t.gpu] = threads.get(t.gpu, 0.0) + t.work
    return r.step_s, max(threads.values(), default=0.0) / simulated_steps(OVERLAPPED_STEPS)


def _extrapolated_s(samples: list[SimResult], micro_batches: int) -> float:
    """A step of ``micro_batches`` from its steps at :data:`SAMPLED`'s counts: past the pipeline's
    fill and drain each micro-batch adds the same time to the device work (at 256 from 16 and 32:
    within 0.3% of the whole simulation on Llama-3.1-8B on 8x4090-4+4; at 128, 4% on GPT-2 with the lag,
    whose short steps overlap more), and the steady state's floor (a step's host AdamW or network
    exchanges) does not grow with them.  Never less than the busiest GPU's compute, which grows
    with the micro-batches exactly: where the samples are bound by their loads, not their compute,
    their line falls short (Llama-3.1-8B, fp16 accumulation, the lag: 14.1 s at 256 for a plan whose
    whole step is its busiest GPU's compute, 23.0 s).  It ranks plans; the plan kept is simulated whole."""
    (a, b), (ra, rb) = SAMPLED, samples
    device = [r.step_s if r.device_s is None else r.device_s for r in (ra, rb)]
    return max(device[1] + (device[1] - device[0]) / (b - a) * (micro_batches - b),
               rb.compute_s * micro_batches / b, rb.floor_s)


def resident_for(plan: DispatchedPlan, profile: Profile, topo, memory_bytes: list[int] | None = None,
                 adam_params_per_s: float | None = None, tied: bool = False,
                 whole_step: bool = False) -> DispatchedPlan:
    """``plan`` with the kept stages that pay for it resident on the GPU their forward ran on
    (updated there, their weights never reloaded), as the bound plan chooses its resident stages:
    greedily, the most trained parameters first, each kept where the step is still feasible and at
    least 0.1% faster.  Not a stage that trains nothing, nor a tied table's (its update needs the
    head's gradients, on the host)."""
    first_kept = len(plan.forward) - 1 - plan.kept
    ran_on = dict(plan.gpu_of_tasks())
    costs = stage_costs(profile, plan.forward, recompute=False)
    candidates = [j for j in range(first_kept, len(plan.forward) - 1)
                  if costs[j].grad_bytes and not (tied and plan.forward[j][0] == 0)]
    best = plan
    for j in sorted(candidates, key=lambda j: (-costs[j].grad_bytes, j)):
        resident = tuple(sorted(best.resident + ((j, ran_on[f"F{j}"]),)))
        r = simulate_dispatched(profile, plan.forward, plan.backward, topo, plan.order, plan.micro_batches,
                                memory_bytes, adam_params_per_s, 0, plan.kept, plan.head_gpus, resident=resident,
                                whole_step=whole_step)
        if r is not None and r.step_s < best.step_s * (1 - 1e-3):
            best = replace(plan, step_s=r.step_s, result=r, resident=resident)
    return best
