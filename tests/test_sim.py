import pytest

from mobius.backends import resolve_for_plan
from mobius.partition.profile import LayerProfile, Profile
from mobius.sim import Link, Simulator, simulate_gpipe, simulate_mobius, simulate_zero3_offload
from mobius.sim.engine import D2H, H2D
from topology.model import GPU, RootComplex, Topology


def two_gpu_topology(bw_gbps=1.0, memory_gb=100.0, shared_rc=False) -> Topology:
    rcs = [RootComplex(0, bw_gbps)] if shared_rc else [RootComplex(0, bw_gbps), RootComplex(1, bw_gbps)]
    gpus = [GPU(i, "g", memory_gb, 1.0, 0 if shared_rc else i, bw_gbps) for i in range(2)]
    return Topology("t", 1000, rcs, gpus)


def unit_profile(n_layers=4) -> Profile:
    """Forward 1 s, backward 2 s, 1 GB of weights, no activations: durations by hand."""
    layers = [LayerProfile(f"l{i}", "x", 0, 1.0, 2.0, 10**9, 0, 0, 0) for i in range(n_layers)]
    return Profile("unit", 1, 1, "fp32", "synthetic", layers)


@pytest.mark.parametrize("recompute,kept,resident", [(True, (), ()), (True, (1,), (2,)), (False, (), (1,))],
                         ids=["recompute", "one-kept-one-resident", "kept-all"])
def test_the_bound_simulation_times_the_operations_the_executor_runs(recompute, kept, resident):
    """Each GPU's compute in the simulated step is its worker's operations (mobius.stages.ops,
    what the executor performs), pass for pass and in their order: the forwards, the redone ones
    where a stage recomputes, the backwards, and a resident stage's update on its GPU."""
    from mobius.stages.ops import COMPUTE, RECOMPUTE, UPDATE, WAIT, worker_ops

    stages, m = 6, 3
    out = simulate_mobius(unit_profile(stages), [(i, i + 1) for i in range(stages)], two_gpu_topology(), [1, 0],
                          micro_batches=m, recompute=recompute, kept=kept, resident=resident, adam_params_per_s=1e30)
    for slot, gpu in enumerate([1, 0]):
        ops = worker_ops(stages, list(range(slot, stages, 2)), m, recompute, resident=frozenset(resident),
                         kept=frozenset(kept))
        want = [f"{'B' if op.backward else 'F'} switch S{op.stage}" if op.kind == WAIT else
                f"AdamW S{op.stage} on GPU {gpu}" if op.kind == UPDATE else
                f"{'R' if op.kind == RECOMPUTE else 'B' if op.backward else 'F'}{op.stage}.{op.mb}"
                for op in ops if op.kind in (WAIT, COMPUTE, RECOMPUTE, UPDATE)]
        ran = [t.name for t in sorted(out.result.tasks, key=lambda t: (t.start, t.id))
               if t.gpu == gpu and t.kind == "compute"]
        assert ran == want
        recomputed = {int(n[1:].split(".")[0]) for n in ran if n.startswith("R")}
        assert recomputed == ({j for j in range(slot, stages - 1, 2) if j not in kept} if recompute else set())


def test_hand_computed_mobius_schedule_2_gpus_4_stages_2_micro_batches():
    prof = unit_profile()
    out = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], micro_batches=2,
                          recompute=False, adam_params_per_s=1e30)
    t = {task.name: (task.start, task.end) for task in out.result.tasks}
    # Forward: S0/S1 load at 0-1; S2/S3 are prefetched 1-2 while S0/S1 compute.
    assert t["F load S0"] == (0, 1) and t["F load S1"] == (0, 1)
    assert t["F0.0"] == (1, 2) and t["F0.1"] == (2, 3)
    assert t["F1.0"] == (2, 3) and t["F1.1"] == (3, 4)
    assert t["F load S2 (prefetch)"] == (1, 2)
    assert t["F2.0"] == (3, 4) and t["F2.1"] == (4, 5)
    # The head (S3) runs each micro-batch's backward right after its forward.
    assert t["F3.0"] == (4, 5) and t["B3.0"] == (5, 7) and t["F3.1"] == (7, 8) and t["B3.1"] == (8, 10)
    # Backward: S2 is still resident; S1 and S0 were prefetched during S3/S2's passes.
    assert t["B2.0"] == (7, 9) and t["B2.1"] == (10, 12)
    assert t["B load S1 (prefetch)"] == (8, 9) and t["B load S0 (prefetch)"] == (5, 6)
    assert t["B1.0"] == (10, 12) and t["B1.1"] == (12, 14)
    assert t["B0.0"] == (12, 14) and t["B0.1"] == (14, 16)
    assert t["grads S0 to host"] == (16, 17)
    assert out.step_s == pytest.approx(17.0)
    # Traffic: 4 stages in forward, 2 reloaded in backward, 4 gradient offloads, 1 GB each.
    assert out.result.total_bytes(H2D) == pytest.approx(6e9)
    assert out.result.total_bytes() == pytest.approx(10e9)


def test_resident_stages_are_never_loaded_or_offloaded_and_update_on_their_gpu_between_its_passes():
    """The schedule above with the last two stages resident: no loads or gradient offloads of
    theirs; each is updated on its GPU right after its last backward (1 s at 2.5e8 parameters/s),
    before that GPU's next pass, which starts a second later."""
    prof = unit_profile()
    out = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], micro_batches=2,
                          recompute=False, adam_params_per_s=1e30, resident=(2, 3), device_adam_params_per_s=2.5e8)
    t = {task.name: (task.start, task.end) for task in out.result.tasks}
    assert t["B3.1"] == (8, 10) and t["AdamW S3 on GPU 1"] == (10, 11) and t["B1.0"] == (11, 13)
    assert t["B2.1"] == (10, 12) and t["AdamW S2 on GPU 0"] == (12, 13) and t["B0.0"] == (13, 15)
    assert t["grads S0 to host"] == (17, 18) and out.step_s == pytest.approx(18.0)
    # Traffic: stages 0 and 1 loaded twice and offloaded once, 1 GB each; nothing of 2 and 3.
    assert out.result.total_bytes(H2D) == pytest.approx(4e9) and out.result.total_bytes(D2H) == pytest.approx(2e9)


def test_optimizer_lag_takes_adamw_off_the_step():
    """3 s of AdamW per stage: without the lag the last stage's update (S0, gradients home at 17 s)
    ends the step at 20 s; with it the step ends with the last compute at 16 s (the next step's
    first loads start while S0's gradients leave), since each worker's optimizer thread needs
    2 x 3 s, less than a step."""
    prof = unit_profile()
    params_per_s = 10**9 / 4 / 3.0  # 1 GB of fp32 weights per stage in 3 s
    kw = dict(micro_batches=2, recompute=False, adam_params_per_s=params_per_s)
    plain = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], **kw)
    lagged = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], optimizer_lag=1, **kw)
    assert plain.step_s == pytest.approx(20.0) and lagged.step_s == pytest.approx(16.0)
    slow = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], optimizer_lag=1,
                           micro_batches=2, recompute=False, adam_params_per_s=params_per_s / 4)
    assert slow.step_s == pytest.approx(24.0)  # 2 stages x 12 s of AdamW per worker: the optimizer bounds the step


def test_stage_inputs_share_the_root_complex_and_a_recomputation_overlaps_the_gradients_arrival():
    """Two GPUs under one root complex of 1 GB/s, 1 GB activations.  S1's input (issued on GPU 1's
    compute stream at 4 s) shares the root complex with S2's 4 GB prefetch on GPU 0, so it takes 2 s,
    not the 1 s of its link alone.  S1's recomputation runs as soon as its backward may start
    (8-9 s), long before its output gradient is home (16 s): only the gradient's upload and the
    backward wait for it."""
    layers = [LayerProfile(f"l{i}", "x", 0, 1.0, 2.0, p, 10**9, 0, 0) for i, p in enumerate([10**9, 10**9, 4 * 10**9])]
    prof = Profile("act", 1, 1, "fp32", "synthetic", layers)
    out = simulate_mobius(prof, [(0, 1), (1, 2), (2, 3)], two_gpu_topology(shared_rc=True), [0, 1], micro_batches=1,
                          recompute=True, adam_params_per_s=1e30)
    t = {task.name: (task.start, task.end) for task in out.result.tasks}
    assert t["F load S2 (prefetch)"] == (2, 7) and t["F1.0 inputs in"] == (4, 6) and t["F1.0"] == (6, 7)
    assert t["R1.0 inputs in"] == (7, 8) and t["R1.0"] == (8, 9)
    assert t["grad S2.0 to S1"] == (16, 16) and t["B1.0 inputs in"] == (16, 17) and t["B1.0"] == (17, 19)
    assert out.step_s == pytest.approx(25.0)
    lagged = simulate_mobius(prof, [(0, 1), (1, 2), (2, 3)], two_gpu_topology(shared_rc=True), [0, 1],
                             micro_batches=1, recompute=True, adam_params_per_s=1e30, optimizer_lag=1)
    assert lagged.step_s == pytest.approx(24.0)  # B0.0's end: S0's gradients leave during the next step


def test_two_transfers_on_one_root_complex_share_it_equally():
    sim = Simulator(Link(gpu_bw={0: 10.0, 1: 10.0}, rc_of={0: 0, 1: 0}, rc_bw={0: 10.0}))
    a = sim.add("a", H2D, 0, 10.0)
    b = sim.add("b", H2D, 1, 10.0)
    r = sim.run()
    assert r.tasks[a].end == pytest.approx(2.0) and r.tasks[b].end == pytest.approx(2.0)
    assert [bw for _, bw in r.achieved_bandwidths()] == pytest.approx([5e-9, 5e-9])


def test_priorities_order_one_gpus_queue_but_not_a_root_complex():
    """PCIe shares a root complex fairly between GPUs whatever their queues' priorities (as the
    emulated links do); a GPU's own copy engine takes its most urgent transfer first."""
    sim = Simulator(Link(gpu_bw={0: 10.0, 1: 10.0}, rc_of={0: 0, 1: 0}, rc_bw={0: 10.0}))
    late = sim.add("later stage", H2D, 0, 10.0, priority=5)
    early = sim.add("earlier stage", H2D, 1, 10.0, priority=1)
    mine_late = sim.add("GPU 1, later", H2D, 1, 5.0, priority=9)
    r = sim.run()
    assert r.tasks[early].end == pytest.approx(2.0) and r.tasks[late].end == pytest.approx(2.0)
    assert r.tasks[mine_late].start == pytest.approx(2.0) and r.tasks[mine_late].end == pytest.approx(2.5)


def test_gpu_link_caps_a_transfer_below_its_root_complex_share():
    sim = Simulator(Link(gpu_bw={0: 4.0, 1: 10.0}, rc_of={0: 0, 1: 0}, rc_bw={0: 10.0}))
    a = sim.add("capped", H2D, 0, 8.0)
    b = sim.add("other", H2D, 1, 12.0)
    r = sim.run()
    assert r.tasks[a].end == pytest.approx(2.0)  # 4/s: its own link
    assert r.tasks[b].end == pytest.approx(2.0)  # 6/s: the rest of the root complex


def test_copy_streams_of_one_gpu_run_together_and_share_its_link():
    """The runtime's gradient offload and activation copies are on streams of their own: an
    activation issued after a big offload starts at once (half the link each) instead of queueing
    behind it; a second transfer on the same stream still waits its turn."""
    sim = Simulator(Link(gpu_bw={0: 10.0}, rc_of={0: 0}, rc_bw={0: 10.0}))
    grads = sim.add("gradients", D2H, 0, 30.0, stream="gradients")
    act = sim.add("activation", D2H, 0, 5.0, stream="activations")
    act2 = sim.add("activation 2", D2H, 0, 5.0, stream="activations")
    r = sim.run()
    assert r.tasks[act].start == 0.0 and r.tasks[act].end == pytest.approx(1.0)  # 5 at 5/s
    assert r.tasks[act2].start == pytest.approx(1.0) and r.tasks[act2].end == pytest.approx(2.0)
    assert r.tasks[grads].end == pytest.approx(4.0)  # 10 at 5/s by t=2, then 20 at 10/s: the link never idles


def test_an_urgent_upload_holds_its_gpus_weights_but_not_another_gpus():
    """Activations first (the dispatched schedule's uploads): GPU 0's input takes its whole link,
    its weights wait until it is done; GPU 1's weights, under the same root complex, keep their
    share of it."""
    sim = Simulator(Link(gpu_bw={0: 10.0, 1: 10.0}, rc_of={0: 0, 1: 0}, rc_bw={0: 20.0}))
    weights = sim.add("weights", H2D, 0, 30.0, stream="params")
    other = sim.add("other GPU's weights", H2D, 1, 20.0, stream="params")
    upload = sim.add("input", H2D, 0, 10.0, stream="activations", urgent=True)
    r = sim.run()
    assert r.tasks[upload].end == pytest.approx(1.0)  # 10 at the link's 10/s
    assert r.tasks[other].end == pytest.approx(2.0)  # 10/s throughout
    assert r.tasks[weights].end == pytest.approx(4.0)  # nothing until t=1, then 30 at 10/s


def test_baselines_gpipe_oom_and_zero3_traffic():
    prof = unit_profile(8)
    topo = two_gpu_topology(memory_gb=10.0)
    gp = simulate_gpipe(prof, topo, micro_batches=2)
    assert gp.oom and "needs 16.0 GB" in gp.reason  # 1e9 parameters per stage x 16 B (mixed-precision Adam)
    ds = simulate_zero3_offload(prof, topo, micro_batches=2)
    # Every GPU fetches every layer twice and offloads every gradient: 3x the weights, per GPU.
    assert ds.traffic_bytes == pytest.approx(2 * 3 * 8e9)
    assert ds.step_s > 0


def test_zero_infinity_by_hand_with_the_drives_shared_by_every_rank():
    """One layer (forward 1 s, backward 2 s, 1 GB of fp32 weights), two GPUs on links of their own
    (1 GB/s), drives of 0.5 GB/s read and 0.25 GB/s write shared by both ranks.  Weights on NVMe:
    each pass reads a rank's half (0.5 GB at 0.25 GB/s: 2 s), gathers the layer (1 s), computes
    (forward 1 s; backward with recomputation 3 s), the gradients go home (1 s): 11 s.  The optimizer
    moves 12 bytes a parameter in and 16 out in 8 pieces: each piece's write (0.25 GB at 0.125 GB/s)
    takes 2 s behind its read (0.75 s): 16.75 s.  With the host holding the weights, no reads, and
    12 bytes out: 7 + 12.75 s."""
    from mobius.sim.schedules import simulate_zero_infinity

    prof, topo = unit_profile(1), two_gpu_topology()
    on_nvme = simulate_zero_infinity(prof, topo, 2, (0.5, 0.25), host_memory_bytes=0, adam_params_per_s=1e30)
    assert on_nvme.step_s == pytest.approx(11 + 16.75)
    in_host = simulate_zero_infinity(prof, topo, 2, (0.5, 0.25), host_memory_bytes=1e12, adam_params_per_s=1e30)
    assert in_host.step_s == pytest.approx(7 + 12.75)
    # Four micro-batches: two a rank, each its own forward and backward.
    assert simulate_zero_infinity(prof, topo, 4, (0.5, 0.25), 0, adam_params_per_s=1e30).step_s == \
        pytest.approx(2 * 11 + 16.75)


def test_clipping_updates_after_the_last_gradient():
    """3 s of AdamW per stage, clipped: every update waits for the global norm (S0's gradients home
    at 17 s), then each GPU's optimizer takes its stages in backward order: S2 and S3 17-20, S0 and
    S1 20-23, where the step ends (unclipped, 20: S3's update ran during S1's backward)."""
    prof = unit_profile()
    kw = dict(micro_batches=2, recompute=False, adam_params_per_s=10**9 / 4 / 3.0)
    out = simulate_mobius(prof, [(i, i + 1) for i in range(4)], two_gpu_topology(), [0, 1], clip=True, **kw)
    t = {task.name: (task.start, task.end) for task in out.result.tasks}
    assert [t[f"AdamW S{j}"] for j in range(4)] == [(20, 23), (20, 23), (17, 20), (17, 20)]
    assert out.step_s == pytest.approx(23.0)


# The most the partition MIP's cost model may be off the simulation of the plan it chose, in
# either direction (measured 2026-11-29: at most 7.5%, p3.8xlarge with the lag; 0-3% on most).
COST_MODEL_GAP = 0.08
# With the lag the cost model times a step alone (until its last gradient is home) where the
# simulation times the steady state of overlapping steps: up to 12.5% higher on GPT-2's short steps
# (topo2+2) once the host update stopped setting their pace.
COST_MODEL_GAP_LAGGED = 0.15


@pytest.mark.slow
@pytest.mark.parametrize("box", ["topo2+2", "topo1+3", "topo4", "8x3090-4+4", "4x4090", "8x4090-4+4", "p3.8xlarge",
                                 "dgx-a100"])
def test_the_cost_model_is_the_simulation_within_its_stated_gap_on_every_preset_box(box):
    """The partition MIP's cost model (an approximation made to be solved: what the search compares
    plans by) against the simulator's timing of the same plan (the runtime's operations on the box's
    links: the step the plan states), without the lag with stages resident on their GPUs (the
    default) and with every stage swapping, and with the lag."""
    import contextlib
    import io

    from mobius.config import RunConfig
    from mobius.planning.pipeline import run_plan
    from mobius.planning.prepare import get_profile, reserve_cuda_memory, resolve_topology
    from mobius.runtime.inputs import model_config_for

    residents = []
    for lag, device_optimizer in ((0, "auto"), (0, "off"), (1, "auto")):
        cfg = RunConfig.of(model="gpt2", topology=box, micro_batch_size=1, micro_batches=8, seq_len=1024,
                           precision="bf16", optimizer_lag=lag, device_optimizer=device_optimizer)
        model_config, topo = model_config_for(cfg), resolve_topology(cfg)
        with contextlib.redirect_stdout(io.StringIO()):  # the planner's progress lines
            plan = run_plan(resolve_for_plan(cfg, topo), model_config, profile_how="analytic", effort=4)
        residents.append(len(plan.resident))
        reserved = reserve_cuda_memory(topo)
        profile = get_profile(cfg.model, model_config, reserved, 1, 1024, "bf16", "analytic")
        simulated = simulate_mobius(profile, plan.bounds, reserved, plan.order, 8, plan.recompute, optimizer_lag=lag,
                                    kept=tuple(plan.kept), prefetch=plan.prefetch,
                                    adam_params_per_s=plan.host_costs.get("adam_params_per_s"),
                                    resident=tuple(plan.resident),
                                    device_adam_params_per_s=plan.device_adam_params_per_s).step_s
        assert plan.simulated and plan.predicted_step_s == simulated  # the step a plan states
        gap = COST_MODEL_GAP_LAGGED if lag else COST_MODEL_GAP
        assert plan.modelled_step_s == pytest.approx(simulated, rel=gap), (lag, device_optimizer)
    # each kind of plan was timed (4x4090's host keeps every stage swapping: its updates overlap)
    assert (residents[0] > 0 or box == "4x4090") and residents[1:] == [0, 0]


@pytest.mark.slow
def test_a_plan_whose_updates_start_before_the_norm_states_the_steps_that_clip_and_those_after_them(monkeypatch):
    """Clipping without the lag: the plan is the plan of the steps that keep their updates (the same
    as without clipping at its host update's rate: it reads the gradients in fp32 first), and
    states the step after one that clipped (its updates wait for the norm: the simulation with
    clipping's wait) and the step that clips (that, and the busiest worker's
    updates taken back first, at the rollback's measured cost in AdamW passes).  With the lag the updates run during the next step
    anyway: nothing to state."""
    import contextlib
    import io

    from mobius.config import RunConfig
    from mobius.planning.pipeline import run_plan
    from mobius.runtime.optim import ROLLBACK_PASSES
    from mobius.runtime.inputs import model_config_for

    def plan(**changes):
        cfg = RunConfig.of(model="gpt2", topology="topo2+2", micro_batch_size=1, micro_batches=8, seq_len=1024,
                           precision="bf16", device_optimizer="off", **changes)
        with contextlib.redirect_stdout(io.StringIO()):  # the planner's progress lines
            return run_plan(resolve_for_plan(cfg), model_config_for(cfg), profile_how="analytic", effort=4)

    import mobius.planning.pipeline as planning
    clipping_path = planning.update_path(RunConfig.of(max_grad_norm=1.0), "bf16", 1)
    with monkeypatch.context() as m:
        m.setattr(planning, "update_path", lambda *_: clipping_path)
        unclipped = plan(max_grad_norm=0.0)
    clipped = plan(max_grad_norm=1.0)
    assert unclipped.waiting_step_s is None and unclipped.steps().clipping_text() == ""
    assert clipped.same_choices(unclipped) and clipped.predicted_step_s == unclipped.predicted_step_s
    assert clipped.waiting_step_s > clipped.predicted_step_s
    assert clipped.clipped_step_s == pytest.approx(clipped.waiting_step_s + ROLLBACK_PASSES * clipped.host_adam_s())
    assert clipped.host_adam_s() > 0
    assert plan(max_grad_norm=1.0, optimizer_lag=1).waiting_step_s is None
