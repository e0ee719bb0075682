"""The dispatched schedule's prediction (mobius.sim.dispatched): the step it simulates is the chain
of tasks it describes, in order, on the GPUs it names; and it does what it is for: where one stage
(the head) outweighs the rest, no GPU waits on the one that holds it."""

from __future__ import annotations

import pytest

from mobius.models import get_config
from mobius.partition.baselines import balanced_bounds
from mobius.partition.cost import stage_costs
from mobius.partition.profile import analytic_profile
from mobius.sim.dispatched import plan_dispatched, simulate_dispatched, valid_partitions
from mobius.sim.engine import COMPUTE
from mobius.sim.schedules import simulate_mobius
from topology import load_topology

M = 4


def _profile(model: str = "small"):
    return analytic_profile(model, get_config(model), 1, 128, 10.0, "fp32")


def _ends(result) -> dict[str, tuple[float, float, int]]:
    return {t.name: (t.start, t.end, t.gpu) for t in result.tasks}


def test_the_tasks_run_in_order_on_the_gpus_in_turn_with_every_micro_batch_after_its_input():
    profile, topo = _profile(), load_topology("topo2+2")
    forward, backward = [(0, 5), (5, 10), (10, 14)], [(0, 4), (4, 8), (8, 12), (12, 14)]
    r = simulate_dispatched(profile, forward, backward, topo, [0, 2, 1, 3], M)
    ends = _ends(r)
    # Tasks F0 F1 F2 (with the head's backward B3) B2 B1 B0 on GPUs 0 2 1 3 0 2.
    assert [ends[f"{name}.0"][2] for name in ("F0", "F1", "F2", "B2", "B1", "B0")] == [0, 2, 1, 3, 0, 2]
    assert ends["B3.0"][2] == 1
    for m in range(M):
        for j in (1, 2):
            assert ends[f"F{j}.{m}"][0] >= ends[f"F{j - 1}.{m}"][1]
        assert ends[f"B3.{m}"][0] >= ends[f"F2.{m}"][1]
        for k in (2, 1, 0):
            assert ends[f"B{k}.{m}"][0] >= ends[f"B{k + 1}.{m}"][1]
    # Every layer computed once forward and once backward per micro-batch, recomputing all but the head's.
    fwd, bwd = stage_costs(profile, forward, False), stage_costs(profile, backward, True)
    work = M * (sum(c.fwd_s for c in fwd) + sum(c.bwd_s for c in bwd) - bwd[-1].fwd_s)
    uploads = M * (sum(c.in_bytes for c in fwd) + sum(c.in_bytes + c.out_bytes for c in bwd[:-1]))
    computed = sum(t.end - t.start for t in r.tasks if t.kind == COMPUTE)
    assert computed == pytest.approx(work + uploads / (topo.gpus[0].link_bandwidth_gbps * 1e9), rel=1e-9)
    assert r.step_s >= computed / topo.n


def test_partitions_must_cover_the_same_layers_and_keep_the_heads_backward_in_the_last_forward_stage():
    assert valid_partitions([(0, 7), (7, 14)], [(0, 3), (3, 9), (9, 14)])
    assert not valid_partitions([(0, 7), (7, 14)], [(0, 6), (6, 14)])  # the head's backward reaches back
    assert not valid_partitions([(0, 7), (7, 14)], [(0, 3), (3, 13)])
    with pytest.raises(ValueError):
        simulate_dispatched(_profile(), [(0, 10), (10, 14)], [(0, 5), (5, 14)], load_topology("topo2+2"), [0, 1], M)


def test_where_the_head_outweighs_the_other_stages_dispatch_is_faster_than_binding():
    """GPT-2's head (a 50k vocabulary) is 31% of its work: bound, the GPU that holds it sets the
    pace of every stage it holds; dispatched, the other GPUs take the stages it would have held.
    (On a model without a heavy head binding is as fast: it keeps the last stages' weights on
    their GPUs from forward to backward, which a dispatched task cannot.)"""
    profile, topo, micro_batches = _profile("gpt2"), load_topology("topo2+2"), 16
    order = [0, 2, 1, 3]
    found = plan_dispatched(profile, topo, order, micro_batches)
    costs = [layer.fwd_s + layer.bwd_s for layer in profile.layers]
    bound = min(simulate_mobius(profile, balanced_bounds(costs, s), topo, order, micro_batches, recompute=True).step_s
                for s in (4, 8, 12))
    assert found is not None and found.step_s < 0.95 * bound
    assert all(gpu == order[i % 4] for i, (_, gpu) in enumerate(found.gpu_of_tasks()))


def test_with_optimizer_lag_the_step_ends_with_the_device_work_unless_a_host_thread_needs_longer():
    profile, topo = _profile("gpt2"), load_topology("topo2+2")
    forward, backward = [(0, 7), (7, 14)], [(0, 3), (3, 6), (6, 10), (10, 14)]
    plain = simulate_dispatched(profile, forward, backward, topo, [0, 2, 1, 3], M)
    lagged = simulate_dispatched(profile, forward, backward, topo, [0, 2, 1, 3], M, optimizer_lag=1)
    device_end = max(t.end for t in lagged.tasks if t.kind not in ("cpu", "delay"))
    adam = [sum(t.work for t in lagged.tasks if t.kind == "cpu" and t.gpu == g) for g in range(4)]
    assert lagged.step_s == pytest.approx(max(device_end, *adam), rel=1e-12)
    assert lagged.step_s < plain.step_s  # the last stages' AdamW no longer ends the step
