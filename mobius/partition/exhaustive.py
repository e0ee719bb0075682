"""Exact checker: every contiguous partition of a small layer list, under the same cost model.

A list of L layers has 2^(L-1) contiguous partitions (each gap between layers is a cut or not);
for L <= ~16 that is a few tens of thousands of evaluations.
"""

from __future__ import annotations

from mobius.partition.cost import Machine, evaluate
from mobius.partition.profile import Profile

MAX_LAYERS = 16


def exhaustive_optimum(profile: Profile, machine: Machine, micro_batches: int,
                       recompute: bool = True) -> tuple[float, list[tuple[int, int]]]:
    n = profile.n
    if n > MAX_LAYERS:
        raise ValueError(f"exhaustive search is for at most {MAX_LAYERS} layers, got {n}")
    best_t, best = float("inf"), []
    for mask in range(1 << (n - 1)):
        bounds, lo = [], 0
        for gap in range(n - 1):
            if mask >> gap & 1:
                bounds.append((lo, gap + 1))
                lo = gap + 1
        bounds.append((lo, n))
        if len(bounds) < min(machine.n, n):  # every worker holds a stage
            continue
        est = evaluate(profile, bounds, machine, micro_batches, recompute)
        if est.step_s < best_t:
            best_t, best = est.step_s, bounds
    return best_t, best
