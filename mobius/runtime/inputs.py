"""The run's inputs, checked: the model (preset or Hugging Face directory) and the data batches.
Every process of a run (the command, each worker) reads them through here."""

from __future__ import annotations

import dataclasses

from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.data import BatchSource, ExampleBatches
from mobius.data.build import build_batches
from mobius.data.packing import EvalBatches
from mobius.data.shared import open_shared
from mobius.models import GPTConfig, get_config
from mobius.models.hf import check_weights
from mobius.models.adapters import lora_targets
from mobius.models.lora import MOE_TARGETS, adapted_parts, parts


def model_config_for(cfg: RunConfig) -> GPTConfig:
    """The model a run trains: ``--model``, with LoRA adapters when ``--lora-rank`` is given."""
    config = get_config(cfg.model)
    if not cfg.lora.rank:
        return config
    return dataclasses.replace(config, lora_rank=cfg.lora.rank, lora_alpha=float(cfg.lora.alpha or cfg.lora.rank),
                               lora_targets=lora_targets(config, cfg.lora.targets),
                               lora_dropout=cfg.lora.dropout, lora_dora=cfg.lora.use_dora,
                               lora_4bit=cfg.lora.load_in_4bit)


def check_seq_len(cfg: RunConfig, model_config: GPTConfig) -> None:
    if cfg.batch.seq_len > model_config.context:
        raise InputError(f"--seq-len {cfg.batch.seq_len} exceeds {cfg.model}'s context of {model_config.context}")


def check_model_input(cfg: RunConfig) -> GPTConfig:
    model_config = model_config_for(cfg)
    if cfg.lora.rank:
        for module in adapted_parts(model_config):
            width = min(parts(model_config, module) + [model_config.hidden]
                        + ([model_config.expert_ffn] if module == "experts_out" else []))
            if cfg.lora.rank > width:
                raise InputError(f"--lora-rank {cfg.lora.rank} exceeds the {width} of {cfg.model}'s smallest "
                                 f"'{module}' projection: a rank above it adds nothing but cost")
        routed = [m for m in adapted_parts(model_config) if m in MOE_TARGETS]
        refused = [flag for flag, on in (("--lora-dropout", cfg.lora.dropout), ("--use-dora", cfg.lora.use_dora),
                                         ("--load-in-4bit", cfg.lora.load_in_4bit)) if on]
        if routed and refused:
            raise InputError(f"--lora-targets {','.join(routed)}: adapters on a mixture's router and experts take "
                             f"no {refused[0]} (as PEFT's target_parameters)")
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


def make_data(cfg: RunConfig, model_config: GPTConfig) -> tuple[BatchSource | ExampleBatches, EvalBatches | None]:
    """The run's training batches and held-out examples (:func:`mobius.data.build.build_batches`)."""
    return build_batches(cfg.data, cfg.batch, cfg.optim.seed, cfg.model, model_config.vocab_size,
                         cfg.objective.preference)


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
