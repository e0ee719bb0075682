"""The run's inputs, checked: the model (preset or Hugging Face directory) and the data batches.
Every process of a run (the command, each worker) reads them through here."""

from __future__ import annotations

import dataclasses

from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus, tokenizer_for
from mobius.errors import InputError
from mobius.models import GPTConfig, get_config
from mobius.models.hf import check_weights


def model_config_for(cfg: RunConfig) -> GPTConfig:
    """The model a run trains: ``--model``, with LoRA adapters when ``--lora-rank`` is given."""
    config = get_config(cfg.model)
    if not cfg.lora_rank:
        return config
    return dataclasses.replace(config, lora_rank=cfg.lora_rank, lora_alpha=float(cfg.lora_alpha or cfg.lora_rank),
                               lora_targets=cfg.lora_targets, lora_dropout=cfg.lora_dropout)


def check_model_input(cfg: RunConfig) -> GPTConfig:
    model_config = model_config_for(cfg)
    if cfg.seq_len > model_config.context:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s context of {model_config.context}")
    if model_config.hf_arch and not model_config.checkpoint:
        raise InputError(f"--model {cfg.model} has config.json but no *.safetensors weights: it can be planned "
                         "(python -m mobius.plan) but not trained")
    if not model_config.runnable:
        raise InputError(f"model {cfg.model} can be planned (python -m mobius.plan) but not run: "
                         f"{model_config.shape_problem()}")
    if model_config.checkpoint:
        check_weights(model_config)
    return model_config


def make_batches(cfg: RunConfig, model_config: GPTConfig) -> BatchSource:
    tokenizer = tokenizer_for(cfg.model)
    corpus = load_corpus(cfg.data, tokenizer=tokenizer)
    if model_config.vocab_size < tokenizer.vocab_size and int(corpus.max()) >= model_config.vocab_size:
        raise InputError(f"model {cfg.model} has a vocabulary of {model_config.vocab_size}, but the data has token "
                         f"id {int(corpus.max())} ({type(tokenizer).__name__})")
    return BatchSource(corpus, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batches, cfg.seed)
