"""--emulate: emulated PCIe links shared across workers, dilated compute, and the switches that show
the paper's effects (--mapping, --no-prefetch), in process (the multi-process run is in
scripts/bench_emulated.py)."""

from __future__ import annotations

import threading
import time

import pytest

from mobius.backends import resolve
from mobius.mapping import cross_map, sequential_map
from mobius.models import get_config
from mobius.partition.cost import Machine, StepEstimate, copy_rates, evaluate, settle, stage_costs
from mobius.planning.planner import kept_stages
from mobius.partition.profile import LayerProfile, Profile, analytic_profile
from mobius.runtime.device import CpuDevice
from mobius.runtime.emulation import EmulatedLinks, EmulationSpec, create_counters
from mobius.stages.ops import LOAD, RELEASE, WAIT, worker_ops
from topology.presets import load_preset

FACTOR = 40.0  # wall seconds per emulated second: 1 MB at 1 GB/s = 1 ms emulated = 40 ms wall
MB = 10**6


def links(tmp_path, root_complex=(0, 0, 1), link_bps=1e9, rc_bps=1e9, boxes=1,
          network_bps=0.0, disk_bps=(float("inf"), float("inf"))) -> list[EmulatedLinks]:
    """The emulated links of ``boxes`` boxes of GPUs hanging off ``root_complex``, worker by worker."""
    path = str(tmp_path / "counters")
    create_counters(path, len(root_complex) * boxes)
    spec = EmulationSpec("test", FACTOR, (link_bps,) * len(root_complex), tuple(root_complex),
                         {str(r): rc_bps for r in set(root_complex)}, path, replicas=boxes, network="net",
                         network_bps=network_bps, disk_bps=disk_bps)
    return [EmulatedLinks(spec, rank) for rank in range(len(root_complex) * boxes)]


def emulated_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / FACTOR


def held_open(link: EmulatedLinks, direction: str):
    """A transfer of ``link`` in flight until the returned function is called (its real copy waits)."""
    entered, release = threading.Event(), threading.Event()

    def copy() -> None:
        entered.set()
        release.wait(60)

    t = threading.Thread(target=link.transfer, args=(1, direction, copy))
    t.start()
    assert entered.wait(60)

    def done() -> None:
        release.set()
        t.join()
    return done


def rate_beside(link: EmulatedLinks, direction: str, *others: tuple[EmulatedLinks, str]) -> float:
    """The rate ``link``'s transfer in ``direction`` gets while each of ``others`` has one in flight."""
    releases = [held_open(w, d) for w, d in others]
    seen = []
    try:
        link.transfer(1, direction, lambda: seen.append(link.rate(direction)))
    finally:
        for release in releases:
            release()
    return seen[0]


def test_a_transfer_alone_takes_bytes_over_bandwidth(tmp_path):
    """1 MB at 1 GB/s: 1 ms emulated, never less (it sleeps), and not 10x more even on a busy machine."""
    w = links(tmp_path)
    assert 0.99e-3 <= emulated_s(lambda: w[0].transfer(MB, "h2d", lambda: None)) < 1e-2


def test_workers_under_one_root_complex_share_it_across_emulators(tmp_path):
    """Workers 0 and 1 hang off root complex 0: two transfers at once each get half of it; worker 2
    (root complex 1) and transfers in the other direction are not slowed."""
    w = links(tmp_path)
    assert rate_beside(w[0], "h2d") == 1e9
    assert rate_beside(w[0], "h2d", (w[1], "h2d")) == 0.5e9
    assert rate_beside(w[1], "h2d", (w[0], "h2d")) == 0.5e9
    assert rate_beside(w[0], "h2d", (w[2], "h2d"), (w[1], "d2h")) == 1e9


def test_each_box_has_its_own_root_complexes_and_shares_its_network(tmp_path):
    """Two boxes of two GPUs on one root complex: box 1's copies do not slow box 0's; a box's
    exchanges with the other boxes share its network (0.5 GB/s alone, half each for two at once),
    and the other box's exchanges do not take from it."""
    w = links(tmp_path, root_complex=(0, 0), boxes=2, network_bps=0.5e9)
    assert rate_beside(w[0], "h2d", (w[2], "h2d")) == 1e9
    assert rate_beside(w[0], "net") == 0.5e9
    assert rate_beside(w[0], "net", (w[1], "net")) == 0.25e9
    assert rate_beside(w[0], "net", (w[2], "net"), (w[3], "net")) == 0.5e9
    # What the replicas' collectives charge goes through the device layer (nothing on real devices).
    charged = []
    w[3].exchange = charged.append
    CpuDevice(check=False, emulation=w[3]).network_time(MB)
    CpuDevice(check=False).network_time(MB)
    assert charged == [MB]


def test_a_boxs_drives_are_shared_by_all_its_workers_reads_apart_from_writes(tmp_path):
    """The disk tier's reads share the box's drives' read rate among every worker reading at once
    (whatever their root complexes), writes the write rate; the device layer routes the disk tier's
    transfers there under --emulate (and does them at once otherwise)."""
    w = links(tmp_path, disk_bps=(2e9, 1e9))
    assert rate_beside(w[0], "disk-read") == 2e9
    assert rate_beside(w[0], "disk-read", (w[2], "disk-read")) == 1e9
    assert rate_beside(w[0], "disk-read", (w[1], "disk-write"), (w[2], "h2d")) == 2e9
    assert rate_beside(w[1], "disk-write", (w[0], "disk-write"), (w[2], "disk-write")) == pytest.approx(1e9 / 3)
    done = []
    CpuDevice(check=False, emulation=w[0]).disk_transfer(MB, True, lambda: done.append("emulated"))
    CpuDevice(check=False).disk_transfer(MB, False, lambda: done.append("at once"))
    assert done == ["emulated", "at once"]


def test_the_gpu_link_caps_a_transfer_below_its_share(tmp_path):
    w = links(tmp_path, root_complex=(0,), link_bps=0.5e9, rc_bps=1e9)
    assert rate_beside(w[0], "h2d") == 0.5e9


def test_compute_lasts_the_gpu_time_and_compute_stream_copies_come_on_top(tmp_path):
    """A micro-batch whose emulated GPU time is 2 ms takes 2 ms however fast the CPU is; its input's
    copy on the compute stream (1 MB, 1 ms) adds to it, as on a GPU: 3 ms, never less."""
    w = links(tmp_path, root_complex=(0,))
    device = CpuDevice(check=False, emulation=w[0])

    def step() -> None:
        with device.compute_span(2e-3):
            w[0].transfer(MB, "h2d", lambda: None)

    assert 0.99 * 3e-3 <= emulated_s(step) < 3e-2
    with device.compute_span(0.0):
        pass  # nothing to pad


def test_real_copies_still_move_the_data(tmp_path):
    import torch

    w = links(tmp_path, root_complex=(0,))
    device = CpuDevice(check=True, emulation=w[0])
    stream = device.new_stream("h2d", "h2d")
    src = torch.arange(1000, dtype=torch.float32)
    dst = device.empty(1000, torch.float32, stream)
    stream.copy(dst, src)
    stream.synchronize()
    assert torch.equal(dst, src)
    device.close()


def test_copies_within_the_device_cross_no_link(tmp_path):
    """A copy between two device tensors (the chunked engine's gather of a device-resident chunk
    into its rCache block, on one GPU) moves the data and takes none of the link's time; the same
    1 MB from the host takes the link's 1 ms."""
    import torch

    from mobius.runtime.device import WITHIN_DEVICE

    w = links(tmp_path, root_complex=(0,))
    crossed = []
    through = w[0].transfer
    w[0].transfer = lambda nbytes, direction, copy: (crossed.append((nbytes, direction)), through(nbytes, direction, copy))
    device = CpuDevice(check=True, emulation=w[0])
    src = torch.arange(MB // 4, dtype=torch.float32)
    dst = device.empty(MB // 4, torch.float32)
    device.compute.copy(dst, src)
    assert crossed == [(MB, "h2d")]
    dst.zero_()
    device.compute.copy(dst, src, direction=WITHIN_DEVICE)
    assert crossed == [(MB, "h2d")]
    assert torch.equal(dst, src)
    device.close()


def test_without_prefetch_a_stage_loads_after_the_previous_is_released():
    ops = worker_ops(8, [0, 2, 4, 6], 2, recompute=True, prefetch=False)
    seq = [(op.kind, op.stage, op.backward) for op in ops if op.kind in (LOAD, WAIT, RELEASE)]
    for k, (kind, s, backward) in enumerate(seq):
        if kind == LOAD and k > 0:  # every load but the first follows the release of the stage before
            assert seq[k - 1][0] == RELEASE and seq[k + 1] == (WAIT, s, backward)
    assert worker_ops(8, [0, 2, 4, 6], 2, recompute=True) != ops


def two_blocks() -> Profile:
    block = dict(kind="block", similarity_class=0, fwd_s=1.0, bwd_s=2.0, param_bytes=4, out_bytes=1,
                 fwd_work_bytes=0, bwd_work_bytes=0)
    return Profile("t", 1, 1, "fp32", "synthetic", [LayerProfile(name="l0", **block), LayerProfile(name="l1", **{
        **block, "out_bytes": 0})])


def test_gradient_offloads_queue_for_their_root_complex():
    """Two GPUs under one 1 B/s root complex (links 1 B/s), S0 on the first, S1 on the second, one
    micro-batch, S0's backward free.  Both first loads share the root complex: 8.  S0 computes
    8->9, its output is home at 10, S1 copies it and computes 10->12; backward: S1 12->14, its
    output gradient home at 15, S0 copies it 15->16.  Gradients: S1's 14->18; S0's queue behind
    them, 18->22 (on its own link from 16 they would be home at 20)."""
    block = dict(kind="block", similarity_class=0, fwd_s=1.0, bwd_s=2.0, param_bytes=4, out_bytes=1,
                 fwd_work_bytes=0, bwd_work_bytes=0)
    prof = Profile("t", 1, 1, "fp32", "synthetic", [LayerProfile(name="l0", **{**block, "bwd_s": 0.0}),
                                                     LayerProfile(name="l1", **{**block, "out_bytes": 0})])
    machine = Machine((1.0, 1.0), (100, 100), link=(1.0, 1.0), first_wave_peers=((0, 1), (0, 1)),
                      rc_bandwidth=(1.0, 1.0))
    assert machine.previous_on_root_complex(0, 2) == 1 and machine.previous_on_root_complex(1, 2) is None
    assert evaluate(prof, [(0, 1), (1, 2)], machine, 1, recompute=False).step_s == pytest.approx(22.0)
    # Each GPU under a root complex of its own: loads 4, S0 4->5, S1 6->8, 8->10, S0 11->12; 16.
    apart = Machine((1.0, 1.0), (100, 100), link=(1.0, 1.0), first_wave_peers=((0,), (1,)), rc_bandwidth=(1.0, 1.0))
    assert evaluate(prof, [(0, 1), (1, 2)], apart, 1, recompute=False).step_s == pytest.approx(16.0)


def test_cost_model_terms_by_hand():
    """One GPU, two one-layer stages (4 B each, 1 B boundary activation), one micro-batch, 1 B/s,
    recompute off, no prefetch, ``o`` per micro-batch and pass, ``w`` per switch between passes.
    Forward: S0 loads 4, computes 1 (+o); S1 (the head) loads 4 after it, then its input's copy on
    the compute stream 1, compute 1 (+o), and at once its backward 2 (+o): 13+3o.  Backward: S0
    loads 4, output gradient's copy 1, compute 2 (+o): 20+4o; its gradients come home (4) and
    AdamW updates its one parameter: 24+4o+adam."""
    prof, bounds = two_blocks(), [(0, 1), (1, 2)]

    def step(**kw) -> float:
        return evaluate(prof, bounds, Machine((1.0,), (100,), prefetch=False, **kw), 1, recompute=False).step_s

    assert step() == pytest.approx(24.0)
    assert step(micro_batch_s=0.5) == pytest.approx(26.0)
    # A switch of w between a slot's passes overlaps the rest of the next stage's load (4 s): it
    # shows once per pass that follows another on the device (S1's pass, S0's backward) only where
    # the load is shorter; the head's backward follows its forward without one.  w = 0.5: nothing
    # waits: 24.  w = 5: S0 starts at 5, S1 at 11 (not 10), S0's backward at 20 (not 19): 27.
    assert step(stage_switch_s=0.5) == pytest.approx(24.0)
    assert step(stage_switch_s=5.0) == pytest.approx(27.0)
    assert step(adam_params_per_s=2.0) == pytest.approx(24.5)
    assert step(adam_params_per_s=2.0, optimizer_lag=1) == pytest.approx(24.0)  # off the critical path
    # The optimizer thread updates S1 once its gradients are home (13 + 4), then S0 (home at 24):
    # 17 + 50 + 50, one parameter each at 0.02/s.
    assert step(adam_params_per_s=0.02) == pytest.approx(117.0)
    # Clipping: both updates wait for the norm (S0's gradients home at 24): S1 24->74, S0 74->124.
    assert step(adam_params_per_s=0.02, clip=True) == pytest.approx(124.0)
    # With prefetching S1 loads 1 B while S0 computes (1 s at 1 B/s), S0 2 B during S1's 2 s backward.
    assert evaluate(prof, bounds, Machine((1.0,), (100,)), 1, recompute=False).step_s == pytest.approx(21.0)


def test_copy_rates_count_the_copies_in_flight_beside_each_copy():
    """Two GPUs under one root complex.  Slot 0 uploads 0->2 while its own prefetch runs 1->3 (half
    its span) and slot 1 loads 0->2 (all of it): on its 1 B/s link it shares with 0.5 copies, under
    the 2 B/s root complex with 1.5 more, so it gets 1/1.5 B/s.  The activations of both slots
    leave together 0->1: a 2 B/s root complex carries both at their links' 1 B/s, a 1 B/s one
    halves them.  Slot 1 has no upload: its link's rate."""
    est = StepEstimate(1.0, True, [], [], [], copies=[
        (0, "h2d", 0.0, 2.0, "upload"), (0, "h2d", 1.0, 3.0, "load"), (1, "h2d", 0.0, 2.0, "load"),
        (0, "d2h", 0.0, 1.0, "activation"), (1, "d2h", 0.0, 1.0, "activation")])

    def machine(rc_bps: float) -> Machine:
        return Machine((1.0, 1.0), (100, 100), link=(1.0, 1.0), first_wave_peers=((0, 1), (0, 1)),
                       rc_bandwidth=(rc_bps, rc_bps))

    rates = copy_rates(machine(2.0), est)
    assert rates["upload"] == pytest.approx((1 / 1.5, 1.0))
    assert rates["d2h_forward"] == pytest.approx((1.0, 1.0))
    assert copy_rates(machine(1.0), est)["d2h_forward"] == pytest.approx((0.5, 0.5))
    assert rates["upload_backward"] == rates["d2h_backward"] == (1.0, 1.0)


def test_settled_contention_makes_sequential_mapping_slower_than_cross():
    """On the paper's 8x3090-4+4 (one 13.1 GB/s root complex per four GPUs) the copies of
    neighbouring stages meet under one root complex only when they are mapped sequentially: their
    own schedule says so, and the step gets slower (the runtime measured 13.5%, docs/benchmarks.md)."""
    topo = load_preset("8x3090-4+4")
    profile = analytic_profile("small", get_config("small"), 4, 128, 40.0, "fp32")
    bounds = [(i, i + 1) for i in range(12)] + [(12, 14)]  # the bench's plan (scripts/bench_emulated.py)
    cross_machine, cross = settle(profile, bounds, topo, cross_map(topo, 13), 4, True)
    seq_machine, seq = settle(profile, bounds, topo, sequential_map(topo, 13), 4, True)
    assert seq.step_s > 1.1 * cross.step_s
    assert min(seq_machine.upload) < min(cross_machine.upload) < 13.1e9


@pytest.mark.slow
def test_one_dilation_for_the_variants_of_a_comparison(tmp_path, capsys):
    """The factor is the model's (its CPU time over its GPU time on this machine): cross and
    sequential mapping, with and without prefetching, emulate at one factor; --dilation fixes it,
    below what a worker's CPU work of a step needs it is refused, and a run whose wall time would be
    absurd is refused naming what to change."""
    from mobius.boundary.errors import InputError
    from mobius.config import parse_train_args
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.runtime.inputs import check_model_input

    common = ["--model", "tiny8", "--topology", "topo2+2", "--emulate", "--steps", "4", "--micro-batches", "6"]

    def spec_of(extra):
        cfg = parse_train_args(common + extra)
        return prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))

    factors = {}
    for variant in (["--mapping", "cross"], ["--mapping", "sequential"], ["--no-prefetch"]):
        spec, _ = spec_of(variant)
        factors[" ".join(variant)] = spec.emulation.factor
    assert len(set(factors.values())) == 1, factors
    (factor,) = set(factors.values())
    spec, _ = spec_of(["--dilation", str(factor * 10)])
    assert spec.emulation.factor == factor * 10 and spec.emulation.how == "given"
    with pytest.raises(InputError, match=r"--dilation 1 is below what this machine needs for the run"):
        spec_of(["--dilation", "1"])
    with pytest.raises(InputError, match=r"--emulate: 1000000 steps at 1/.* speed would take about .* h of wall time"):
        spec_of(["--steps", "1000000"])


def test_a_stage_that_keeps_its_activations_is_spared_its_recomputation_and_holds_them():
    """Recomputation per stage in the cost model (the two one-layer stages by hand): S0 kept takes
    the step of recompute off (24 s) where recomputing it costs more; and its one micro-batch's
    saved activation (2 B) is held beside the slot's largest backward pass (10 B): 11 B do not
    hold them, 12 B do, and without keeping 11 B are enough."""
    prof, bounds = two_blocks(), [(0, 1), (1, 2)]

    def est(memory: int = 100, **kw):
        return evaluate(prof, bounds, Machine((1.0,), (memory,), prefetch=False), 1, **kw)

    assert est(recompute=True, kept=(0,)).step_s == pytest.approx(est(recompute=False).step_s) == pytest.approx(24.0)
    assert est(recompute=True).step_s > 24.0
    assert [c.recomputed for c in stage_costs(prof, bounds, True, kept=(0,))] == [False, False]
    assert not est(11, recompute=True, kept=(0,)).feasible and "saved activations" in est(11, recompute=True,
                                                                                             kept=(0,)).reason
    assert est(11, recompute=True).feasible and est(12, recompute=True, kept=(0,)).feasible


def test_the_planner_keeps_the_longest_forwards_that_fit_and_help():
    """kept_stages: greedily, the longest forward first, a stage kept where the step is feasible and
    faster with it; the head is never a candidate."""
    layer = dict(kind="block", similarity_class=0, bwd_s=2.0, param_bytes=4, out_bytes=1, fwd_work_bytes=0,
                 bwd_work_bytes=0)
    prof = Profile("t", 1, 1, "fp32", "synthetic", [LayerProfile(name=f"l{i}", fwd_s=f, **layer)
                                                    for i, f in enumerate([1.0, 3.0, 2.0, 5.0])])
    bounds = [(i, i + 1) for i in range(4)]
    tried = []

    def step_of(kept):
        tried.append(kept)
        feasible = 2 not in kept  # stage 2's activations do not fit
        return StepEstimate(10.0 - sum(prof.layers[j].fwd_s for j in kept), feasible, [], [], [])

    assert kept_stages(prof, bounds, step_of) == (0, 1)
    assert tried == [(), (1,), (1, 2), (0, 1)]  # by forward time: 1 (3 s), 2 (2 s), 0 (1 s); not 3, the head
