"""Preference tuning (DPO, IPO): our runs against TRL's ``DPOTrainer`` on the same pairs in the same
order, and the pieces that make them: the records, the pairs' rows, the loss's gradient."""

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import one_line_exit_2  # noqa: E402
from make_tiny_chat_model import make_tiny_chat_model  # noqa: E402

from mobius.boundary.errors import InputError  # noqa: E402
from mobius.config import RunConfig  # noqa: E402
from mobius.data.records import to_record  # noqa: E402
from mobius.models.preference import PreferenceObjective, SideLogProbs, preference_losses  # noqa: E402
from mobius.reference import ReferenceTrainer  # noqa: E402
from mobius.runtime.inputs import make_batches, model_config_for  # noqa: E402

NAMES = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def conversational_pairs(n: int) -> list[dict]:
    """Conversations whose last turn is the preference; the prompt implicit (the turns both share)."""
    out = []
    for i in range(n):
        w = NAMES[i % len(NAMES)]
        user = [{"role": "user", "content": f"spell {w}{' backwards' if i % 2 else ''}"}]
        good, bad = (w[::-1], w) if i % 2 else (w, w[::-1])
        out.append({"chosen": user + [{"role": "assistant", "content": good}],
                    "rejected": user + [{"role": "assistant", "content": bad + " " * (i % 3) + "?"}]})
    return out


def text_pairs(n: int) -> list[dict]:
    return [{"prompt": f"{i} + {i % 5} =", "chosen": f" {i + i % 5}", "rejected": f" {i + i % 5 + 1 + i % 3}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    model = make_tiny_chat_model(root / "model", hidden=32, layers=2)
    files = {}
    for name, records in (("chat", conversational_pairs(24)), ("text", text_pairs(24))):
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"model": str(model), **{k: str(v) for k, v in files.items()}, "root": root}


def config(setup, data="chat", **kw) -> RunConfig:
    base = dict(model=setup["model"], data=setup[data], objective="dpo", steps=20, seq_len=96, micro_batch_size=2,
                micro_batches=2, lr=2e-3, lr_scheduler="constant", max_grad_norm=1.0, precision="fp32",
                progress=False, topology="cpu", backend="single")
    return RunConfig.of(**{**base, **kw})


def ours(cfg: RunConfig):
    model_config = model_config_for(cfg)
    trainer = ReferenceTrainer(cfg, model_config, make_batches(cfg, model_config), torch.device("cpu"))
    return [trainer.step(k) for k in range(cfg.optim.steps)], trainer


def trl_history(cfg: RunConfig, records: list[dict], out_dir) -> list[dict]:
    """TRL's DPOTrainer on the pairs our run trains, in its order (each step's pairs, in its
    micro-batches), with the reference precomputed, the same optimizer settings and schedule."""
    trl = pytest.importorskip("trl")
    from torch.utils.data import SequentialSampler

    batches = make_batches(cfg, model_config_for(cfg))
    order = [int(r) for k in range(cfg.optim.steps) for r in batches.step_sequences(k)]
    dataset = __import__("datasets").Dataset.from_list([records[r] for r in order])

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    if cfg.lora.rank:  # PEFT's adapters starting from ours (B = 0: the reference is the base, adapters off)
        from test_lora import initial_adapters, peft_model

        model = peft_model(cfg.model, cfg, initial_adapters(cfg))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model)
    o = cfg.objective
    args = trl.DPOConfig(output_dir=str(out_dir), per_device_train_batch_size=cfg.batch.micro_batch_size,
                         gradient_accumulation_steps=cfg.batch.micro_batches, max_steps=cfg.optim.steps,
                         learning_rate=cfg.optim.lr, lr_scheduler_type="constant", max_grad_norm=cfg.optim.max_grad_norm,
                         weight_decay=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                         beta=o.beta, loss_type=[o.loss_type], precompute_ref_log_probs=True, max_length=None,
                         dataloader_drop_last=False, seed=cfg.optim.seed, disable_tqdm=True,
                         bf16=False)  # TRL computes in bf16 by default; our run is fp32
    trainer = InOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("data,loss_type,lora", [("chat", "sigmoid", 0), ("chat", "ipo", 0), ("text", "sigmoid", 0),
                                                 ("chat", "sigmoid", 4)])
def test_equal_to_trl_dpo_trainer(setup, tmp_path, data, loss_type, lora):
    """Per-step loss equal to TRL's over 20 steps (1e-5), its reward accuracy and its other metrics;
    with LoRA, TRL's reference is the base with the adapters off, ours the initial weights.  At a
    learning rate of 2e-3 the two runs agree within 2e-7 at every step; at 5e-3 a step whose norm
    spikes to 7 amplifies their kernels' rounding past 1e-4 by step 17, on some CPUs and not others."""
    cfg = config(setup, data, loss_type=loss_type, lora_rank=lora)
    records = [json.loads(line) for line in open(setup[data])]
    history, _ = ours(cfg)
    theirs = trl_history(cfg, records, tmp_path)
    assert len(theirs) == len(history) == 20
    for m, t in zip(history, theirs):
        assert m.loss == pytest.approx(t["loss"], rel=0, abs=1e-5)
        assert m.preference["rewards/accuracies"] == pytest.approx(t["rewards/accuracies"], abs=1e-4)
        for name in ("rewards/margins", "logps/chosen", "logps/rejected"):
            assert m.preference[name] == pytest.approx(t[name], rel=1e-3, abs=1e-5), name
    assert history[-1].loss < history[0].loss  # it learned something


def test_the_first_step_is_log_2_and_the_rewards_start_at_zero(setup):
    """With the policy equal to its reference, every pair's loss is log 2 (sigmoid) and every
    reward 0: the reference pass ran on the same weights and rows."""
    history, trainer = ours(config(setup, steps=1))
    assert history[0].loss == pytest.approx(np.log(2), abs=1e-6)
    assert history[0].preference["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert trainer.batches.reference is not None


def test_side_log_probs_gradient_equals_autograd():
    """The chunked log-probabilities' backward (logits recomputed) equals plain autograd's, soft cap included."""
    torch.manual_seed(0)
    h = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,))
    sides = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3])
    for cap in (None, 2.0):
        out = SideLogProbs.apply(h, w, targets, sides, 4, 3, cap)
        weights = torch.randn(4, dtype=torch.float64)
        gh, gw = torch.autograd.grad((out * weights).sum(), (h, w))
        logits = h @ w.t()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        token = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        expected = torch.zeros(4, dtype=torch.float64).index_add(0, sides, token)
        eh, ew = torch.autograd.grad((expected * weights).sum(), (h, w))
        assert torch.allclose(out.double(), expected, atol=1e-6)
        assert torch.allclose(gh, eh, atol=1e-10) and torch.allclose(gw, ew, atol=1e-10)


def test_losses_and_metrics_by_hand():
    logps = torch.tensor([[-3.0, -5.0], [-4.0, -2.0]])
    reference = torch.tensor([[-4.0, -4.0], [-4.0, -4.0]])
    tokens = torch.tensor([[2.0, 4.0], [1.0, 1.0]])
    beta = 0.5
    losses, sums = preference_losses(logps, reference, tokens, PreferenceObjective(beta, 0.0, "sigmoid"))
    delta = torch.tensor([1.0 - (-1.0), 0.0 - 2.0])
    assert torch.allclose(losses, -torch.nn.functional.logsigmoid(beta * delta))
    assert sums.tolist() == pytest.approx([beta * 1 + 0, beta * -1 + beta * 2, 1.0, beta * 2 + beta * -2, -7.0, -7.0])
    smoothed, _ = preference_losses(logps, reference, tokens, PreferenceObjective(beta, 0.2, "sigmoid"))
    F = torch.nn.functional
    assert torch.allclose(smoothed, -0.8 * F.logsigmoid(beta * delta) - 0.2 * F.logsigmoid(-beta * delta))
    ipo, _ = preference_losses(logps, reference, tokens, PreferenceObjective(beta, 0.0, "ipo"))
    per_token = torch.tensor([1.0 / 2 - (-1.0) / 4, 0.0 - 2.0 / 1])
    assert torch.allclose(ipo, (per_token - 1 / (2 * beta)) ** 2)


@pytest.mark.parametrize("record,match", [
    ({"chosen": "a", "rejected": "a", "prompt": "p"}, "same answer"),
    ({"chosen": " ", "rejected": "b", "prompt": "p"}, "empty answer"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": "b"}, "all be text or all lists"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}],
      "prompt": [{"role": "user", "content": "p"}]}, "assistant's answer"),
])
def test_bad_pairs_are_refused_naming_where(record, match):
    with pytest.raises(InputError, match=match) as err:
        to_record(record, None, "--data f.jsonl line 3")
    assert str(err.value).startswith("--data f.jsonl line 3")


def test_an_implicit_prompt_is_what_both_answers_share():
    pair, fmt = to_record({"chosen": "The sky is blue", "rejected": "The sky is green"}, None, "x")
    assert fmt == "preference" and (pair.prompt, pair.chosen, pair.rejected) == ("The sky is", " blue", " green")


def test_rows_hold_whole_pairs_with_prompts_untrained(setup):
    """Each row holds a pair's two sides as two examples; only the answers are trained; a
    micro-batch's sides number its pairs."""
    cfg = config(setup, packing="on", micro_batch_size=1, seq_len=320)
    batches = make_batches(cfg, model_config_for(cfg))
    fullest = int(np.argmax(batches.row_pairs))
    layout = batches._micro_batches(np.array([fullest]), int(batches.row_pairs[fullest]))[0].layout
    segments, sides = layout.segments[0], layout.pairs.sides[0]
    used = segments >= 0
    assert int(segments.max()) % 2 == 1 and layout.pairs.pairs == (int(segments.max()) + 1) // 2 >= 2
    assert torch.equal(sides[used], segments[used])  # one row: the pair's sides are its segments
    trained = layout.targets[0] >= 0
    for e in range(int(segments.max()) + 1):
        t = trained[segments == e]
        assert t.any() and not t[0]  # every side trains its answer, never its prompt's first token


def test_dpo_refusals_are_one_line(setup, capsys):
    from mobius.train import main as train

    argv = ["--model", setup["model"], "--data", setup["chat"], "--steps", "1", "--backend", "single"]
    assert "--objective dpo" in one_line_exit_2(train, argv, capsys)
    assert "--objective dpo" in one_line_exit_2(train, ["--model", setup["model"], "--beta", "0.2"], capsys)
    assert "--beta must be" in one_line_exit_2(train, argv + ["--objective", "dpo", "--beta", "0"], capsys)
    assert "--label-smoothing" in one_line_exit_2(
        train, argv + ["--objective", "dpo", "--loss-type", "ipo", "--label-smoothing", "0.1"], capsys)


@pytest.mark.slow
def test_pipeline_and_chunked_equal_single(setup):
    """The workers as processes, each deriving its pairs and the reference pass's share: the bound
    pipeline on 4 CPU workers (with LoRA on 2), the dispatched schedule on 2 and 4 and the chunked
    engine on 2 equal the single backend's losses, metrics and evaluations (1e-5)."""
    from mobius.backends import resolve
    from mobius.backends.chunked import launch_chunked
    from mobius.backends.pipeline import launch_pipeline
    from mobius.models import get_config
    from mobius.runtime.inputs import make_data
    from topology import cpu_topology

    cfg = config(setup, steps=4, micro_batches=4, packing="on", seq_len=160, eval_split=0.25, eval_every=2)
    for launch, changes in ((launch_pipeline, {"backend": "pipeline", "cpu_workers": 4, "stages": 4}),
                            (launch_pipeline, {"backend": "pipeline", "cpu_workers": 2, "lora_rank": 4}),
                            (launch_pipeline, {"backend": "pipeline", "cpu_workers": 2, "schedule": "dispatched"}),
                            (launch_pipeline, {"backend": "pipeline", "cpu_workers": 4, "schedule": "dispatched"}),
                            (launch_chunked, {"backend": "chunked", "cpu_workers": 2})):
        run_cfg = RunConfig.from_dict({**cfg.to_dict(), **changes})
        want = single_history(run_cfg.changed(backend="single"))
        workers = run_cfg.cpu_workers
        history = launch(resolve(run_cfg, cpu_topology(workers), run_cfg.backend), get_config(cfg.model),
                         data=make_data(run_cfg, model_config_for(run_cfg)))
        assert [m.eval_loss is not None for m in history] == [False, True, False, True]
        for m, w in zip(history, want, strict=True):
            assert m.loss == pytest.approx(w.loss, rel=1e-5), changes
            for name, value in w.preference.items():
                assert m.preference[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (changes, name)
            if w.eval_loss is not None:
                assert m.eval_loss == pytest.approx(w.eval_loss, rel=1e-5), changes
                for name, value in w.eval_preference.items():
                    assert m.eval_preference[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (changes, name)


def single_history(cfg: RunConfig):
    """``--backend single``'s metrics of every step (with its evaluations), as the command runs it."""
    from mobius.backends import resolve
    from mobius.backends.single import train_single
    from mobius.runtime.inputs import make_data

    return train_single(resolve(cfg, backend="single"), model_config_for(cfg), make_data(cfg, model_config_for(cfg)))


@pytest.mark.slow
def test_a_learnable_preference_is_learned_on_held_out_pairs(tmp_path):
    """Numbers whose parity the chosen answer states and the rejected one denies: after 40 steps
    the held-out pairs (numbers never trained on) prefer the right answer at least 9 times in 10."""
    import random

    r = random.Random(0)
    records = []
    for _ in range(400):
        n = r.randrange(1000)
        good, bad = ("even", "odd") if n % 2 == 0 else ("odd", "even")
        records.append({"prompt": [{"role": "user", "content": f"is {n} even or odd?"}],
                        "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}]})
    (tmp_path / "parity.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    model = make_tiny_chat_model(tmp_path / "model", hidden=64, layers=2)
    cfg = RunConfig.of(model=str(model), data=str(tmp_path / "parity.jsonl"), objective="dpo", steps=40, seq_len=80,
                       micro_batch_size=8, micro_batches=2, lr=5e-3, lr_scheduler="constant", max_grad_norm=1.0,
                       precision="fp32", progress=False,
                       topology="cpu", backend="single", eval_split=0.2)
    final = single_history(cfg)[-1]
    assert final.eval_preference["rewards/accuracies"] >= 0.9
    assert final.eval_loss < 0.6  # below log 2, where it started


def test_a_resume_reads_the_reference_the_checkpoint_kept(setup, tmp_path, monkeypatch, capsys):
    """A preference run's checkpoint keeps its reference tables: the resumed run reads them (its
    reference pass does not run again) and continues as the straight run; a table of other rows
    (the same checkpoint resumed on changed data) is computed again, never used."""
    from mobius.data.preference import PreferenceBatches
    from mobius.train import main as train_main

    args = ["--model", setup["model"], "--data", setup["chat"], "--objective", "dpo", "--steps", "4", "--seq-len",
            "96", "--micro-batch-size", "2", "--micro-batches", "2", "--lr", "5e-3", "--backend", "single",
            "--no-progress", "--eval-split", "0.25"]
    train_main(args + ["--metrics", str(tmp_path / "straight.jsonl")])
    train_main(args + ["--save", str(tmp_path / "ck"), "--stop-after", "2"])
    passes = []
    real = PreferenceBatches.reference_passes
    monkeypatch.setattr(PreferenceBatches, "reference_passes", lambda self: passes.append(1) or real(self))
    capsys.readouterr()
    train_main(args + ["--resume", str(tmp_path / "ck"), "--metrics", str(tmp_path / "resumed.jsonl")])
    assert passes == []  # both tables (training and held-out pairs) read from the checkpoint
    assert ("reference log-probabilities: of the training pairs kept by the checkpoint, not computed again; of the "
            "held-out pairs kept by the checkpoint, not computed again") in capsys.readouterr().out

    def losses(name):
        return [json.loads(line)["loss"] for line in open(tmp_path / name)]
    assert losses("resumed.jsonl") == losses("straight.jsonl")[2:]
    other = tmp_path / "other.jsonl"  # the same records, one answer changed: other rows
    records = [json.loads(line) for line in open(setup["chat"])]
    records[0]["rejected"][-1]["content"] += " no"
    other.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    train_main(args[:2] + ["--data", str(other)] + args[4:] + ["--resume", str(tmp_path / "ck"),
                                                               "--resume-with-changes"])
    assert len(passes) == 1  # the table of the pairs whose rows changed computed again; the other's still read
    assert capsys.readouterr().out.count("computed again (the checkpoint keeps no table of these rows)") == 1


@pytest.mark.parametrize("record,said", [
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same answer"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is an empty answer"),
    ({"prompt": "p", "chosen": "a"}, "is of no known shape; accepted: text; "),  # a missing side: no shape
])
def test_a_bad_pair_in_a_file_is_one_line_naming_its_line(setup, tmp_path, capsys, record, said):
    """A bad pair on line 3 of the data: one line naming the file and the line, exit 2, nothing written."""
    from mobius.train import main as train_main

    good = text_pairs(4)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good[:2] + [record] + good[2:]))
    message = one_line_exit_2(train_main, ["--model", setup["model"], "--data", str(data), "--objective", "dpo",
                                           "--backend", "single", "--steps", "1", "--metrics",
                                           str(tmp_path / "m.jsonl")], capsys)
    assert f"{data} line 3" in message and said in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]
