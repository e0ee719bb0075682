"""Clipping of the global gradient norm (``--max-grad-norm``) and the learning-rate schedules: every
backend applies the reference's update, however the step's gradients are spread over stages,
workers, devices, replicas and chunks (fp32)."""

import math

import pytest
import torch

from conftest import host_rate_cached, reference, run_in_threads

from mobius.backends.chunked import launch_chunked
from mobius.backends.pipeline import launch_pipeline
from mobius.boundary.errors import InputError
from mobius.config import RunConfig, parse_train_args
from mobius.models import get_config
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.prepare import resolve_topology
from mobius.runtime.inputs import check_model_input
from mobius.runtime.optim import UpdateRule, clip_coefficient, squares

CLIP = 0.1  # the tiny model's gradients have a norm of about 1-4: every step is clipped


def tiny(**kw) -> RunConfig:
    return RunConfig.of(**{"model": "tiny", "steps": 4, "micro_batches": 4, "micro_batch_size": 2, "seq_len": 32,
                           "lr": 1e-2, "progress": False, "topology": "cpu", "cpu_workers": 2, "precision": "fp32",
                           "backend": "pipeline", "max_grad_norm": CLIP, "device_optimizer": "off", **kw})


def close(losses, weights, ref_losses, ref_weights, rel=1e-5):
    """The standard's fp32 tolerance: a clipping rule off by its epsilon is below it (the rule
    itself is checked exactly below), a norm off by a stage's share is far above it; four steps at
    lr 1e-2 leave the summation orders of this machine's kernels about 1e-6 apart."""
    assert losses == pytest.approx(ref_losses, rel=rel, abs=0)
    assert set(ref_weights) <= set(weights)  # (a tied table has a copy on the head's worker)
    for name, w in ref_weights.items():
        mine = weights[name]
        if name.endswith("qkv.bias"):  # the key bias gets no gradient in exact arithmetic (softmax ignores a
            third = w.numel() // 3     # constant added to every score): AdamW turns rounding noise into steps
            mine, w = torch.cat([mine[:third], mine[2 * third:]]), torch.cat([w[:third], w[2 * third:]])
        assert ((mine - w).norm() / w.norm().clamp_min(1e-12)).item() < rel, name


def test_the_clipping_rule_is_torchs():
    grads = [torch.tensor([3.0, 0.0]), None, torch.tensor([[4.0]])]
    assert squares(grads) == 25.0
    assert clip_coefficient(25.0, 1.0) == pytest.approx(1 / (5 + 1e-6))
    assert clip_coefficient(25.0, 10.0) == 1.0 and clip_coefficient(25.0, 0.0) == 1.0
    assert clip_coefficient(float("inf"), 1.0) == 1.0
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads if g is not None]
    for p, g in zip(ps, [g for g in grads if g is not None]):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    assert ps[0].grad[0].item() == pytest.approx(3.0 * clip_coefficient(25.0, 1.0), rel=1e-7)


def test_the_schedules():
    """Warm-up then cosine or linear to the floor, or constant; the default is the schedule the
    runs had before the settings existed, to the bit."""
    rule = UpdateRule(lr=1.0, steps=40)
    old = [1.0 * (s + 1) / 4 if s < 4 else 1.0 * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (s - 4) / 36))))
           for s in range(40)]
    assert [rule.lr_at(s) for s in range(40)] == old
    linear = UpdateRule(lr=2.0, steps=10, scheduler="linear", warmup_ratio=0.0, min_lr_ratio=0.0)
    assert [linear.lr_at(s) for s in (0, 5, 10)] == [2.0, 1.0, 0.0]
    assert UpdateRule(lr=1.0, steps=10, scheduler="constant").lr_at(0) == 1.0  # no warm-up
    warm = UpdateRule(lr=1.0, steps=10, scheduler="constant_with_warmup", warmup_steps=4)
    assert [warm.lr_at(s) for s in (0, 3, 4, 9)] == [0.25, 1.0, 1.0, 1.0]


def test_the_settings_are_checked_and_clipping_defaults_to_the_peers_for_hugging_face_models(tmp_path):
    assert parse_train_args(["--model", "tiny"]).optim.max_grad_norm == 0.0  # a preset trains as before
    for args, said in ((["--max-grad-norm", "-1"], "--max-grad-norm must be"),
                       (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
                       (["--warmup-ratio", "2"], "--warmup-ratio must be in [0, 1]"),
                       (["--warmup-steps", "100", "--steps", "10"], "--warmup-steps must be between 0 and --steps"),
                       (["--weight-decay", "nan"], "--weight-decay must be between 0 and 10")):
        with pytest.raises(InputError, match=said.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            parse_train_args(["--model", "tiny"] + args)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from tiny_hf_models import make_dirs

    return make_dirs(tmp_path_factory.mktemp("hf-clip"))["gpt2"]


@pytest.mark.slow
@pytest.mark.parametrize("model,workers,recompute,lag,scheduler", [
    ("gpt2", 2, "on", 0, "cosine"), ("tiny8", 4, "off", 0, "constant_with_warmup"), ("tiny", 2, "on", 1, "linear")])
def test_the_pipeline_clips_the_global_norm_as_the_reference(model, workers, recompute, lag, scheduler, gpt2_dir):
    """Stages on 2 and 4 workers (GPT-2's tied embedding and head on different workers, its
    gradient counted once), recomputation on and off, the optimizer lag, three schedules (the
    fourth, constant, is the others' arithmetic without the decay: test_the_schedules)."""
    cfg = tiny(model=str(gpt2_dir) if model == "gpt2" else model, cpu_workers=workers, stages=2 * workers,
               recompute=recompute, optimizer_lag=lag, lr_scheduler=scheduler, warmup_steps=2)
    ref_losses, ref_weights = reference(cfg)
    _, unclipped = reference(cfg, max_grad_norm=0.0)
    assert any(not torch.allclose(w, unclipped[n], rtol=1e-3) for n, w in ref_weights.items())  # it clipped
    close(*run_in_threads(cfg), ref_losses, ref_weights)


@pytest.mark.slow
def test_stages_kept_on_the_device_wait_for_the_norm_and_clip_as_the_reference():
    with host_rate_cached(1e6, workers=2):  # keeping stages on the device pays
        cfg = tiny(stages=3, device_optimizer="auto")
        plan = prepare_pipeline(cfg, resolve_topology(cfg), check_model_input(cfg))[1]
        assert plan.resident
        ref_losses, ref_weights = reference(cfg)
        close(*run_in_threads(cfg), ref_losses, ref_weights)


@pytest.mark.slow
def test_replicas_and_the_chunked_backend_clip_as_the_reference():
    """Worker processes: two data-parallel replicas of a 2-worker pipeline (the norm of the
    replicas' summed gradients, each part counted by its owner), and the chunked engine on 2
    workers (each rank's shards, at the constant schedule); every step's norm is above the clip."""
    cfg = tiny(data_parallel=2, cpu_workers=2, stages=2)
    ref_losses, ref_weights = reference(cfg)
    history, weights, _ = launch_pipeline(cfg, get_config("tiny"), resolve_topology(cfg), return_weights=True)
    close([m.loss for m in history], weights, ref_losses, ref_weights)
    assert all(m.grad_norm > CLIP for m in history)

    chunked = tiny(backend="chunked", device_optimizer="auto", lr_scheduler="constant")  # the fourth schedule
    ref_losses, ref_weights = reference(chunked)
    history, weights, _ = launch_chunked(chunked, get_config("tiny"), resolve_topology(chunked), return_weights=True)
    close([m.loss for m in history], weights, ref_losses, ref_weights)
