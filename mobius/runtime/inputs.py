"""The run's inputs, checked: the model (preset or Hugging Face directory) and the data batches.
Every process of a run (the command, each worker) reads them through here."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mobius.config import RunConfig
from mobius.data import BatchSource, ExampleBatches, load_corpus, pack, read_examples, tokenizer_for
from mobius.data.corpus import corpus_of
from mobius.data.examples import renderer_for
from mobius.data.packing import EvalBatches
from mobius.data.records import Record
from mobius.data.shared import open_shared
from mobius.errors import InputError
from mobius.models import GPTConfig, get_config
from mobius.models.hf import check_weights
from mobius.models.lora import LORA_MODULES, parts


def model_config_for(cfg: RunConfig) -> GPTConfig:
    """The model a run trains: ``--model``, with LoRA adapters when ``--lora-rank`` is given."""
    config = get_config(cfg.model)
    if not cfg.lora.rank:
        return config
    targets = set(cfg.lora.targets.split(","))  # a set: the order they were named in changes nothing
    return dataclasses.replace(config, lora_rank=cfg.lora.rank, lora_alpha=float(cfg.lora.alpha or cfg.lora.rank),
                               lora_targets=",".join(t for t in LORA_MODULES if t in targets),
                               lora_dropout=cfg.lora.dropout)


def check_seq_len(cfg: RunConfig, model_config: GPTConfig) -> None:
    if cfg.batch.seq_len > model_config.context:
        raise InputError(f"--seq-len {cfg.batch.seq_len} exceeds {cfg.model}'s context of {model_config.context}")


def check_model_input(cfg: RunConfig) -> GPTConfig:
    model_config = model_config_for(cfg)
    if cfg.lora.rank:
        for module in model_config.lora_targets.split(","):
            width = min(parts(model_config, module) + [model_config.hidden])
            if cfg.lora.rank > width:
                raise InputError(f"--lora-rank {cfg.lora.rank} exceeds the {width} of {cfg.model}'s smallest "
                                 f"'{module}' projection: a rank above it adds nothing but cost")
    check_seq_len(cfg, model_config)
    if model_config.hf_arch and not model_config.checkpoint:
        raise InputError(f"--model {cfg.model} has config.json but no *.safetensors weights: it can be planned "
                         "(python -m mobius.plan) but not trained")
    if not model_config.runnable:
        raise InputError(f"model {cfg.model} can be planned (python -m mobius.plan) but not run: "
                         f"{model_config.shape_problem()}")
    if model_config.checkpoint:
        check_weights(model_config)
    return model_config


def _records(cfg: RunConfig) -> tuple[list[Record], list[Record], str]:
    """The run's training and held-out records (``--eval-data``, or ``--eval-split`` of ``--data``
    by a seeded draw) and their format."""
    records, fmt = read_examples(cfg.data.path, cfg.data.format)
    if cfg.data.eval_path:
        held_out, eval_fmt = read_examples(cfg.data.eval_path, cfg.data.format, option="--eval-data")
        if eval_fmt != fmt:
            raise InputError(f"--eval-data {cfg.data.eval_path} holds {eval_fmt} records, "
                             f"--data {cfg.data.path} {fmt} records")
        return records, held_out, fmt
    if not cfg.data.eval_split:
        return records, [], fmt
    n_eval = math.ceil(cfg.data.eval_split * len(records))
    if n_eval >= len(records):
        raise InputError(f"--eval-split {cfg.data.eval_split} of {len(records)} records leaves none to train on")
    order = np.random.default_rng([cfg.optim.seed, 0xe7a1]).permutation(len(records))
    held = set(order[:n_eval].tolist())
    return ([r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)], fmt)


def make_data(cfg: RunConfig, model_config: GPTConfig) -> tuple[BatchSource | ExampleBatches, EvalBatches | None]:
    """The run's training batches (random windows of a text corpus, or packed or padded examples)
    and its held-out examples (``--eval-data`` or ``--eval-split``, else None), from one reading
    of the data and one tokenizer and template."""
    tokenizer = tokenizer_for(cfg.model)
    if cfg.data.path is None:
        corpus = load_corpus(None, tokenizer=tokenizer)
        _check_vocabulary(cfg, model_config, int(corpus.max()), tokenizer.name)
        return _windows(cfg, corpus, tokenizer.name), None
    records, held_out, fmt = _records(cfg)
    renderer = None
    if fmt == "text" and cfg.data.packing == "auto":  # a corpus: random windows, as in pre-training
        corpus = corpus_of([r.prompt for r in records], tokenizer, cfg.data.path)
        _check_vocabulary(cfg, model_config, int(corpus.max()), tokenizer.name)
        train = _windows(cfg, corpus, tokenizer.name)
    else:
        renderer = renderer_for(cfg.model, cfg.data.chat_template, cfg.data.train_on_prompt)
        packed, describe = _packed(cfg, model_config, records, fmt, tokenizer, renderer)
        train = ExampleBatches(packed, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.optim.seed,
                               cfg.data.packing != "off", describe)
    if not (cfg.data.eval_path or cfg.data.eval_split):
        return train, None
    renderer = renderer or renderer_for(cfg.model, cfg.data.chat_template, cfg.data.train_on_prompt)
    packed, describe = _packed(cfg, model_config, held_out, fmt, tokenizer, renderer)
    return train, EvalBatches(packed, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.data.packing != "off",
                              describe)


def _windows(cfg: RunConfig, corpus, tokenizer_name: str) -> BatchSource:
    """Random windows of a text corpus (pre-training style)."""
    b = cfg.batch
    return BatchSource(corpus, b.seq_len, b.micro_batch_size, b.micro_batches, cfg.optim.seed, tokenizer_name)


def worker_data(cfg: RunConfig, model_config: GPTConfig, shared: dict | None
                ) -> tuple[BatchSource | ExampleBatches, EvalBatches | None]:
    """A worker's data: what the launching process made and shared (:mod:`mobius.data.shared`),
    memory-mapped; read and tokenized here only when nothing was shared (a worker under torchrun)."""
    return open_shared(shared) if shared is not None else make_data(cfg, model_config)


def make_batches(cfg: RunConfig, model_config: GPTConfig) -> BatchSource | ExampleBatches:
    """The run's training batches (:func:`make_data`)."""
    return make_data(cfg, model_config)[0]


def make_eval_batches(cfg: RunConfig, model_config: GPTConfig) -> EvalBatches | None:
    """The run's held-out examples, or None (:func:`make_data`)."""
    return make_data(cfg, model_config)[1]


def _packed(cfg: RunConfig, model_config: GPTConfig, records: list[Record], fmt: str, tokenizer, renderer):
    """Examples rendered with the model's template and packed (or padded) into sequences."""
    packing = cfg.data.packing != "off"
    packed = pack([renderer.render(r) for r in records], cfg.batch.seq_len, packing, cfg.optim.seed, cfg.data.truncate)
    _check_vocabulary(cfg, model_config, int(packed.tokens.max()), tokenizer.name)
    trained = int((packed.targets >= 0).sum())
    describe = (f"{packed.examples:,} {fmt} examples ({trained:,} trained tokens) "
                f"{'packed into' if packing else 'padded to'} {packed.tokens.shape[0]:,} sequences"
                + (f", {packed.truncated} truncated to --seq-len" if packed.truncated else "")
                + f"; tokenizer {tokenizer.name}, chat template {renderer.template_source}")
    return packed, describe


def _check_vocabulary(cfg: RunConfig, model_config: GPTConfig, largest: int, tokenizer: str) -> None:
    if largest >= model_config.vocab_size:
        raise InputError(f"model {cfg.model} has a vocabulary of {model_config.vocab_size}, but the data has token "
                         f"id {largest} ({tokenizer})")
