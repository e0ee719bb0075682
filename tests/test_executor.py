"""The pipeline executor of several workers in one process: each worker's StageRunner on a thread,
linked by an in-process transport, every stream under the order checker.  Covers what only
several workers exercise (messages between workers, the tied embedding's exchange, fp16's
overflow vote) in seconds, without starting processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import reference, run_in_threads, save_hf_model

from mobius.config import RunConfig
from mobius.models import get_config
from mobius.runtime.spec import runs
from mobius.stages.executor import StageRunner

SEQ, MBS, M = 32, 2, 3


@pytest.fixture(scope="module")
def tied_gpt2(tmp_path_factory) -> str:
    """A 4-block GPT-2 directory with its token table tied to the LM head."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    return save_hf_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32,
                                                                              n_layer=4, n_head=4)), path)


def config(workers: int, stages: int, steps: int, model: str = "tiny8", **kw) -> RunConfig:
    return RunConfig.of(model=model, topology="cpu", cpu_workers=workers, stages=stages, steps=steps, seq_len=SEQ,
                        micro_batch_size=MBS, micro_batches=M, progress=False, **kw)


def assert_same(got, want) -> None:
    (losses, weights), (ref_losses, ref_weights) = got, want
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("workers,stages,recompute", [(2, 4, "on"), (2, 5, "off"), (4, 8, "on")])
def test_workers_in_threads_equal_the_reference(workers, stages, recompute):
    """Two stages per worker (the Mobius swap), an odd split where one worker holds three, four
    workers."""
    cfg = config(workers, stages, steps=3, recompute=recompute, precision="fp32")
    assert_same(run_in_threads(cfg), reference(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("workers,stages", [(2, 4), (3, 6)])
def test_tied_embedding_exchanged_between_workers(tied_gpt2, workers, stages):
    """The token table (stage 0) and the LM head (last stage) on different workers: their gradients
    are exchanged and summed before either copy is updated; both copies end equal to the
    reference's one parameter."""
    cfg = config(workers, stages, steps=3, model=tied_gpt2, recompute="on", precision="fp32")
    assert get_config(tied_gpt2).tie_embeddings
    got = run_in_threads(cfg)
    assert_same(got, reference(cfg))
    weights = got[1]
    head = [n for n in weights if n.endswith("lm_head.weight")]
    assert head and torch.equal(weights[head[0]], weights["layers.0.wte.weight"])


@pytest.mark.slow
def test_fp16_overflow_vote_in_threads(monkeypatch):
    """fp16: every worker skips the steps the vote (through the transport) finds an overflow in,
    made to at step 1 in both trainers.  Without the lag the updates start before the vote from
    step 1 on (the first step waits for it): step 1's are taken back, step 2 waits again, step 3's
    are kept.  The reference's losses and loss scale."""
    import mobius.reference
    from mobius.stages.host_optimizer import HostOptimizer

    def overflow_at_step_1(check):  # one call a step, per optimizer
        calls = {}

        def check_step(*args):
            owner = id(args[0]) if args and isinstance(args[0], HostOptimizer) else None
            calls[owner] = calls.get(owner, 0) + 1
            return calls[owner] == 2 or check(*args)
        return check_step

    cfg = config(2, 4, steps=4, recompute="on", precision="fp16")
    with monkeypatch.context() as m:
        m.setattr(mobius.reference, "grads_overflow", overflow_at_step_1(mobius.reference.grads_overflow))
        ref_losses, _ = reference(cfg)
    monkeypatch.setattr(HostOptimizer, "_overflowed", overflow_at_step_1(HostOptimizer._overflowed))
    workers = []
    losses, weights = run_in_threads(cfg, workers_out=workers)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert all(torch.isfinite(w).all() for w in weights.values())
    for _, parts in workers:
        assert (parts.scaler.skipped_steps, parts.scaler.scale) == (1, 2.0**15)
        optimizer = parts.runner.optimizer
        assert (optimizer.decisions.speculated_steps, optimizer.decisions.redone_steps) == ([1, 3], [1])


@pytest.mark.slow
@pytest.mark.parametrize("model,workers,stages", [("tiny8", 2, 4), ("tied", 2, 4), ("tiny8", 3, 3)])
def test_optimizer_lag_equals_its_reference(tied_gpt2, model, workers, stages):
    """--optimizer-lag 1: step k+1 computes with the weights before step k's update, on every
    backend alike; the final weights hold every update.  It is a different training (the losses
    part from the unlagged run's at step 1, which still computes with the initial weights),
    reproduced exactly."""
    model = tied_gpt2 if model == "tied" else model
    cfg = config(workers, stages, steps=4, model=model, recompute="on", precision="fp32", optimizer_lag=1)
    got, want = run_in_threads(cfg), reference(cfg)
    assert_same(got, want)
    unlagged, _ = reference(config(workers, stages, steps=4, model=model, precision="fp32"))
    assert want[0][0] == unlagged[0] and want[0][1] != pytest.approx(unlagged[1], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["on", "off"])
def test_lora_dropout_masks_are_the_references(recompute):
    """--lora-dropout: every micro-batch's masks are a function of (seed, step, micro-batch, layer,
    module, part), so the pipeline (whose recomputation redoes each forward) equals the reference;
    and the dropout does something."""
    cfg = config(2, 4, steps=3, recompute=recompute, precision="fp32", lora_rank=4, lora_dropout=0.3)
    got = run_in_threads(cfg)
    assert_same(got, reference(cfg))
    plain = reference(RunConfig.of(**{**cfg.to_dict(), "lora_dropout": 0.0}))
    assert abs(got[0][1] - plain[0][1]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("workers,stages,kept,options", [
    (2, 4, [1], {}),
    (4, 8, [0, 3, 5], {"optimizer_lag": 1}),
    (2, 5, [0, 2], {"lora_rank": 4, "lora_dropout": 0.3}),
])
def test_recomputation_per_stage_equals_the_reference(workers, stages, kept, options, monkeypatch):
    """Stages that keep their activations beside stages that recompute (the plan's per-stage
    choice), with and without the optimizer lag, and under LoRA with dropout (whose masks a
    recomputation must draw again): the reference's losses and weights, and only the stages that
    do not keep their activations recompute."""
    cfg = config(workers, stages, steps=3, recompute="on", precision="fp32", **options)
    plan_of, recomputed = {}, set()
    run_op = StageRunner._op_recompute
    monkeypatch.setattr(StageRunner, "_op_recompute", lambda self, op, st: (recomputed.add(op.stage),
                                                                            run_op(self, op, st)))

    def keeping(plan):
        plan_of["run"] = dataclasses.replace(plan, kept=kept)
        return plan_of["run"]

    assert_same(run_in_threads(cfg, plan_change=keeping), reference(cfg))
    assert recomputed == set(range(stages - 1)) - set(kept)
    plan = plan_of["run"]
    assert [plan.recomputes(s) for s in range(stages)] == [s not in kept for s in range(stages - 1)] + [False]
    again = [s for s in range(stages - 1) if s not in kept]
    assert f"recompute on for stages {runs(again)}, activations kept by stages {runs(kept)}" in plan.render()
    assert [plan.activations_of(s) for s in range(stages)] == \
        ["kept" if s in kept else "recomputed" for s in range(stages - 1)] + ["1F1B"]
