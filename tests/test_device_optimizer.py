"""Stages kept resident on their devices and updated there by AdamW: the plan's choice, the
schedule, the numbers (the reference's, to the bit in fp32) and checkpoints in and out."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import host_rate_cached, reference, run_in_threads

from mobius.backends import resolve
from mobius.config import RunConfig
from mobius.models import get_config
from mobius.partition.cost import stage_costs, step_bounds
from mobius.partition.profile import analytic_profile
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.planner import resident_stages
from mobius.runtime import checkpoint as ck
from mobius.runtime.inputs import check_model_input
from mobius.stages.ops import OFFLOAD, RELEASE, UPDATE, worker_ops
from mobius.train import main


@pytest.fixture
def slow_host():
    """A host whose AdamW a run measured at 1M parameters/s: keeping stages on the device pays by
    construction, whatever load this machine's own timings saw."""
    with host_rate_cached(1e6, workers=2):
        yield


def tiny(**kw) -> RunConfig:
    return RunConfig.of(**{"model": "tiny", "steps": 4, "micro_batches": 4, "micro_batch_size": 2, "seq_len": 32,
                        "lr": 1e-2, "progress": False, "topology": "cpu", "cpu_workers": 2, "stages": 3,
                        "precision": "fp32", **kw})


def test_resident_stages_are_loaded_once_and_updated_on_the_device():
    ops = worker_ops(6, [0, 2, 4], 2, recompute=True, resident=frozenset({2}))
    assert [op.kind for op in ops if op.stage == 2 and op.kind in (OFFLOAD, UPDATE, RELEASE)] == [UPDATE]
    assert [op.kind for op in ops if op.stage == 0 and op.kind in (OFFLOAD, UPDATE, RELEASE)] == [RELEASE, OFFLOAD,
                                                                                                   RELEASE]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["on", "off"])
def test_resident_stages_train_as_the_reference_to_the_bit(recompute, slow_host):
    """fp32 on 2 CPU workers: stages updated on the device give the reference's losses and weights
    exactly; in bf16 they give exactly what the same stages updated on the host give."""
    cfg = tiny(recompute=recompute)
    _, plan = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    assert plan.resident  # the tiny model leaves room on a 2 GB worker
    losses, weights = run_in_threads(cfg)
    ref_losses, ref_weights = reference(cfg)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    if recompute == "on":
        bf16 = [run_in_threads(tiny(recompute=recompute, precision="bf16", device_optimizer=d)) for d in ("auto", "off")]
        assert bf16[0][0] == bf16[1][0]
        assert all(torch.equal(bf16[0][1][n], w) for n, w in bf16[1][1].items())


@pytest.mark.slow
def test_a_resident_run_resumes_a_checkpoint_and_writes_one(tmp_path, slow_host):
    """The reference saves at step 3; the pipeline, with resident stages, takes its weights and
    AdamW moments onto the device, trains to step 6 and saves; the reference resumes that to step
    9: the losses and weights of one straight run."""
    args = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress", "--steps", "9"]
    pipe = ["--topology", "cpu", "--cpu-workers", "2", "--stages", "3"]
    cfg = RunConfig.of(model="tiny", seq_len=32, micro_batch_size=2, steps=9, topology="cpu", cpu_workers=2, stages=3)
    assert prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))[1].resident
    d, straight = tmp_path / "ck", tmp_path / "straight"
    main(args + ["--backend", "single", "--stop-after", "3", "--save", str(d), "--metrics", str(tmp_path / "a.jsonl")])
    main(args + pipe + ["--backend", "pipeline", "--resume", str(d), "--stop-after", "3", "--save", str(d),
                        "--metrics", str(tmp_path / "a.jsonl")])
    main(args + ["--backend", "single", "--resume", str(d), "--save", str(d), "--metrics", str(tmp_path / "a.jsonl")])
    main(args + ["--backend", "single", "--save", str(straight), "--metrics", str(tmp_path / "b.jsonl")])
    got, want = ([json.loads(line)["loss"] for line in open(tmp_path / f)] for f in ("a.jsonl", "b.jsonl"))
    assert got == pytest.approx(want, rel=1e-5) and len(got) == 9
    a, b = ck.load_checkpoint(d), ck.load_checkpoint(straight)
    names = [n for n in b.names() if not n.startswith("rng/")]  # weights and AdamW moments
    assert any(n.startswith("exp_avg/") for n in names)
    for name in names:
        torch.testing.assert_close(a.get(name), b.get(name), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_stages_stay_on_the_device_where_the_host_is_slow(slow_host):
    cfg = tiny()
    assert prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))[1].resident


@pytest.mark.slow
def test_the_planner_keeps_on_the_device_what_fits_and_helps():
    """Resident where the memory is there, none where it is not, none with --optimizer-lag, fp16 or
    --device-optimizer off; the host's lanes shrink by what the resident stages no longer move."""
    plan = lambda **kw: prepare_pipeline(resolve(tiny(**kw), backend="pipeline"),  # noqa: E731
                                         check_model_input(tiny(**kw)))[1]
    assert not plan(gpu_mem_gb=0.002).resident  # three stages barely fit: nothing stays
    for off in ({"device_optimizer": "off"}, {"optimizer_lag": 1}, {"precision": "fp16"}):
        assert not plan(**off).resident, off
    # A tied embedding's two copies are updated after the step's gradients are summed: never resident.
    config = get_config("gpt2")
    profile = analytic_profile("gpt2", config, 1, 64, 40.0, "fp32")
    bounds = [(0, 1), (1, 7), (7, 13), (13, 14)]
    chosen = resident_stages(profile, bounds, lambda r: SimpleNamespace(feasible=True, step_s=1.0 - len(r)), {0, 3})
    assert chosen == (1, 2)
    costs, kept = stage_costs(profile, bounds), stage_costs(profile, bounds, resident=(1, 2))
    before, after = (step_bounds(c, 4, 2, 10e9, 1e9, 4) for c in (costs, kept))
    one, two = costs[1], costs[2]
    assert after["host AdamW"] == pytest.approx(before["host AdamW"] - (one.grad_bytes + two.grad_bytes) / 4 / 1e9 / 2)
    # Stage 1 is loaded for forward and again for backward, stage 2 (one of the last two) once; each offloads.
    saved = 2 * one.param_bytes + two.param_bytes + one.grad_bytes + two.grad_bytes
    assert after["PCIe"] == pytest.approx(before["PCIe"] - saved / 10e9)
