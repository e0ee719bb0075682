"""Cross mapping (Mobius §3.3): place pipeline slots on GPUs so adjacent stages sit under
different CPU root complexes.

Stage ``s`` runs on pipeline slot ``s mod N``; a mapping is ``order``, with slot ``k`` on GPU
``order[k]``.  The contention of two stages ``i < j`` is ``shared(i, j) / (j - i)`` (Eq. 12), where
``shared`` is the number of GPUs under the root complex both stages' GPUs hang off (0 when the root
complexes differ).  Two stages on the *same* GPU are excluded: one GPU swaps its stages in turn, so
they never transfer at once.  Cross mapping minimises the sum over all stage pairs (Eq. 13).

The search is exhaustive up to 8 GPUs.  GPUs of one root complex are interchangeable for Eq. 13, so
only the distinct sequences of root-complex labels over the slots are tried (8 GPUs as 4+4: 70
sequences instead of 40320 orders).  Beyond 8 GPUs a documented heuristic is used: greedily pick,
slot by slot, the root complex that adds the least contention, then improve by pairwise swaps
until no swap helps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from topology.model import Topology

EXHAUSTIVE_MAX_GPUS = 8


@dataclass(frozen=True)
class Mapping:
    order: tuple[int, ...]  # slot -> GPU index
    contention: float
    method: str  # "cross" (exhaustive), "cross-heuristic", "sequential"

    def gpu_of_stage(self, stage: int) -> int:
        return self.order[stage % len(self.order)]

    def to_dict(self) -> dict:
        return {"order": list(self.order), "contention": self.contention, "method": self.method}


def slot_pair_weights(n_gpus: int, n_stages: int) -> list[list[float]]:
    """W[a][b] = sum of 1/(j-i) over stage pairs i < j with i on slot a and j on slot b."""
    w = [[0.0] * n_gpus for _ in range(n_gpus)]
    for i in range(n_stages):
        for j in range(i + 1, n_stages):
            a, b = i % n_gpus, j % n_gpus
            if a != b:
                w[a][b] += 1.0 / (j - i)
    return w


def _labels_contention(labels: tuple[int, ...], weights: list[list[float]], rc_size: dict[int, int]) -> float:
    n = len(labels)
    return sum(weights[a][b] * rc_size[labels[a]] for a in range(n) for b in range(n)
               if a != b and labels[a] == labels[b])


def contention(topo: Topology, order: tuple[int, ...] | list[int], n_stages: int) -> float:
    """Eq. 13 for a given slot -> GPU order."""
    rc_size = {rc: len(members) for rc, members in topo.groups().items()}
    labels = tuple(topo.root_complex_of(g) for g in order)
    return _labels_contention(labels, slot_pair_weights(len(order), n_stages), rc_size)


def _order_from_labels(topo: Topology, labels: tuple[int, ...]) -> tuple[int, ...]:
    free = {rc: list(members) for rc, members in topo.groups().items()}
    return tuple(free[label].pop(0) for label in labels)


def _distinct_label_sequences(counts: dict[int, int]):
    """Every distinct arrangement of the multiset of root-complex labels (no duplicates)."""
    total = sum(counts.values())

    def rec(prefix: list[int]):
        if len(prefix) == total:
            yield tuple(prefix)
            return
        for label in sorted(counts):
            if counts[label]:
                counts[label] -= 1
                prefix.append(label)
                yield from rec(prefix)
                prefix.pop()
                counts[label] += 1

    yield from rec([])


def sequential_map(topo: Topology, n_stages: int) -> Mapping:
    order = tuple(range(topo.n))
    return Mapping(order, contention(topo, order, n_stages), "sequential")


def cross_map(topo: Topology, n_stages: int) -> Mapping:
    """The slot -> GPU order minimising Eq. 13 (ties: the lexicographically first)."""
    n = topo.n
    groups = topo.groups()
    rc_size = {rc: len(m) for rc, m in groups.items()}
    weights = slot_pair_weights(n, n_stages)
    counts = {rc: len(m) for rc, m in groups.items() if m}
    if n <= EXHAUSTIVE_MAX_GPUS:
        best = min(_distinct_label_sequences(dict(counts)), key=lambda lab: (_labels_contention(lab, weights, rc_size), lab))
        method = "cross"
    else:
        best = _heuristic_labels(counts, weights, rc_size)
        method = "cross-heuristic"
    return Mapping(_order_from_labels(topo, best), _labels_contention(best, weights, rc_size), method)


def _heuristic_labels(counts: dict[int, int], weights, rc_size) -> tuple[int, ...]:
    left = dict(counts)
    labels: list[int] = []
    for slot in range(sum(counts.values())):
        def added(rc: int) -> float:
            return sum((weights[p][slot] + weights[slot][p]) * rc_size[rc] for p, lab in enumerate(labels) if lab == rc)
        rc = min((r for r in left if left[r]), key=lambda r: (added(r), r))
        labels.append(rc)
        left[rc] -= 1
    cost = _labels_contention(tuple(labels), weights, rc_size)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(len(labels)), 2):
            if labels[a] == labels[b]:
                continue
            labels[a], labels[b] = labels[b], labels[a]
            c = _labels_contention(tuple(labels), weights, rc_size)
            if c < cost - 1e-12:
                cost, improved = c, True
            else:
                labels[a], labels[b] = labels[b], labels[a]
    return tuple(labels)


def transfer_priority(stage: int, n_stages: int, phase: str) -> int:
    """Priority of a stage's prefetch (lower runs first): the stage that executes earlier.

    CUDA stream priorities order kernels, not memory copies, so the runtime's transfer queues use
    this number to order copies themselves.  Forward runs stages 0..S-1, backward S-1..0.
    """
    return stage if phase == "forward" else n_stages - 1 - stage
