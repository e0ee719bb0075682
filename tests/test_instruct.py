"""Instruction and chat fine-tuning: every backend against ``transformers``' own model run on each
example unpacked and alone, with the same masks and the step's token-mean loss."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import run_in_threads  # noqa: E402
from make_tiny_chat_model import make_tiny_chat_model  # noqa: E402

from mobius.backends import resolve  # noqa: E402
from mobius.backends.chunked import launch_chunked  # noqa: E402
from mobius.backends.pipeline import launch_pipeline  # noqa: E402
from mobius.config import RunConfig  # noqa: E402
from mobius.models import IGNORE, get_config  # noqa: E402
from mobius.reference import ReferenceTrainer  # noqa: E402
from mobius.runtime.inputs import make_batches, make_data, make_eval_batches, model_config_for  # noqa: E402
from mobius.runtime.optim import UpdateRule, make_adamw, set_lr  # noqa: E402
from topology import cpu_topology  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def chat_records(n: int) -> list[dict]:
    """Conversations of one or two exchanges (a system turn in some), of varied lengths."""
    out = []
    for i in range(n):
        w = WORDS[i % len(WORDS)]
        msgs = [{"role": "user", "content": f"say {w} {'twice' if i % 2 else 'once'}"},
                {"role": "assistant", "content": (w + " ") * (1 + i % 2)}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "be brief"}] + msgs + [
                {"role": "user", "content": "again"}, {"role": "assistant", "content": w[::-1]}]
        out.append({"messages": msgs})
    return out


def alpaca_records(n: int) -> list[dict]:
    return [{"instruction": f"Add {i} and {i % 7}.", "input": "" if i % 2 else "numbers", "output": str(i + i % 7)}
            for i in range(n)]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    model = make_tiny_chat_model(root / "model", hidden=32, layers=4)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(24)))
    (root / "alpaca.json").write_text(json.dumps(alpaca_records(24)))
    return {"model": str(model), "chat": str(root / "chat.jsonl"), "alpaca": str(root / "alpaca.json")}


def config(setup, data="chat", **kw) -> RunConfig:
    base = dict(model=setup["model"], data=setup[data], steps=3, seq_len=160, micro_batch_size=2, micro_batches=4,
                lr=1e-2, precision="fp32", progress=False, topology="cpu")
    return RunConfig.of(**{**base, **kw})


def transformers_losses(cfg: RunConfig) -> list[float]:
    """``transformers``' Llama on each example of each step alone (cut out of the packed rows by
    its example id), summing the trained tokens' cross-entropy over the step and dividing by
    their count; our AdamW and schedule."""
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    rule = UpdateRule.of(cfg.optim)
    optimizer = make_adamw(model.named_parameters(), rule)
    batches = make_batches(cfg, model_config_for(cfg))
    losses = []
    for step in range(cfg.optim.steps):
        set_lr(optimizer, rule.lr_at(step))
        micro = batches.step(step)
        total = torch.zeros(())
        examples = 0
        for mb in micro:
            lay = mb.layout
            for row in range(mb.tokens.shape[0]):
                segments = lay.segments[row] if lay.segments is not None else torch.zeros_like(mb.tokens[row])
                for e in segments.unique().tolist():
                    if e < 0:
                        continue  # padding
                    keep = segments == e
                    tokens, targets = mb.tokens[row][keep], lay.targets[row][keep]
                    logits = model(tokens[None]).logits[0]
                    total = total + F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
                    examples += 1
        loss = total / micro[0].layout.loss_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def single_losses(cfg: RunConfig) -> list[float]:
    trainer = ReferenceTrainer(RunConfig.from_dict({**cfg.to_dict(), "backend": "single"}), model_config_for(cfg),
                               make_batches(cfg, model_config_for(cfg)), torch.device("cpu"))
    return [trainer.step(k).loss for k in range(cfg.optim.steps)]


def close(a, b) -> bool:
    return len(a) == len(b) and all(abs(x - y) / abs(y) < 1e-5 for x, y in zip(a, b))


def test_packed_rows_hold_several_examples_with_answers_only_trained(chat_setup):
    cfg = config(chat_setup)
    batches = make_batches(cfg, model_config_for(cfg))
    assert batches.packed.truncated == 0
    mb = batches.step(0)[0]
    seg, pos, tgt = mb.layout.segments, mb.layout.positions, mb.layout.targets
    assert (batches.packed.segments.max(axis=1) >= 1).sum() >= batches.sequences // 2  # rows hold several
    for row in range(seg.shape[0]):
        for e in seg[row].unique().tolist():
            if e >= 0:
                p = pos[row][seg[row] == e]
                assert torch.equal(p, torch.arange(p.numel()))  # positions restart per example
    trained = tgt[tgt != IGNORE]
    assert 0 < trained.numel() < (seg >= 0).sum()  # prompts are not trained
    text = bytes(t for t in mb.tokens[0].tolist() if t < 256).decode()
    assert "<" not in text and "say" in text  # the special tokens are single ids, not bytes
    assert (tgt == 258).any() and not (tgt == 256).any()  # each turn's <|im_end|> is trained, no EOS after it


@pytest.mark.slow
@pytest.mark.parametrize("data", ["chat", "alpaca"])
def test_single_and_pipeline_threads_equal_transformers_on_each_example(chat_setup, data):
    """Packing on: single, the pipeline on 2 and 4 workers with recompute on and off, all equal
    to transformers on each example alone."""
    cfg = config(chat_setup, data)
    want = transformers_losses(cfg)
    assert close(single_losses(cfg), want)
    for workers, stages, recompute in ((2, 4, "on"), (2, 4, "off"), (4, 6, "on"), (4, 6, "off")):
        got, _ = run_in_threads(RunConfig.from_dict({**cfg.to_dict(), "backend": "pipeline", "cpu_workers": workers,
                                                     "stages": stages, "recompute": recompute}))
        assert close(got, want), (workers, recompute)


def test_padding_without_packing_equals_transformers(chat_setup):
    """--packing off: one example per padded sequence, plain causal attention, pads untrained; each
    micro-batch padded to its longest example (as Hugging Face's collators pad), not --seq-len."""
    cfg = config(chat_setup, packing="off")
    batches = make_batches(cfg, model_config_for(cfg))
    assert batches.sequences == 24 and batches.step(0)[0].layout.segments is None
    lengths = (batches.packed.segments >= 0).sum(axis=1)
    b = cfg.batch.micro_batch_size
    for k in range(cfg.optim.steps):
        idx = batches.step_sequences(k)
        widths = [mb.tokens.shape[1] for mb in batches.step(k)]
        assert widths == [lengths[idx[a:a + b]].max() for a in range(0, idx.size, b)]
    assert min(widths) < cfg.batch.seq_len
    want = transformers_losses(cfg)
    assert close(single_losses(cfg), want)
    got, _ = run_in_threads(RunConfig.from_dict({**cfg.to_dict(), "backend": "pipeline", "cpu_workers": 2,
                                                 "stages": 4, "recompute": "on"}))
    assert close(got, want)


def test_micro_batch_split_does_not_change_the_step(chat_setup):
    """1, 2 and 8 micro-batches of the same 8 sequences: the same token-mean loss and gradients."""
    runs = []
    for m in (1, 2, 8):
        cfg = config(chat_setup, micro_batches=m, micro_batch_size=8 // m)
        trainer = ReferenceTrainer(RunConfig.from_dict({**cfg.to_dict(), "backend": "single"}), model_config_for(cfg),
                                   make_batches(cfg, model_config_for(cfg)), torch.device("cpu"))
        losses = [trainer.step(k).loss for k in range(cfg.optim.steps)]
        runs.append((losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    for losses, weights in runs[1:]:
        assert close(losses, runs[0][0])
        for name, w in weights.items():
            # The split changes the order of the gradient's sums; AdamW's g / sqrt(v) turns that
            # last-bit difference into ~1e-6 where a gradient is near zero (seen on AVX-512 hosts).
            torch.testing.assert_close(w, runs[0][1][name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pipeline_and_chunked_processes_equal_transformers_and_evaluate_alike(chat_setup):
    """The workers as processes (data, masks and positions derived in each worker): pipeline (bound
    and dispatched) and chunked on 2 CPU workers equal transformers; their held-out losses
    (--eval-split, after steps 2 and 3) equal the single backend's."""
    cfg = config(chat_setup, micro_batches=4, eval_split=0.2, eval_every=2)
    want = transformers_losses(cfg)
    trainer = ReferenceTrainer(RunConfig.from_dict({**cfg.to_dict(), "backend": "single"}), model_config_for(cfg),
                               make_batches(cfg, model_config_for(cfg)), torch.device("cpu"))
    held_out = make_eval_batches(cfg, model_config_for(cfg))
    want_eval = []
    for k in range(cfg.optim.steps):
        trainer.step(k)
        if k + 1 >= 2:
            want_eval.append(trainer.evaluate(held_out))
    model_config = get_config(cfg.model)
    for launch, backend in ((launch_pipeline, {"backend": "pipeline", "stages": 3}),
                            (launch_pipeline, {"backend": "pipeline", "schedule": "dispatched"}),
                            (launch_chunked, {"backend": "chunked"})):
        run_cfg = RunConfig.from_dict({**cfg.to_dict(), "cpu_workers": 2, **backend})
        # As mobius.train launches them: the workers map the data this process made.
        history = launch(resolve(run_cfg, cpu_topology(2), run_cfg.backend), model_config,
                         data=make_data(run_cfg, model_config_for(run_cfg)))
        assert close([m.loss for m in history], want), backend
        assert [m.eval_loss is not None for m in history] == [False, True, True]
        assert close([m.eval_loss for m in history[1:]], want_eval), backend


@pytest.mark.slow
def test_fine_tuned_model_answers_a_held_out_prompt_and_stops(tmp_path):
    """The job done: a tiny Llama fine-tuned on an instruction set (parity of a number), exported,
    answers prompts it never saw with transformers' generate and stops at the end of its turn.  (At
    lr 5e-3 without clipping: the settings this task was tuned at; at 1e-2 150 steps answer "odd"
    to every number, with the answer and its end of turn the only tokens trained.  240 steps, not
    150: at 150 the model was still learning the task (held-out loss 0.07, 7 to 9 of the 10 answers
    right in runs on transformers 5.24); at 240 the loss is 0.003 and 200 other numbers are answered
    right too.)"""
    from mobius.train import main

    model = make_tiny_chat_model(tmp_path / "model", hidden=64, layers=2)
    rng = torch.Generator().manual_seed(0)
    numbers = torch.randperm(10_000, generator=rng)[:1010].tolist()
    held_out, train = numbers[:10], numbers[10:]
    with open(tmp_path / "train.jsonl", "w") as f:
        for n in train:
            f.write(json.dumps({"instruction": f"Is {n} even or odd?", "output": "odd" if n % 2 else "even"}) + "\n")
    main(["--model", str(model), "--data", str(tmp_path / "train.jsonl"), "--backend", "single", "--steps", "240",
          "--lr", "5e-3", "--max-grad-norm", "0", "--seq-len", "128", "--micro-batch-size", "8", "--micro-batches", "1", "--no-progress",
          "--export", str(tmp_path / "tuned"), "--eval-split", "0.05", "--eval-every", "80",
          "--metrics", str(tmp_path / "m.jsonl"), "--tensorboard", str(tmp_path / "tb")])
    evals = [json.loads(line)["eval_loss"] for line in open(tmp_path / "m.jsonl")]
    evals = [e for e in evals if e is not None]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert [e.step for e in board.Scalars("eval/loss")] == [80, 160, 240]
    assert len(board.Scalars("train/loss")) == 240
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    for n in held_out:
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Is {n} even or odd?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = tuned.generate(**prompt, max_new_tokens=12, do_sample=False)
        answer = tok.decode(out[0, prompt["input_ids"].shape[1]:])
        assert answer == ("odd" if n % 2 else "even") + "<|im_end|>", (n, answer)
