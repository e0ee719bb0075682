"""Clipping of the global gradient norm (``--max-grad-norm``) and the learning-rate schedules: every
backend applies the reference's update, however the step's gradients are spread over stages,
workers, devices, replicas and chunks (fp32)."""

import math

import pytest
import torch

from conftest import host_rate_cached, reference, run_in_threads

from mobius.backends import resolve
from mobius.backends.chunked import launch_chunked
from mobius.backends.pipeline import launch_pipeline
from mobius.boundary.errors import InputError
from mobius.config import RunConfig, parse_train_args
from mobius.models import get_config
from mobius.planning.pipeline import prepare_pipeline
from mobius.runtime.inputs import check_model_input
from mobius.runtime.optim import UpdateRule, adamw, clip_coefficient, squares, undo_adamw_step

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


@pytest.mark.parametrize("scheduler", ["linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [{}, {"warmup_ratio": 0.1}, {"warmup_ratio": 0.07}, {"warmup_steps": 5}])
def test_each_schedule_is_transformers_at_every_step(scheduler, warmup):
    """The lr of every step is the one ``transformers.get_scheduler`` gives by the same name, with
    the warm-up Hugging Face's Trainer counts (the ratio of the steps rounded up)."""
    transformers = pytest.importorskip("transformers")
    if scheduler == "constant" and warmup:
        with pytest.raises(InputError, match="constant has no warm-up"):
            parse_train_args(["--lr-scheduler", scheduler] + [f"--{k.replace('_', '-')}={v}" for k, v in warmup.items()])
        return
    steps, peak = 60, 3e-4
    optim = parse_train_args(["--lr", str(peak), "--steps", str(steps), "--lr-scheduler", scheduler]
                             + [f"--{k.replace('_', '-')}={v}" for k, v in warmup.items()]).optim
    rule = UpdateRule.of(optim)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=peak)
    hf_warmup = warmup.get("warmup_steps") or math.ceil(steps * warmup.get("warmup_ratio", 0.0))
    kwargs = {"min_lr_rate": optim.min_lr_ratio} if scheduler == "cosine_with_min_lr" else None
    theirs = transformers.get_scheduler(scheduler, opt, num_warmup_steps=hf_warmup, num_training_steps=steps,
                                        scheduler_specific_kwargs=kwargs)
    for step in range(steps):
        assert rule.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-9 * peak), step
        opt.step()
        theirs.step()


def test_the_update_rule_takes_hugging_faces_defaults_and_refuses_a_floor_nothing_uses():
    optim = parse_train_args([]).optim
    assert (optim.lr_scheduler, optim.warmup_ratio, optim.adam_beta2, optim.weight_decay) == ("linear", 0.0, 0.999, 0.0)
    with pytest.raises(InputError, match="--min-lr-ratio is where --lr-scheduler cosine_with_min_lr ends"):
        parse_train_args(["--min-lr-ratio", "0.2"])
    assert "cosine to 0.2x (transformers' 'cosine_with_min_lr' schedule)" in UpdateRule.of(
        parse_train_args(["--lr-scheduler", "cosine_with_min_lr", "--min-lr-ratio", "0.2"]).optim).describe()


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


def test_an_adamw_step_taken_back_and_redone_clipped_is_the_clipped_step():
    """The rollback a speculative update relies on: AdamW run backwards from what a step left
    and its gradients gives back the weights, moments and count before it, so a redo with the
    clipped gradients lands where the clipped step would have, to rounding (weight decay on and off)."""
    torch.manual_seed(0)
    for decay in (0.0, 0.1):
        start = torch.randn(4096) * 0.05
        mine, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        rule = UpdateRule(lr=1e-2, weight_decay=decay)
        a, b = (adamw([{"params": [p], "weight_decay": decay}], rule) for p in (mine, theirs))
        for _ in range(4):
            grad = torch.randn(4096)
            mine.grad, theirs.grad = grad.clone(), grad * 0.5
            a.step()
            undo_adamw_step(a)
            mine.grad.mul_(0.5)
            a.step()
            b.step()
        moments = ((a.state[mine][k], b.state[theirs][k]) for k in ("exp_avg", "exp_avg_sq"))
        for got, want in ((mine, theirs), *moments):
            assert ((got - want).norm() / want.norm()).item() < 1e-6
        assert float(a.state[mine]["step"]) == 4.0


@pytest.mark.slow
def test_updates_start_before_the_norm_and_the_step_that_clips_is_redone():
    """Clipping without the barrier (no lag): the first step, and a step after one that clipped,
    wait for the norm; the others update each stage as its gradients come home and keep it where
    the norm stays under the limit, or take it back and redo it clipped.  With the limit at 3
    this run's norms (3.9, 3.2, 2.8, 3.1, 3.1, 2.6, 2.2, 2.8, 2.8, 2.1) clip steps 0, 1, 3 and 4:
    step 3 is redone, steps 6 to 9 kept; the reference's losses and weights."""
    cfg = tiny(max_grad_norm=3.0, steps=10, stages=4, lr=3e-3)
    ref_losses, ref_weights = reference(cfg)
    workers = []
    close(*run_in_threads(cfg, workers_out=workers), ref_losses, ref_weights)
    for _, parts in workers:
        optimizer = parts.runner.optimizer
        assert (optimizer.decisions.speculated_steps, optimizer.decisions.redone_steps) == ([3, 6, 7, 8, 9], [3])


@pytest.mark.slow
def test_stages_kept_on_the_device_wait_for_the_norm_and_clip_as_the_reference():
    with host_rate_cached(1e6, workers=2):  # keeping stages on the device pays
        cfg = tiny(stages=3, device_optimizer="auto")
        plan = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))[1]
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
    history, weights, _ = launch_pipeline(resolve(cfg, backend="pipeline"), get_config("tiny"), return_weights=True)
    close([m.loss for m in history], weights, ref_losses, ref_weights)
    assert all(m.grad_norm > CLIP for m in history)

    chunked = tiny(backend="chunked", device_optimizer="auto", lr_scheduler="constant")  # the fourth schedule
    ref_losses, ref_weights = reference(chunked)
    history, weights, _ = launch_chunked(resolve(chunked, backend="chunked"), get_config("tiny"), return_weights=True)
    close([m.loss for m in history], weights, ref_losses, ref_weights)
