"""Mobius against TRL's SFTTrainer on the same fine-tune: the same tiny Llama (same initial weights
per seed), the same training records, the same update rule (AdamW 0.9/0.95, weight decay 0.01 on
matrices, warm-up over 10% of the steps, cosine to 10% of the peak rate, the global gradient norm
clipped to 1.0), answers only trained; then both models judged by one evaluator on held-out
records: the mean loss of each answer's tokens, and greedy exact match.

    python scripts/compare_trl.py [--steps 600] [--seeds 0 1 2] [--json compare_trl.json] [--smoke]
    python scripts/compare_trl.py --speed [--steps 60]   # per-example step time, 1 thread, no packing

Mobius trains through its command (``mobius.train``, the single backend) and exports a Hugging
Face directory; TRL trains the model ``transformers`` loads from the same directory.  The records
are ``examples/parity.jsonl`` (is a number even or odd), the last ``--held-out`` of them held out.
Needs ``trl`` (``pip install trl``).  ``--smoke``: 5 steps, one seed, 8 held-out records.

``--speed``: the time of a step's own work per example, both trainers on one thread, without
packing (each batch padded to its longest example, as TRL's collator pads): the median over the
steps after the first five of Mobius's ``step_time_s`` (the step's batch made, forward, backward,
AdamW) and of TRL's ``on_step_begin`` to ``on_step_end`` (the batch already loaded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from make_tiny_chat_model import make_tiny_chat_model  # noqa: E402

from mobius.train import main as mobius_train  # noqa: E402

RECORDS = ROOT / "examples" / "parity.jsonl"
END_OF_TURN = "<|im_end|>"


def settings(steps: int, lr: float, batch: int, seq_len: int) -> dict:
    """The update rule and batch both trainers get."""
    return {"steps": steps, "lr": lr, "batch": batch, "seq_len": seq_len, "betas": (0.9, 0.95), "weight_decay": 0.01,
            "warmup_steps": max(1, steps // 10), "min_lr_ratio": 0.1, "max_grad_norm": 1.0}


def train_mobius(model_dir: Path, data: Path, out: Path, s: dict, seed: int, *extra: str) -> Path:
    mobius_train([*extra, "--model", str(model_dir), "--data", str(data), "--backend", "single",
                  "--steps", str(s["steps"]), "--lr", str(s["lr"]), "--micro-batch-size", str(s["batch"]), "--micro-batches", "1",
                  "--seq-len", str(s["seq_len"]), "--adam-beta1", str(s["betas"][0]), "--adam-beta2",
                  str(s["betas"][1]), "--weight-decay", str(s["weight_decay"]), "--lr-scheduler", "cosine_with_min_lr",
                  "--warmup-steps", str(s["warmup_steps"]), "--min-lr-ratio", str(s["min_lr_ratio"]),
                  "--max-grad-norm", str(s["max_grad_norm"]), "--seed", str(seed), "--precision", "fp32",
                  "--export", str(out), "--no-progress"])
    return out


def train_trl(model_dir: Path, records: list[dict], work: Path, s: dict, seed: int, packing: bool = True,
              callbacks: list | None = None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Prompt-completion conversations: TRL trains the completion (the answer) only, as Mobius does.
    rows = [{"prompt": [{"role": "user", "content": r["instruction"]}],
             "completion": [{"role": "assistant", "content": r["output"]}]} for r in records]
    config = SFTConfig(output_dir=str(work), max_steps=s["steps"], per_device_train_batch_size=s["batch"],
                       learning_rate=s["lr"], adam_beta1=s["betas"][0], adam_beta2=s["betas"][1],
                       weight_decay=s["weight_decay"], warmup_steps=s["warmup_steps"],
                       lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": s["min_lr_ratio"]},
                       max_grad_norm=s["max_grad_norm"], max_length=s["seq_len"], packing=packing, seed=seed,
                       data_seed=seed, report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
                       disable_tqdm=True, dataloader_num_workers=0)
    SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
               callbacks=callbacks).train()
    return model.eval()


@torch.no_grad()
def judge(model, tokenizer, held_out: list[dict]) -> dict:
    """Mean per-token loss of each answer (its text and the end of the turn) after the prompt, and
    the share of greedy answers equal to the record's."""
    losses, right = [], 0
    for r in held_out:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": r["instruction"]}],
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        answer_ids = tokenizer(r["output"] + END_OF_TURN, add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([prompt_ids, answer_ids], dim=1)
        logits = model(ids).logits[0, prompt_ids.shape[1] - 1:-1]
        losses.append(torch.nn.functional.cross_entropy(logits.float(), answer_ids[0]).item())
        out = model.generate(prompt_ids, max_new_tokens=answer_ids.shape[1] + 2, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
                             pad_token_id=tokenizer.pad_token_id)
        said = tokenizer.decode(out[0, prompt_ids.shape[1]:], skip_special_tokens=True).strip()
        right += said == r["output"]
    return {"answer_loss": statistics.fmean(losses), "exact_match": right / len(held_out)}


def step_times(model_dir: Path, data: Path, train: list[dict], tmp: Path, s: dict) -> dict:
    """Per-example step time (ms, median after the first five steps) of each trainer, 1 thread, no packing."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.began = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.began)

    metrics = tmp / "speed.jsonl"
    train_mobius(model_dir, data, tmp / "mobius-speed", s, 0, "--packing", "off", "--metrics", str(metrics))
    ours = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]
    clock = Clock()
    train_trl(model_dir, train, tmp / "trl-speed", s, 0, packing=False, callbacks=[clock])
    per_example = {who: 1e3 * statistics.median(times[5:]) / s["batch"] for who, times in
                   (("mobius", ours), ("trl", clock.times))}
    return {**per_example, "steps": s["steps"], "batch": s["batch"], "seq_len": s["seq_len"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--speed", action="store_true", help="per-example step time on one thread, no packing")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.held_out = 5, [0], 8
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1 if args.speed else max(1, torch.get_num_threads()))
    records = [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]
    train, held_out = records[:-args.held_out], records[-args.held_out:]
    s = settings(args.steps, args.lr, args.batch, args.seq_len)
    if args.speed:
        with tempfile.TemporaryDirectory(prefix="compare-trl-") as tmp:
            tmp = Path(tmp)
            data = tmp / "train.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in train))
            speed = step_times(make_tiny_chat_model(tmp / "base", hidden=64, layers=2, seed=0), data, train, tmp, s)
        print(f"per-example step time, 1 thread, no packing ({s['steps']} steps of {s['batch']} examples, "
              f"median after 5): mobius {speed['mobius']:.2f} ms, trl {speed['trl']:.2f} ms, "
              f"ratio {speed['mobius'] / speed['trl']:.2f}")
        if args.json:
            args.json.write_text(json.dumps(speed, indent=1))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="compare-trl-") as tmp:
        tmp = Path(tmp)
        data = tmp / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in train))
        for seed in args.seeds:
            model_dir = make_tiny_chat_model(tmp / f"base-{seed}", hidden=64, layers=2, seed=seed)
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            tuned = train_mobius(model_dir, data, tmp / f"mobius-{seed}", s, seed)
            ours = judge(AutoModelForCausalLM.from_pretrained(str(tuned), dtype=torch.float32).eval(), tokenizer,
                         held_out)
            theirs = judge(train_trl(model_dir, train, tmp / f"trl-{seed}", s, seed), tokenizer, held_out)
            rows.append({"seed": seed, "mobius": ours, "trl": theirs})
            print(f"seed {seed}: answer loss mobius {ours['answer_loss']:.4g} trl {theirs['answer_loss']:.4g}; "
                  f"exact match mobius {ours['exact_match']:.2f} trl {theirs['exact_match']:.2f}", flush=True)
    summary = {}
    for who in ("mobius", "trl"):
        for what in ("answer_loss", "exact_match"):
            values = [r[who][what] for r in rows]
            summary[f"{who}_{what}"] = {"mean": statistics.fmean(values),
                                        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}
    print(f"\n{'':>8} {'answer loss (mean ± sd)':>26} {'exact match (mean ± sd)':>26}")
    for who in ("mobius", "trl"):
        loss, match = summary[f"{who}_answer_loss"], summary[f"{who}_exact_match"]
        print(f"{who:>8} {loss['mean']:>17.4g} ± {loss['stdev']:.2g} {match['mean']:>17.3f} ± {match['stdev']:.3f}")
    print(f"settings: {s}, {len(train)} training records, {len(held_out)} held out, seeds {args.seeds}")
    if args.json:
        args.json.write_text(json.dumps({"settings": s, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
