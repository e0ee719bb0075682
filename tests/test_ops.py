"""The schedule as data: one worker's operations for a step (Mobius §3.1), checked in-process."""

from dataclasses import replace

import pytest

from mobius.stages.ops import COMPUTE, END, LOAD, OFFLOAD, RECOMPUTE, RECV, RELEASE, SEND, WAIT, worker_ops


def positions(ops, kind, stage, backward):
    return [i for i, op in enumerate(ops) if op.kind == kind and op.stage == stage and op.backward == backward]


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("n_stages,workers", [(4, 2), (8, 4), (3, 1), (6, 2)])
def test_mobius_schedule_rules(n_stages, workers, recompute):
    M = 3
    head = n_stages - 1
    for w in range(workers):
        mine = [s for s in range(n_stages) if s % workers == w]  # the mapping's slot order
        ops = worker_ops(n_stages, mine, M, recompute)
        # Every micro-batch of a stage runs while the stage is resident: between its wait and its end.
        for backward in (False, True):
            for s in mine:
                if s == head:
                    continue
                wait, = positions(ops, WAIT, s, backward)
                end, = positions(ops, END, s, backward)
                computes = positions(ops, COMPUTE, s, backward)
                assert [ops[i].mb for i in computes] == list(range(M))
                assert all(wait < i < end for i in computes)
                # no other stage computes in between
                assert all(ops[i].stage == s for i in range(wait, end) if ops[i].kind == COMPUTE)
        if head in mine:
            # The head is one pass: each micro-batch's forward, its backward, its input gradient
            # sent, before the next micro-batch; never recomputed.
            assert positions(ops, WAIT, head, False) == [] and positions(ops, END, head, False) == []
            wait, = positions(ops, WAIT, head, True)
            end, = positions(ops, END, head, True)
            inner = [(op.kind, op.mb, op.backward) for op in ops[wait + 1:end] if op.kind != LOAD]
            per_mb = [[(RECV, m, False)] * (head > 0) + [(COMPUTE, m, False), (COMPUTE, m, True)]
                      + [(SEND, m, True)] * (head > 0) for m in range(M)]
            assert inner == [x for mb in per_mb for x in mb]
            assert ops[wait + 1].kind == LOAD or len(mine) == 1
        # The next stage is requested right after the current one is resident (prefetch overlaps).
        order = [s for s in mine if s != head] + mine[::-1]
        loads = [op for op in ops if op.kind == LOAD]
        assert [op.stage for op in loads] == [mine[0]] + mine[1:] + mine[::-1][1:]
        forward_passes = len(order) - len(mine)
        for k, s in enumerate(order[:-1]):
            if k == forward_passes - 1 and head not in mine:
                continue  # the last stage of forward stays resident for backward: no load
            backward = k >= forward_passes
            wait, = positions(ops, WAIT, s, backward)
            assert ops[wait + 1].kind == LOAD and ops[wait + 1].stage == order[k + 1]
        # The worker's last forward stage is not released before backward; every other stage is.
        assert positions(ops, RELEASE, mine[-1], False) == []
        assert all(len(positions(ops, RELEASE, s, False)) == 1 for s in mine[:-1])
        # Backward runs in reverse order; gradients leave after a stage's last micro-batch, before its release.
        waits_b = [op.stage for op in ops if op.kind == WAIT and op.backward]
        assert waits_b == mine[::-1]
        for s in mine:
            end, = positions(ops, END, s, True)
            offload, = positions(ops, OFFLOAD, s, True)
            release, = positions(ops, RELEASE, s, True)
            assert end < offload < release
        # Communication: inputs come from the previous stage and outputs go to the next one.
        for op in ops:
            if op.kind == RECV:
                assert (op.stage > 0) if not op.backward else (op.stage < n_stages - 1)
            if op.kind == SEND:
                assert (op.stage < n_stages - 1) if not op.backward else (op.stage > 0)
        # With recomputation each backward micro-batch is recomputed before its gradient is awaited.
        for s in mine:
            for m in range(M):
                i = next(i for i, op in enumerate(ops) if op.kind == COMPUTE and op.backward and op.stage == s
                         and op.mb == m)
                re = [j for j, op in enumerate(ops) if op.kind == RECOMPUTE and op.stage == s and op.mb == m]
                assert (len(re) == 1 and re[0] < i) if recompute and s != head else re == []


def test_load_priorities_follow_execution_order():
    ops = worker_ops(8, [1, 3, 5, 7], 2, True)
    forward = [op.priority for op in ops if op.kind == LOAD and not op.backward]
    backward = [op.priority for op in ops if op.kind == LOAD and op.backward]
    assert forward == sorted(forward) and backward == sorted(backward)


def test_stages_that_keep_their_activations_are_not_recomputed():
    """Recomputation per stage: a kept stage's forward keeps its graph (no host input saved for a
    recomputation) and its backward starts from it; the other stages recompute as before."""
    n_stages, M, kept = 8, 3, frozenset({2, 3})
    for w in range(2):
        mine = [s for s in range(n_stages) if s % 2 == w]
        ops = worker_ops(n_stages, mine, M, recompute=True, kept=kept)
        plain = worker_ops(n_stages, mine, M, recompute=True)
        for s in mine:
            forwards = [op for op in ops if op.kind == COMPUTE and op.stage == s and not op.backward]
            recomputes = [op.mb for op in ops if op.kind == RECOMPUTE and op.stage == s]
            if s in kept:
                assert not any(op.recompute for op in forwards) and recomputes == []
            elif s < n_stages - 1:
                assert all(op.recompute for op in forwards) and recomputes == list(range(M))
        # Nothing else changes: the same operations, but for the kept stages' recomputations.
        assert [op for op in plain if not (op.kind == RECOMPUTE and op.stage in kept)] == \
            [replace(op, recompute=True) if op.stage in kept and op.kind == COMPUTE and not op.backward else op
             for op in ops]
