"""Baseline partitioners, returning the same ``[start, end)`` stage bounds as the MIP.

* minimum-stage: one layer per stage (smallest stages, most activation traffic);
* maximum-stage: greedily as many layers per stage as fit in memory (no room left to prefetch);
* uniform: equal layer counts; time-balanced: contiguous parts with balanced forward+backward time
  (torchgpipe's balance-by-time).  Both try every stage count that is a multiple of the GPU count
  and whose stages fit, and keep the fastest under the cost model.
"""

from __future__ import annotations

import numpy as np

from mobius.partition.cost import Machine, evaluate, stage_costs
from mobius.partition.profile import Profile


def min_stage(profile: Profile, machine: Machine, micro_batches: int, recompute: bool = True) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(profile.n)]


def max_stage(profile: Profile, machine: Machine, micro_batches: int, recompute: bool = True) -> list[tuple[int, int]]:
    bounds, lo = [], 0
    while lo < profile.n:
        mem = machine.memory[len(bounds) % machine.n]
        hi = lo + 1
        while hi < profile.n:
            c = stage_costs(profile, [(lo, hi + 1)], recompute)[0]
            if max(c.mem_fwd, c.mem_bwd) > mem:
                break
            hi += 1
        bounds.append((lo, hi))
        lo = hi
    return bounds


def uniform_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    edges = [round(k * n_layers / stages) for k in range(stages + 1)]
    return [(edges[k], edges[k + 1]) for k in range(stages)]


def balanced_bounds(costs: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``stages`` parts minimising the largest part (exact DP):
    ``best[k][i]``, the largest part of the first ``i`` costs in ``k`` parts, is the least over the
    last cut ``s < i`` of ``max(best[k-1][s], sum(costs[s:i]))``, each row at once; of equal splits,
    the earliest last cut."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = np.asarray(prefix)
    part = ends[:, None] - ends[None, :]  # part[i, s]: the sum of costs[s:i]
    part[~np.tri(n + 1, k=-1, dtype=bool)] = np.inf  # a part holds at least one cost: s < i
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cuts = []
    for _ in range(stages):
        largest = np.maximum(best[None, :], part)
        cut = largest.argmin(axis=1)  # the first least, as a scan keeping only strictly smaller ones
        best = largest[np.arange(n + 1), cut]
        cuts.append(cut)
    bounds, i = [], n
    for cut in reversed(cuts):
        s = int(cut[i])
        bounds.append((s, i))
        i = s
    return bounds[::-1]


def _best_multiple(profile, machine, micro_batches, recompute, make) -> list[tuple[int, int]]:
    best, best_t = None, float("inf")
    for stages in range(machine.n, profile.n + 1, machine.n):
        bounds = make(stages)
        est = evaluate(profile, bounds, machine, micro_batches, recompute)
        if est.feasible and est.step_s < best_t:
            best, best_t = bounds, est.step_s
    return best or min_stage(profile, machine, micro_batches, recompute)


def uniform(profile: Profile, machine: Machine, micro_batches: int, recompute: bool = True) -> list[tuple[int, int]]:
    return _best_multiple(profile, machine, micro_batches, recompute, lambda s: uniform_bounds(profile.n, s))


def layer_costs(profile: Profile) -> list[float]:
    """Each layer's forward and backward seconds: what a balanced partition evens out."""
    return [layer.fwd_s + layer.bwd_s for layer in profile.layers]


def balanced(profile: Profile, machine: Machine, micro_batches: int, recompute: bool = True) -> list[tuple[int, int]]:
    costs = layer_costs(profile)
    return _best_multiple(profile, machine, micro_batches, recompute, lambda s: balanced_bounds(costs, s))


BASELINES = {"min": min_stage, "max": max_stage, "uniform": uniform, "balanced": balanced}
