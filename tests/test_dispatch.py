"""The dispatched schedule run on CPU devices in this process (a thread per device, every stream
under the order checker, jittered): the reference trainer's losses and weights, whatever the
forward and backward partitions, the head's split, the kept tail, the optimizer lag, LoRA with
dropout, clipping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import reference

from mobius.backends import resolve
from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.metrics import Trace
from mobius.reference import ReferenceTrainer
from mobius.runtime.device import CpuDevice
from mobius.runtime.inputs import make_batches, make_data, model_config_for
from mobius.stages.dispatch import build_dispatched, check_dispatched
from mobius.stages.tasks import DispatchedShape, pieces, step_tasks

# tiny8: the embedding (layer 0), eight blocks, the head (layer 9).
SYMMETRIC = DispatchedShape([(0, 4), (4, 7), (7, 10)], [(0, 4), (4, 7), (7, 10)], [0, 1])
SPLIT_HEAD = DispatchedShape([(0, 4), (4, 7), (7, 10)], [(0, 2), (2, 5), (5, 7), (7, 8), (8, 10)], [1, 0],
                             head_gpus=2)
KEPT_TAIL = DispatchedShape([(0, 3), (3, 6), (6, 7), (7, 8), (8, 10)],
                            [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8), (8, 10)], [0, 2, 1, 3], kept=2, head_gpus=2)


def config(workers: int, **kw) -> RunConfig:
    kw = {"steps": 3, "model": "tiny8", **kw}
    return RunConfig.of(topology="cpu", cpu_workers=workers, seq_len=32, micro_batch_size=2,
                        micro_batches=4, progress=False, precision="fp32", **kw)


def run(cfg: RunConfig, shape: DispatchedShape, budget: int = 2**32, trace: Trace | None = None,
        runner_out: list | None = None):
    """Per-step losses and final weights; the devices' memory ledgers, which must end empty.
    ``runner_out`` gets the runner."""
    model_config = model_config_for(cfg)
    batches, _ = make_data(cfg, model_config)
    devices = [CpuDevice(check=True, jitter_ms=0.5) for _ in shape.order]
    runner = build_dispatched(cfg, model_config, shape, cfg.optim.precision, devices, [budget] * len(devices),
                              batches, trace or Trace(enabled=False))
    if runner_out is not None:
        runner_out.append(runner)
    try:
        losses = [runner.step(k) for k in range(cfg.optim.steps)]
        runner.drain()
    finally:
        runner.close()
    weights = {}
    for p in runner.store.stages:
        weights.update(runner.store.stage_state_dict(p))
    return losses, weights, [w.memory.used for w in runner.workers]


def assert_same(got, want, holding: set[int] = frozenset()) -> None:
    """The reference's losses and weights; every device byte the tasks took came back, but on the
    devices ``holding`` resident stages."""
    (losses, weights, left), (ref_losses, ref_weights) = got, want
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert [g for g, used in enumerate(left) if used] == sorted(holding)


@pytest.mark.slow
@pytest.mark.parametrize("shape,lag", [(SYMMETRIC, 0), (SPLIT_HEAD, 1), (KEPT_TAIL, 0), (KEPT_TAIL, 1)],
                         ids=["2-symmetric-lag0", "2-split-head-lag1", "4-kept-tail-lag0", "4-kept-tail-lag1"])
def test_dispatched_equals_the_reference(shape, lag):
    """Two and four devices; forward and backward cut apart; the head's micro-batches on two
    devices (their gradients summed on the host); two stages kept for their backward where their
    forward ran; with the lag, the next step's forward overlapping this step's backward."""
    cfg = config(len(shape.order), optimizer_lag=lag)
    assert_same(run(cfg, shape), reference(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{}, {"lora_rank": 4, "lora_dropout": 0.3, "max_grad_norm": 0.05}],
                         ids=["plain", "lora-dropout-clipping"])
def test_resident_stages_stay_on_their_devices_and_are_updated_there(changes):
    """The kept tail's two stages resident on devices 1 and 3: their forwards run there every step
    (out of turn), their weights never leave, their AdamW runs there (held for the step's norm
    where it clips, its gradients counted in it); the others as ever.  Those two devices end
    holding them; the final weights, copied back, are the reference's."""
    cfg = config(4, **changes)
    shape = dataclasses.replace(KEPT_TAIL, resident=[(2, 1), (3, 3)])
    tasks = step_tasks(shape.forward, shape.backward, 2, 2, shape.order, 4, steps=2, resident=shape.resident)
    assert {(t.name, t.gpu) for t in tasks if t.name in ("F2", "F3", "B3", "B4")} == \
        {("F2", 1), ("B3", 1), ("F3", 3), ("B4", 3)}
    assert_same(run(cfg, shape), reference(cfg), holding={1, 3})


@pytest.mark.slow
def test_lora_with_dropout_and_clipping_equal_the_reference():
    """LoRA adapters on frozen pieces (the embedding and head train nothing), each micro-batch's
    dropout masks drawn alike in forward and in recomputations that start mid-stage, and the
    global norm clipping every piece's update, summed over the step's pieces."""
    cfg = config(2, lora_rank=4, lora_dropout=0.3, max_grad_norm=0.05)
    want = reference(cfg)
    assert want[0] != pytest.approx(reference(config(2, lora_rank=4, lora_dropout=0.3))[0], rel=1e-6)  # it clips
    assert_same(run(cfg, SPLIT_HEAD), want)


@pytest.mark.slow
def test_updates_start_before_the_norm_and_the_step_that_clips_is_redone():
    """Clipping without the barrier: after a step under the limit, each piece's update runs as its
    gradients are summed (the head's two parts too) and the loads wait for the norm, which keeps
    it, or takes it back and redoes it clipped.  With the limit at 3.1 this run's norms (4.5, 3.4,
    2.9, 3.2, 3.1, 2.5) clip steps 0, 1 and 3: step 3 is redone, step 5 kept."""
    cfg = config(2, max_grad_norm=3.1, steps=6)
    runner, trace = [], Trace(enabled=True)
    assert_same(run(cfg, SPLIT_HEAD, trace=trace, runner_out=runner), reference(cfg))
    decisions = runner[0].updates.decisions
    assert (decisions.speculated_steps, decisions.redone_steps) == ([3, 5], [3])
    # The updates a step holds for its norm run on the host threads, as planned, not one after
    # the other on the thread that summed the step's last gradients.
    threads: dict[int, set[str]] = {}
    for e in trace.events:
        if e["name"].startswith("AdamW piece"):
            threads.setdefault(e["args"]["step"], set()).add(e["args"]["thread"])
    assert max(len(threads[k]) for k in (0, 1, 2, 4)) == 2


@pytest.mark.slow
def test_the_heads_update_in_slices_is_whole_before_its_step_is_decided(monkeypatch):
    """The head's update made before the step's norm runs in slices on the optimizer threads; the
    step's decision (which keeps it and lets its gradients go, or takes it back and redoes it)
    waits for the last slice: with every slice but the first held back 200 ms, the run still equals
    the reference, clipped steps redone and all."""
    import time

    import mobius.stages.piece_updates as piece_updates

    unheld = piece_updates.host_update

    def held_back(optimizer, *args, params=None, **kw):
        if params is not None and params[0] is not optimizer.param_groups[0]["params"][0]:
            time.sleep(0.2)
        unheld(optimizer, *args, params=params, **kw)

    monkeypatch.setattr(piece_updates, "host_update", held_back)
    cfg = config(2, max_grad_norm=3.1, steps=6)
    runner = []
    assert_same(run(cfg, SPLIT_HEAD, runner_out=runner), reference(cfg))
    assert runner[0].updates.decisions.redone_steps == [3]


@pytest.mark.slow
def test_bf16_follows_the_bf16_reference():
    """16-bit compute copies and gradient staging (the GPUs' default), fp32 masters and AdamW: the
    reference's bf16 losses to bf16's precision."""
    cfg = config(4, optimizer_lag=1, steps=4).changed(precision="bf16")
    losses = run(cfg, KEPT_TAIL)[0]
    assert losses == pytest.approx(reference(cfg, precision="bf16")[0], rel=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_fp16_skips_the_step_that_overflows_as_the_reference_does(monkeypatch, lag):
    """fp16 loss scaling: every piece's update is decided by the step's vote; where it finds a
    non-finite gradient (made to at step 1, in both trainers: whether a gradient overflows near the
    threshold depends on the partition's rounding) every piece skips its update and the scale
    halves; else each steps with its gradients unscaled.  The next step's head scales its loss by
    what the vote left, whatever the lag.  The reference's losses, skipped steps and scale, and
    every AdamW three steps on (16-bit gradients of tiny weights differ by the partition's rounding
    and AdamW takes their signs: fp16 weights are compared in the losses they give)."""
    import mobius.reference
    from mobius.stages.piece_updates import PieceUpdates

    def overflow_at_step_1(check):
        calls = []

        def check_step(*args):
            calls.append(None)
            return len(calls) == 2 or check(*args)
        return check_step
    cfg = config(4, optimizer_lag=lag, steps=4).changed(precision="fp16")
    with monkeypatch.context() as m:
        m.setattr(mobius.reference, "grads_overflow", overflow_at_step_1(mobius.reference.grads_overflow))
        ref = ReferenceTrainer(cfg.changed(backend="single"), model_config_for(cfg),
                               make_batches(cfg, model_config_for(cfg)), torch.device("cpu"))
        ref_losses = [ref.step(k).loss for k in range(4)]
    monkeypatch.setattr(PieceUpdates, "_overflowed", overflow_at_step_1(PieceUpdates._overflowed))
    runner = []
    losses, weights, left = run(cfg, KEPT_TAIL, runner_out=runner)
    assert (ref.scaler.skipped_steps, ref.scaler.scale) == (1, 2.0**15)
    assert (runner[0].updates.scaler.skipped_steps, runner[0].updates.scaler.scale) == (1, 2.0**15)
    assert losses == pytest.approx(ref_losses, rel=1e-4)  # fp16 compute, partitioned
    adam_steps = {int(state["step"]) for host in runner[0].store.stages.values() if host.optimizer is not None
                  for state in host.optimizer.state.values()}
    assert adam_steps == {int(state["step"]) for state in ref.optimizer.state.values()} == {3}
    assert not any(left) and set(weights) == set(ref.master)
    # Without the lag the updates start before the vote from step 1 on (the first step waits for
    # it); step 1's are taken back, step 2 waits again, step 3's are kept.
    decisions = runner[0].updates.decisions
    assert (decisions.speculated_steps, decisions.redone_steps) == (([1, 3], [1]) if lag == 0 else ([], []))


def test_the_trace_shows_which_gpu_ran_each_task():
    cfg = config(4, steps=1)
    trace = Trace(enabled=True)
    run(cfg, KEPT_TAIL, trace=trace)
    ran = sorted((e["name"], e["pid"]) for e in trace.collect() if e["tid"] == "compute")
    want = sorted((t.name, t.gpu) for t in step_tasks(KEPT_TAIL.forward, KEPT_TAIL.backward, 2, 2,
                                                      KEPT_TAIL.order, 4))
    assert ran == want
    assert ("B4", dict(want)["F3"]) in want  # a kept stage's backward ran where its forward did
    # The head's update (its two parts summed, AdamW) in two slices, on the optimizer threads, which
    # together cover it; no other piece's is split.
    head = len(pieces(KEPT_TAIL.forward, KEPT_TAIL.backward)) - 1
    slices = [e for e in trace.collect() if e["name"].endswith(" slice")]
    assert [e["name"] for e in slices] == [f"AdamW piece {head} slice"] * 2
    assert sum(e["args"]["share"] for e in slices) == pytest.approx(1.0)
    assert all(e["args"]["thread"].startswith("mobius-optimizer") for e in slices)


def test_pieces_cut_wherever_either_partition_does():
    assert pieces(KEPT_TAIL.forward, KEPT_TAIL.backward) == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8),
                                                             (8, 10)]


def test_a_device_out_of_memory_fails_the_step_with_its_reason():
    """A task that does not fit its device's budget ends the run with the budget's message on the
    caller's thread: no device waits for it forever."""
    with pytest.raises(RuntimeError, match="budget"):
        run(config(2, steps=1), SYMMETRIC, budget=2**16)


@pytest.mark.parametrize("changes,refused", [({"replan": "auto"}, "replan"), ({"offload_dir": "x"}, "offload-dir")])
def test_what_it_does_not_run_is_refused_before_anything_is_built(changes, refused):
    with pytest.raises(InputError, match=refused):
        check_dispatched(config(2, **changes))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from tiny_hf_models import make_dirs

    return make_dirs(tmp_path_factory.mktemp("hf-dispatch"))["gpt2"]


# GPT-2 with two blocks: the embedding (layer 0), the blocks, the head (layer 3), its table tied to the embedding's.
TIED = DispatchedShape([(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)], [0, 1], head_gpus=2)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{"optimizer_lag": 1, "max_grad_norm": 0.05}, {}], ids=["lag1-clipping", "plain"])
def test_a_tied_token_table_is_updated_with_both_copies_gradients(gpt2_dir, changes):
    """The embedding's piece and the head's each hold a copy of the tied table: each update waits
    for the other's gradients and steps with their sum (the norm counting it once), so both copies
    end as the reference's one parameter."""
    cfg = config(2, model=str(gpt2_dir), **changes)
    assert model_config_for(cfg).tie_embeddings
    got = run(cfg, TIED)
    assert_same(got, reference(cfg))
    weights = got[1]
    head = next(n for n in weights if n.endswith("lm_head.weight"))
    assert torch.equal(weights[head], weights["layers.0.wte.weight"])


@pytest.mark.slow
def test_a_dispatched_run_stops_saves_and_resumes_as_one_straight_run(tmp_path):
    """Through ``mobius.train`` (one process driving both devices), with the lag and clipping:
    stopped after 2 of 4 steps, saved piece by piece, resumed from there; the losses, each step's
    own gradient norm (its metrics are completed once its updates are in, after the next step
    started), the final weights and AdamW state those of the single backend's straight run."""
    import json

    from mobius.runtime import checkpoint as ck
    from mobius.train import main

    args = ["--model", "tiny8", "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "4", "--steps", "4",
            "--optimizer-lag", "1", "--precision", "fp32", "--max-grad-norm", "0.05", "--no-progress"]
    dispatched = ["--topology", "cpu", "--cpu-workers", "2", "--schedule", "dispatched"]
    d, s = tmp_path / "d", tmp_path / "s"
    main(args + dispatched + ["--stop-after", "2", "--save", str(d), "--metrics", str(tmp_path / "d.jsonl")])
    main(args + dispatched + ["--resume", str(d), "--save", str(d), "--metrics", str(tmp_path / "d.jsonl")])
    main(args + ["--backend", "single", "--save", str(s), "--metrics", str(tmp_path / "s.jsonl")])
    records = [[json.loads(line) for line in open(tmp_path / f"{k}.jsonl")] for k in "ds"]
    losses, norms = ([[r[key] for r in run] for run in records] for key in ("loss", "grad_norm"))
    assert [r["step"] for r in records[0]] == [1, 2, 3, 4]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and len(set(norms[1])) == 4
    got, want = ck.load_checkpoint(d), ck.load_checkpoint(s)
    assert got.step == want.step == 4 and set(got.names()) == set(want.names())
    for name in want.names():
        if not name.startswith("rng/"):  # each backend's own random streams
            torch.testing.assert_close(got.get(name), want.get(name), rtol=1e-5, atol=1e-6, msg=name)
    assert any(n.startswith(ck.LAGGED) for n in got.names()) and any("exp_avg" in n for n in got.names())


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{"optimizer_lag": 1, "max_grad_norm": 0.05, "model": "gpt2"},
                                     {"lora_rank": 4, "lora_dropout": 0.3}, {"precision": "fp16", "optimizer_lag": 1}],
                         ids=["tied-lag1-clipping", "lora-dropout", "fp16-lag1"])
def test_two_replicas_of_the_dispatched_schedule_equal_the_reference(tmp_path, gpt2_dir, changes):
    """Two processes, a box of two devices each, on half the step's micro-batches each: every
    piece's gradients summed over them into their owners, each owner's AdamW, the weights broadcast
    back, whatever order the pieces came home in (with clipping, by the norm of the sums; a tied
    table's two copies with one owner, which sums them; in fp16, after the replicas' overflow
    vote); LoRA's dropout masks those of the micro-batches' places in the whole step.  The
    reference's losses and weights (fp16's: its losses and loss scale), each replica's AdamW
    shards in the checkpoint."""
    import os

    from mobius.backends.pipeline import launch_pipeline
    from mobius.runtime import checkpoint as ck

    if changes.get("model") == "gpt2":
        changes = {**changes, "model": str(gpt2_dir)}
    precision = changes.pop("precision", "fp32")
    cfg = config(2, data_parallel=2, schedule="dispatched", save=str(tmp_path / "ck"), **changes)
    cfg = cfg.changed(precision=precision)
    want_losses, want_weights = reference(cfg)
    history, weights, results = launch_pipeline(resolve(cfg, backend="pipeline"), model_config_for(cfg),
                                                return_weights=True)
    if precision == "fp16":  # 16-bit gradients of tiny weights differ by the partition's rounding: see above
        assert [m.loss for m in history] == pytest.approx(want_losses, rel=1e-4)
        assert history[-1].loss_scale == 2.0**16 and history[-1].skipped_steps == 0
    else:
        assert [m.loss for m in history] == pytest.approx(want_losses, rel=1e-5)
        for name, w in want_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert len(results) == 2
    shards = {f for f in os.listdir(tmp_path / "ck") if f.startswith("optimizer-")}
    assert {f.rsplit("-", 1)[1] for f in shards} == {"replica0.safetensors", "replica1.safetensors"}
    saved = ck.load_checkpoint(str(tmp_path / "ck"))
    trained = [n for n in saved.names() if n in want_weights]  # under LoRA: the adapters
    assert trained and all(torch.equal(saved.get(n), weights[n]) for n in trained)
