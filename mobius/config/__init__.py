"""The run configuration: one typed dataclass, parsed from ``python -m mobius.train``'s command
line (and the ``--config`` file and resumed checkpoint beneath it, :mod:`mobius.config.sources`) and
checked before anything expensive happens."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from mobius.boundary.errors import InputError, shown
from mobius.config.sources import comma_names, layered_argv
from mobius.data.records import FORMATS
from mobius.models.lora import LORA_MODULES
from mobius.models.precision import PRECISIONS
from mobius.models.preference import LOSS_TYPES, PreferenceObjective

BACKENDS = ("auto", "pipeline", "chunked", "single")
# Peak learning rates: our presets train from scratch; a pretrained Hugging Face model is fine-tuned
# at the rates common practice uses (full: 1e-5 to 5e-5; LoRA adapters: 1e-4 to 3e-4).
DEFAULT_LR = {"preset": 1e-3, "full": 2e-5, "lora": 2e-4}
DEFAULT_STEPS = 40  # without --steps or --epochs
# The learning-rate schedules (mobius.runtime.optim.UpdateRule), Hugging Face Trainer's names.
# Learning-rate schedules by their transformers.get_scheduler names, each its lr at every step.
SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")
DEFAULT_MIN_LR_RATIO = 0.1
# The master weights and AdamW's state are fp32: a setting fp32 cannot hold is not the run asked for.
FP32_MAX, FP32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def warmup_steps_of(steps: int, warmup_ratio: float, warmup_steps: int | None, scheduler: str) -> int:
    """Warm-up steps as Hugging Face's Trainer counts them: ``--warmup-steps``, else the ratio of
    the steps rounded up (``TrainingArguments.get_warmup_steps``); none for ``constant``."""
    if scheduler == "constant":
        return 0
    return warmup_steps if warmup_steps is not None else math.ceil(steps * warmup_ratio)
# Hugging Face's Trainer, TRL and axolotl clip at 1.0 by default; our presets train from scratch
# without it (their losses are the suite's references).
DEFAULT_MAX_GRAD_NORM = 1.0


# Where a run's scalars may go besides --metrics (mobius.metrics.reporters), each an optional package.
REPORTERS = ("tensorboard", "wandb", "mlflow")

# No GPU has more memory than this (GB): a larger --gpu-mem-gb is a typo, not a budget.
MAX_DEVICE_MEMORY_GB = 4096


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def setting(default, help: str, **flag):
    """A field of the configuration and its command-line option, defined once: the field's default
    is the option's, ``help`` its help text; ``flag``: what else the option takes (``choices``,
    ``metavar``; ``plans=True``: ``mobius.plan`` takes it too, for it changes the plan;
    ``resolved_when_parsed=True``: its default depends on other settings, resolved when the
    arguments are parsed (:func:`parse_train_args`), and the field holds the one a configuration
    built in code gets).  The flags are generated from these (:func:`add_options`)."""
    return field(default=default, metadata={"help": help, **flag})


def _positive(section, names: tuple[str, ...], options: dict[str, str] | None = None) -> None:
    """Each of ``names`` (attributes of ``section``) is None or positive; ``options`` names the
    command-line option of an attribute spelled otherwise."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            what = "positive" if isinstance(value, int) else "a positive finite number"
            raise InputError(f"{flag_name((options or {}).get(name, name))} must be {what}, got {value}")


@dataclass(frozen=True)
class DataConfig:
    """What the run trains and evaluates on, and how records become sequences."""
    path: str | None = setting(
        None, "records (.jsonl, .json, .parquet, a datasets.save_to_disk directory) or text files, or a directory "
              "of them (default: this Python's stdlib sources)")
    format: str | None = setting(None, "the records' shape (default: detected from their fields)", choices=FORMATS)
    packing: str = setting(
        "auto", "on: examples packed into --seq-len sequences, each attending only to itself; off: one example per "
                "sequence, padded; auto: on for examples, random windows of a text corpus",
        choices=("auto", "on", "off"))
    train_on_prompt: bool = setting(False, "loss on every token of an example, not only on its answers")
    chat_template: str | None = setting(None, "a Jinja chat template file, for a model without one of its own")
    truncate: bool = setting(True, "refuse an example longer than --seq-len instead of cutting it")
    eval_path: str | None = setting(None, "held-out records: loss and perplexity, forward only")
    eval_split: float = setting(0.0, "hold out this fraction of --data's records (drawn by --seed) for evaluation")
    eval_every: int = setting(0, "evaluate every N steps, and at the end (0: at the end only)")
    skip_bad_records: bool = setting(
        False, "leave out records that would be refused (no answer, roles out of order, an empty answer, malformed), "
               "saying how many and the first one's line and reason, instead of stopping")

    def __post_init__(self):
        if not (math.isfinite(self.eval_split) and 0 <= self.eval_split < 1):
            raise InputError(f"--eval-split must be at least 0 and below 1, got {self.eval_split}")
        if self.eval_split and (self.eval_path or not self.path):
            raise InputError("--eval-split holds out part of --data: give --data, and not --eval-data beside it")
        if self.eval_every < 0:
            raise InputError(f"--eval-every must be zero or positive, got {self.eval_every}")
        if self.eval_every and not (self.eval_path or self.eval_split):
            raise InputError("--eval-every needs --eval-data PATH or --eval-split FRACTION")


@dataclass(frozen=True)
class ObjectiveConfig:
    """What the run minimises: next-token cross-entropy on the answers (SFT), or a preference loss
    on pairs of answers (DPO, :mod:`mobius.models.preference`)."""
    name: str = setting(
        "sft", "sft: cross-entropy of the answers' tokens; dpo: prefer each pair's chosen answer over its rejected "
               "one against the initial model (TRL's DPOTrainer; --data of chosen/rejected records)",
        choices=("sft", "dpo"))
    beta: float = setting(0.1, "dpo: how far the model may move from the reference (TRL's beta)")
    label_smoothing: float = setting(
        0.0, "dpo, --loss-type sigmoid: the chance a pair's preference is wrong (conservative DPO)")
    loss_type: str = setting("sigmoid", "dpo: sigmoid (DPO) or ipo (IPO, log-ratios averaged over the answer's "
                                        "tokens)", choices=LOSS_TYPES)

    def __post_init__(self):
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise InputError(f"--beta must be a positive finite number, got {self.beta}")
        if not (math.isfinite(self.label_smoothing) and 0 <= self.label_smoothing < 0.5):
            raise InputError(f"--label-smoothing must be at least 0 and below 0.5, got {self.label_smoothing}")
        if self.name == "sft" and (self.beta, self.label_smoothing, self.loss_type) != (0.1, 0.0, "sigmoid"):
            raise InputError("--beta, --label-smoothing and --loss-type set the preference loss: they need "
                             "--objective dpo")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise InputError(f"--label-smoothing smooths the sigmoid loss; --loss-type {self.loss_type} has none")

    @property
    def preference(self) -> PreferenceObjective | None:
        return PreferenceObjective(self.beta, self.label_smoothing, self.loss_type) if self.name == "dpo" else None


# Sizes past which a batch is refused at once: 2**24 tokens in one micro-batch are over 100 GB of
# activations for the smallest model's blocks; 2**34 a step is days of any box's compute.
MAX_MICRO_BATCH_TOKENS = 2**24
MAX_STEP_TOKENS = 2**34


@dataclass(frozen=True)
class BatchConfig:
    """One optimizer step's tokens: micro_batches x micro_batch_size sequences of seq_len."""
    micro_batch_size: int = setting(4, "sequences per micro-batch", plans=True)
    micro_batches: int = setting(4, "micro-batches per optimizer step", plans=True)
    seq_len: int = setting(128, "tokens per sequence", plans=True)

    def __post_init__(self):
        _positive(self, ("micro_batch_size", "micro_batches", "seq_len"))
        per_micro_batch = self.micro_batch_size * self.seq_len
        if per_micro_batch > MAX_MICRO_BATCH_TOKENS:  # refused here, not by a MemoryError a minute in
            raise InputError(f"--micro-batch-size {self.micro_batch_size} x --seq-len {self.seq_len} = "
                             f"{per_micro_batch:.3g} tokens in one micro-batch: more than any device's memory holds "
                             f"the activations of (at most {MAX_MICRO_BATCH_TOKENS:,})")
        if self.tokens > MAX_STEP_TOKENS:
            raise InputError(f"--micro-batches {self.micro_batches} x {per_micro_batch:,} tokens = {self.tokens:.3g} "
                             f"tokens a step; at most {MAX_STEP_TOKENS:,}")

    @property
    def tokens(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    def describe(self) -> str:
        return f"{self.micro_batches}x{self.micro_batch_size} sequences of {self.seq_len} per step"


@dataclass(frozen=True)
class OptimConfig:
    """How long and how the weights are trained."""
    steps: int = setting(DEFAULT_STEPS, f"total optimizer steps of the run (default: {DEFAULT_STEPS}, or as many as "
                                        "--epochs take)", resolved_when_parsed=True)
    epochs: float | None = setting(None, "instead of --steps: train this many passes over the training sequences")
    lr: float = setting(DEFAULT_LR["preset"], f"peak learning rate (default: {DEFAULT_LR['preset']:g} for a preset, "
                        f"{DEFAULT_LR['full']:g} to fine-tune a Hugging Face model, {DEFAULT_LR['lora']:g} with "
                        "--lora-rank)", resolved_when_parsed=True)
    seed: int = setting(0, "seed of the weights and of the data order")
    precision: str | None = setting(None, "compute precision (default: bf16 on CUDA, fp32 on CPU)",
                                    choices=PRECISIONS, plans=True)
    fp16_accumulation: bool = setting(
        False, "with --precision fp16 on CUDA GPUs: matrix products accumulate in fp16 "
               "(torch.backends.cuda.matmul.allow_fp16_accumulation), twice as fast on GeForce cards' tensor cores "
               "(330 instead of 165 TFLOPS on an RTX 4090; A100, H100 and H200 gain nothing), at the cost of sums "
               "rounded to fp16's 11 bits and overflowing past 65,504 within a product: a choice to make knowingly",
        plans=True)
    optimizer_lag: int = setting(
        0, "1: apply step k's AdamW update while step k+1 computes (its forward uses weights one update old), so the "
           "CPU optimizer leaves the critical path; pipeline and single backends", choices=(0, 1), plans=True)
    # The update rule (mobius.runtime.optim.UpdateRule), with Hugging Face Trainer's names and defaults
    adam_beta1: float = setting(0.9, "AdamW's first-moment decay")
    adam_beta2: float = setting(0.999, "AdamW's second-moment decay")
    adam_eps: float = setting(1e-8, "AdamW's epsilon")
    weight_decay: float = setting(
        0.0, "AdamW's decoupled weight decay, on weight matrices and embeddings (not biases and norms)")
    lr_scheduler: str = setting(
        "linear", "the learning-rate schedule by its transformers.get_scheduler name, its lr at every step: linear or "
                  "cosine decay to 0, cosine_with_min_lr to --min-lr-ratio of --lr, each after the warm-up; "
                  "constant_with_warmup; constant (no warm-up)", choices=SCHEDULERS)
    warmup_ratio: float = setting(0.0, "linear warm-up from 0 over this fraction of --steps, rounded up")
    warmup_steps: int | None = setting(None, "linear warm-up from 0 over this many steps, instead")
    min_lr_ratio: float = setting(
        DEFAULT_MIN_LR_RATIO, "--lr-scheduler cosine_with_min_lr: the learning rate the decay ends at, as a fraction of "
                              "--lr (transformers' min_lr_rate)")
    max_grad_norm: float | None = setting(
        None, "clip the global norm of each step's gradients (over every stage, worker and chunk) to this; 0: no "
              "clipping (default: 1.0 to fine-tune a Hugging Face model, as its peers do; off for a preset)",
        plans=True, resolved_when_parsed=True)

    def __post_init__(self):
        _positive(self, ("steps", "epochs", "lr", "adam_eps"))
        if not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be between 0 and 2**63-1, got {self.seed}")
        for name in ("adam_beta1", "adam_beta2", "warmup_ratio", "min_lr_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1) or (name.startswith("adam") and value == 1):
                raise InputError(f"{flag_name(name)} must be in [0, 1{')' if name.startswith('adam') else ']'}, "
                                 f"got {value}")
        if not (math.isfinite(self.weight_decay) and 0 <= self.weight_decay <= 10):
            raise InputError(f"--weight-decay must be between 0 and 10, got {self.weight_decay}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise InputError(f"--max-grad-norm must be a finite number at least 0 (0: no clipping), "
                             f"got {self.max_grad_norm}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise InputError(f"--warmup-steps must be between 0 and --steps ({self.steps}), got {self.warmup_steps}")
        if self.lr_scheduler not in SCHEDULERS:
            raise InputError(f"--lr-scheduler must be one of {', '.join(SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.lr_scheduler == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise InputError("--lr-scheduler constant has no warm-up; for --warmup-steps or --warmup-ratio use "
                             "--lr-scheduler constant_with_warmup")
        if self.lr_scheduler != "cosine_with_min_lr" and self.min_lr_ratio != DEFAULT_MIN_LR_RATIO:
            raise InputError(f"--min-lr-ratio is where --lr-scheduler cosine_with_min_lr ends; {self.lr_scheduler} "
                             "has no floor")
        if self.lr > FP32_MAX:
            raise InputError(f"--lr {self.lr:g} is beyond what fp32 holds ({FP32_MAX:.3g}): every update would be inf")
        if self.adam_eps < FP32_TINY:
            raise InputError(f"--adam-eps {self.adam_eps:g} is below fp32's smallest normal number ({FP32_TINY:.3g}): "
                             "AdamW's state is fp32, where it divides by as good as 0")
        warmup = warmup_steps_of(self.steps, self.warmup_ratio, self.warmup_steps, self.lr_scheduler)
        if warmup >= self.steps:
            raise InputError(f"a warm-up of {warmup} steps covers the run's {self.steps}: its learning rate never "
                             f"reaches --lr (the first step's is 0); warm up over fewer steps")
        if self.fp16_accumulation and self.precision != "fp16":
            raise InputError(f"--fp16-accumulation accumulates fp16 products in fp16: it needs --precision fp16, "
                             f"not {self.precision or 'the default'}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run's state is saved and what it continues from."""
    save: str | None = setting(None, "checkpoint directory (written every --save-every steps and at the end)")
    save_every: int = setting(0, "save every N steps (0: only at the end or on a stop)")
    resume: str | None = setting(None, "continue from this checkpoint (any backend or topology)")
    resume_with_changes: bool = setting(
        False, "allow --resume with settings that differ from the checkpoint's run (lr, steps, precision, batch "
               "shape, data, ...)")
    stop_after: int | None = setting(
        None, "end this run after K steps with a checkpoint, as a signal would (--steps stays the total)")

    def __post_init__(self):
        _positive(self, ("stop_after",))
        if self.save_every < 0:
            raise InputError(f"--save-every must be zero or positive, got {self.save_every}")
        if self.save_every and not self.save:
            raise InputError("--save-every needs --save DIR")
        if self.resume_with_changes and not self.resume:
            raise InputError("--resume-with-changes needs --resume DIR")


@dataclass(frozen=True)
class OutputConfig:
    """What the run writes beside its checkpoints."""
    metrics: str | None = setting(None, "write per-step metrics to this JSONL file")
    tensorboard: str | None = setting(
        None, "write loss, eval loss, learning rate, tokens/s and step time as TensorBoard events here")
    report_to: tuple[str, ...] = setting(
        (), f"also report the step's scalars to these, comma-separated: {', '.join(REPORTERS)} (offline: wandb unless "
            "WANDB_MODE=online, mlflow in a local store unless MLFLOW_TRACKING_URI is set)")
    report_dir: str | None = setting(None, "where --report-to writes: DIR/tensorboard, DIR/wandb, DIR/mlruns")
    trace: str | None = setting(None, "write a Chrome trace (Perfetto) to this JSON file")
    export: str | None = setting(None, "write the fine-tuned model here as a Hugging Face directory (under LoRA: a "
                                       "PEFT adapter directory)")
    export_merged: str | None = setting(
        None, "LoRA: write the base model with the adapters merged here, as a Hugging Face directory")
    progress: bool = setting(True, "no progress bar")

    def __post_init__(self):
        names = self.report_to
        if any(n not in REPORTERS for n in names) or len(set(names)) != len(names):
            raise InputError(f"--report-to {','.join(names)!r}: give distinct names among {', '.join(REPORTERS)}")
        if names and not self.report_dir:
            raise InputError("--report-to needs --report-dir DIR (where the reports are written)")
        if self.report_dir and not names:
            raise InputError("--report-dir needs --report-to NAMES")
        if "tensorboard" in names and self.tensorboard:
            raise InputError("give --tensorboard DIR or --report-to tensorboard, not both")

    def exports(self) -> list[tuple[str, str, bool]]:
        """(option, directory, merged) of each export the run writes."""
        return [(o, d, merged) for o, d, merged in (("--export", self.export, False),
                                                     ("--export-merged", self.export_merged, True)) if d]


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline backend's own choices (Mobius)."""
    recompute: str = setting("auto", "recompute stage activations in backward (auto: the plan's memory decides)",
                             choices=("auto", "on", "off"), plans=True)
    partitioner: str = setting("mip", "how the model is cut into stages",
                               choices=("mip", "min", "max", "uniform", "balanced"), plans=True)
    stages: int | None = setting(None, "force this many stages (uniform split) instead of the partitioner's choice",
                                 plans=True)
    mapping: str = setting(
        "cross", "place adjacent stages under different root complexes (cross, Mobius §3.3) or GPUs in order",
        choices=("cross", "sequential"), plans=True)
    prefetch: bool = setting(
        True, "load each stage only when the previous one is released (to see what prefetching gains)", plans=True)
    device_optimizer: str = setting(
        "auto", "auto: the stages whose weights, gradients and AdamW state fit in a GPU's spare memory stay there "
                "and are updated there, when the plan says the step is faster for it; off: every stage swaps and is "
                "updated by the host's AdamW", choices=("auto", "off"), plans=True)
    data_parallel: int | None = setting(
        None, "D replicas of the pipeline, each on M/D of the step's micro-batches, gradients summed across them and "
              "the host AdamW sharded across them (ZeRO-1); default: the number of nodes under torchrun, else 1",
        metavar="D", plans=True)
    schedule: str = setting(
        "bound", "bound: each stage on one GPU for the whole step (Mobius); dispatched: each stage's forward and "
                 "backward handed to the GPUs in turn, with partitions of their own (RoundPipe); auto: the one "
                 "whose simulated step is shorter", choices=("bound", "dispatched", "auto"), plans=True)
    replan: str = setting(
        "off", "auto: when the run's first steps show a lane of its plan off by more than 20%%, plan again with the "
               "measured rates and switch plans at a step boundary if the new plan is predicted to save more than "
               "the switch costs (pipeline backend; the training state carries over)", choices=("auto", "off"))

    def __post_init__(self):
        _positive(self, ("stages", "data_parallel"))
        if self.replan not in ("auto", "off"):
            raise InputError(f"--replan must be auto or off, got {self.replan!r}")


@dataclass(frozen=True)
class ChunkedConfig:
    """The chunked backend's own choices (Elixir, PatrickStar)."""
    chunk_size: int | None = setting(None, "chunked backend: elements per chunk (default: searched)")
    rcache_blocks: int | None = setting(None, "chunked backend: rCache blocks (default: searched)")
    offload: str = setting(
        "auto", "chunked backend: keep chunks and their AdamW on the host (on), the device (off), or as searched",
        choices=("auto", "on", "off"))
    prefetch: bool = setting(True, "chunked backend: gather each chunk only when it is needed")

    def __post_init__(self):
        _positive(self, ("chunk_size", "rcache_blocks"))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on frozen base weights; rank 0 trains every weight."""
    rank: int = setting(0, "train LoRA adapters of this rank on frozen base weights (0: full fine-tuning)", plans=True)
    alpha: float | None = setting(None, "LoRA scaling numerator (default: the rank)", plans=True)
    dropout: float = setting(
        0.0, "dropout on the adapters' input in training (masks seeded per step, micro-batch, layer and module: every "
             "backend and every recomputation draws the same)", plans=True)
    targets: tuple[str, ...] = setting(
        LORA_MODULES, "comma-separated projections that get adapters: qkv (q, k, v), proj (attention output), fc (MLP "
                      "in; gate and up), fc_out (MLP out), or PEFT's module names of a Hugging Face model's family "
                      "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc; "
                      "OPT's out_proj, fc1, fc2; Phi-3's qkv_proj, gate_up_proj); a mixture of experts' router "
                      "(router, or gate) and stacked experts (experts_fc, experts_out, or PEFT's target_parameters "
                      "experts.gate_up_proj, experts.down_proj), one adapter per expert", plans=True)
    use_dora: bool = setting(
        False, "DoRA (weight-decomposed LoRA, PEFT's use_dora): each output row's magnitude trains apart from the "
               "adapted direction, whose norm is held constant in backward, as PEFT does", plans=True)
    load_in_4bit: bool = setting(
        False, "QLoRA: hold every block's projections as a frozen 4-bit NF4 base (bitsandbytes' format, blocks of 64, "
               "fp32 scales), dequantized where they compute; --backend single", plans=True)

    def __post_init__(self):
        if self.rank < 0:
            raise InputError(f"--lora-rank must be zero or positive, got {self.rank}")
        if not self.rank:
            default = {f.name: f.default for f in fields(self)}
            changed = [f"--lora-{k}" for k in ("alpha", "dropout", "targets") if getattr(self, k) != default[k]]
            switches = (("--use-dora", self.use_dora), ("--load-in-4bit", self.load_in_4bit))
            changed += [flag for flag, on in switches if on]
            if changed:
                raise InputError(f"{', '.join(changed)} needs --lora-rank R")
            return
        _positive(self, ("alpha",), {"alpha": "lora_alpha"})
        if not 0 <= self.dropout < 1:
            raise InputError(f"--lora-dropout must be at least 0 and below 1, got {self.dropout}")
        # The names themselves are the model's to tell (mobius.models.adapters.lora_targets).


@dataclass(frozen=True)
class EmulationConfig:
    """--emulate: CPU workers stand for the topology's GPUs with emulated links and dilated time."""
    enabled: bool = setting(
        False, "rehearse --topology's GPUs on CPU workers: emulated PCIe links and root complexes, compute as long as "
               "on the GPUs, all time dilated by one factor (pipeline backend; mobius.plan: the plan such a run "
               "makes, each CPU worker budgeting the whole --gpu-mem-gb)", plans=True)
    dilation: float | None = setting(
        None, "--emulate: wall seconds per emulated second, fixed (the same F for every variant of a comparison); "
              "default: chosen from this machine's CPU work for the model", metavar="F")

    def __post_init__(self):
        if self.dilation is not None and not self.enabled:
            raise InputError("--dilation F needs --emulate")
        if self.dilation is not None and not (math.isfinite(self.dilation) and self.dilation >= 1):
            raise InputError(f"--dilation must be a finite number of at least 1, got {self.dilation}")


# Where each command-line option lives: option -> (section, attribute).  The command line, a
# --config file, --print-config and a checkpoint's stored configuration all speak options; the
# code reads sections.
SECTIONS = {"data": DataConfig, "objective": ObjectiveConfig, "batch": BatchConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
            "outputs": OutputConfig, "pipeline": PipelineConfig, "chunked": ChunkedConfig, "lora": LoraConfig,
            "emulation": EmulationConfig}
_RENAMED = {"objective": ("objective", "name"), "data": ("data", "path"), "data_format": ("data", "format"), "eval_data": ("data", "eval_path"),
            "chunk_prefetch": ("chunked", "prefetch"), "emulate": ("emulation", "enabled"),
            "lora_rank": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
            "lora_targets": ("lora", "targets")}
OPTIONS: dict[str, tuple[str, str]] = {
    **{f.name: (section, f.name) for section, kind in SECTIONS.items() for f in fields(kind)
       if (section, f.name) not in _RENAMED.values()},
    **_RENAMED}


@dataclass(frozen=True)
class RunConfig:
    """One run, as the user asked for it: what, where, and a section per concern.  Built once from
    the command line (:func:`parse_train_args`); each section checks its own values, and this class
    the checks that span sections.  Frozen: a resolved setting is a new RunConfig (:meth:`changed`)."""
    topology: str = setting("auto", "auto (probe this machine), a preset name, or a topology JSON file", plans=True)
    backend: str = setting("auto", "auto: chunked on NVLink topologies, else pipeline; single: plain PyTorch "
                                   "reference", choices=BACKENDS)
    model: str = setting("small", "a preset (tiny, small, mobius-3b, gpt2, ...) or a Hugging Face directory (GPT-2, "
                                  "OPT, Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, Phi-3, Gemma 2/3)", plans=True)
    gpu_mem_gb: float | None = setting(
        None, "cap each device's memory (on CPU workers: the budget the runtime enforces)", plans=True)
    host_adam_gbps: float | None = setting(
        None, "memory bandwidth (GB/s) of the host the plan is for, which bounds its AdamW, when that host is not this "
              "one (default: the topology's host.memory_bandwidth_gbps, else an assumed 1e9 parameters/s per GPU)",
        plans=True)
    cpu_workers: int = setting(2, "virtual workers of the CPU topology when no GPU is found", plans=True)
    network: str | None = setting(
        None, "the network between the nodes of --data-parallel replicas: 10gbe, 25gbe, 100gbe, ib-hdr, ib-ndr or a "
              "bandwidth in GB/s (default: the topology's, else 10gbe assumed)", metavar="NAME|GBPS", plans=True)
    offload_dir: tuple[str, ...] = setting(
        (), "keep AdamW's two moments (8 bytes a trained parameter), and where --host-mem-gb needs it the master "
            "and then the stage weights, in files in DIR, on an NVMe drive, between updates, read back ahead of each "
            "update and written after it, overlapped (ZeRO-Infinity's disk tier): for a host with less memory than "
            "the run needs; several directories, one on each drive, stripe the files over the drives; each must be "
            "empty or absent, and the files go when the run ends (pipeline and single backends)",
        metavar="DIR[,DIR...]", plans=True)
    host_mem_gb: float | None = setting(
        None, "with --offload-dir: the host memory the run may use; what does not fit waits on disk, the largest "
              "stages' AdamW moments first, then their master weights, then their weights (default: this machine's "
              "available memory less 10%%, or the topology's host memory; 0: all the disk tier can take)", plans=True)
    drive_gbps: tuple[str, ...] = setting(
        (), "with --offload-dir: the drives the disk tier uses, each one's sequential GB/s, one per directory in "
            "order (default: the topology's drives, else each drive as timed before training; mobius.plan "
            "assumes 3.5 GB/s)",
        metavar="GBPS[,GBPS...]", plans=True)
    data: DataConfig = DataConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    outputs: OutputConfig = OutputConfig()
    pipeline: PipelineConfig = PipelineConfig()
    chunked: ChunkedConfig = ChunkedConfig()
    lora: LoraConfig = LoraConfig()
    emulation: EmulationConfig = EmulationConfig()

    def __post_init__(self):
        _positive(self, ("cpu_workers", "gpu_mem_gb", "host_adam_gbps"))
        if isinstance(self.offload_dir, str):  # one directory, or several as the command line spells them
            object.__setattr__(self, "offload_dir", comma_names(self.offload_dir))
        if len({str(Path(d).absolute()) for d in self.offload_dir}) < len(self.offload_dir):
            raise InputError(f"--offload-dir {','.join(self.offload_dir)!r}: give each directory once")
        if self.host_mem_gb is not None and not (self.host_mem_gb >= 0 and math.isfinite(self.host_mem_gb)):
            raise InputError(f"--host-mem-gb must be a finite number, 0 or more, got {self.host_mem_gb}")
        for text in self.drive_gbps:
            try:
                ok = 0 < float(text) < 1e4
            except ValueError:
                ok = False
            if not ok:
                raise InputError(f"--drive-gbps {','.join(self.drive_gbps)!r}: give each drive's GB/s, a positive "
                                 "number below 10000")
        if (self.host_mem_gb is not None or self.drive_gbps) and not self.offload_dir:
            raise InputError("--host-mem-gb and --drive-gbps plan the disk tier: they need --offload-dir DIR")
        if self.gpu_mem_gb is not None and self.gpu_mem_gb > MAX_DEVICE_MEMORY_GB:
            raise InputError(f"--gpu-mem-gb {self.gpu_mem_gb:g} is more than any device has (at most "
                             f"{MAX_DEVICE_MEMORY_GB} GB)")
        if self.outputs.export_merged and not self.lora.rank:
            raise InputError("--export-merged needs --lora-rank R (without LoRA, --export writes the full model)")
        if self.outputs.export_merged and self.lora.load_in_4bit:
            raise InputError("--export-merged with --load-in-4bit: the base is 4-bit; --export the adapter and merge "
                             "it into the full-precision base")
        if self.emulation.enabled and self.topology == "auto":
            raise InputError("--emulate rehearses the GPUs of --topology PRESET|FILE on CPU workers; "
                             "--topology auto is this machine")
        if self.emulation.enabled and self.topology == "cpu":
            raise InputError("--emulate rehearses a GPU topology (a preset or file); --topology cpu has no GPUs "
                             "to emulate")
        if self.objective.name == "dpo":
            if not self.data.path:
                raise InputError("--objective dpo trains on preference pairs: give --data PATH of chosen/rejected "
                                 "records")
            if self.data.train_on_prompt:
                raise InputError("--train-on-prompt with --objective dpo: a preference is between answers; the "
                                 "prompt carries no loss")
        replicas = self.pipeline.data_parallel or 1
        if self.batch.micro_batches % replicas:
            raise InputError(f"--micro-batches {self.batch.micro_batches} is not divisible by --data-parallel "
                             f"{replicas}: each replica runs an equal share of the step's micro-batches")

    @classmethod
    def of(cls, **options) -> "RunConfig":
        """A configuration from option names (``micro_batch_size=2``, ``lora_rank=8``), the others at
        their defaults; a name that is no option is an error (not a default silently kept)."""
        unknown = sorted(set(options) - set(OPTIONS) - ({f.name for f in fields(cls)} - set(SECTIONS)))
        if unknown:
            raise TypeError(f"RunConfig.of: no option named {', '.join(unknown)}")
        return cls.from_dict(options)

    @classmethod
    def from_dict(cls, options: dict) -> "RunConfig":
        """From a mapping of option names; names that are no option (argparse's own) are ignored."""
        top = {f.name for f in fields(cls)} - set(SECTIONS)
        sections: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in options.items():
            if key in OPTIONS:
                section, attr = OPTIONS[key]
                sections[section][attr] = value
        return cls(**{k: v for k, v in options.items() if k in top},
                   **{name: SECTIONS[name](**values) for name, values in sections.items()})

    def to_dict(self) -> dict:
        """Every option with its value, as the command line names them."""
        top = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SECTIONS}
        return {**top, **{option: self.option(option) for option in OPTIONS}}

    def option(self, name: str):
        """The value of one command-line option (``"lora_rank"``, ``"seq_len"``, ``"model"``)."""
        if name in OPTIONS:
            section, attr = OPTIONS[name]
            return getattr(getattr(self, section), attr)
        return getattr(self, name)

    def changed(self, **options) -> "RunConfig":
        """This configuration with some options given other values (checked again)."""
        return RunConfig.of(**{**self.to_dict(), **options})


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless it is None or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or "") or isinstance(action.default, bool):
            return action.help
        if isinstance(action.default, tuple):  # a list of names, as the command line spells it
            return f"{action.help} (default: {','.join(action.default) or 'none'})"
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {shown(message)} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _options_in_order():
    """(option, field) of every setting, in the order the configuration defines them."""
    by_field = {(section, attr): option for option, (section, attr) in OPTIONS.items()}
    for f in fields(RunConfig):
        if f.name in SECTIONS:
            yield from ((by_field[(f.name, g.name)], g) for g in fields(SECTIONS[f.name]))
        else:
            yield f.name, f


# Field types (as written: this module's annotations are strings) -> the option's value type.
_VALUE_TYPES = {"int": int, "float": float, "str": str, "tuple[str, ...]": comma_names}


def add_options(p: argparse.ArgumentParser, plans_only: bool = False) -> None:
    """The command-line options of the configuration's settings (``plans_only``: those that change
    the plan, ``mobius.plan``'s), generated from the fields (:func:`setting`): a switch is
    ``--name`` (``--no-name`` for one that is on by default)."""
    for option, f in _options_in_order():
        meta = f.metadata
        if plans_only and not meta.get("plans"):
            continue
        kind = f.type.removesuffix(" | None")
        if kind == "bool":
            flag = flag_name(("no_" if f.default else "") + option)
            p.add_argument(flag, dest=option, action="store_false" if f.default else "store_true", help=meta["help"])
            continue
        p.add_argument(flag_name(option), dest=option, type=_VALUE_TYPES[kind], choices=meta.get("choices"),
                       metavar=meta.get("metavar"), help=meta["help"],
                       default=None if meta.get("resolved_when_parsed") else f.default)


def build_train_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m mobius.train",
        description="Fine-tune a language model with the Mobius pipeline (or the reference trainer).",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--config", default=None,
                   help="a YAML file of settings (keys: these options, e.g. lr, micro-batch-size); options given "
                        "here override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration, every default included, as YAML, and exit")
    add_options(p)
    return p


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_paths(cfg: RunConfig) -> None:
    """What the options name must be there: the inputs, the TensorBoard package.  The values were
    checked when ``cfg`` was built; the outputs are checked by the run's pre-flight
    (:func:`mobius.train.check_outputs`)."""
    for option, path in (("--data", cfg.data.path), ("--eval-data", cfg.data.eval_path)):
        if path is not None and not Path(path).exists():
            raise InputError(f"{option} {path}: no such file or directory")
    if cfg.data.chat_template is not None and not Path(cfg.data.chat_template).is_file():
        raise InputError(f"--chat-template {cfg.data.chat_template}: no such file")
    if cfg.outputs.tensorboard is not None and not installed("tensorboard"):
        raise InputError("--tensorboard needs the 'tensorboard' package: pip install tensorboard")
    for name in cfg.outputs.report_to:
        # MLflow's local store is its SQLite database, which needs SQLAlchemy and Alembic
        # (mlflow-skinny leaves them out); a tracking server does not.
        local = name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI")
        for package in (name, "sqlalchemy", "alembic") if local else (name,):
            if not installed(package):
                raise InputError(f"--report-to {name} needs the '{package}' package: "
                                 f"pip install 'mobius-train[{name}]'")


def resolve_max_grad_norm(args: argparse.Namespace) -> None:
    """``--max-grad-norm``'s default: the peers' 1.0 for a Hugging Face model, off for a preset
    (``mobius.train`` and ``mobius.plan`` alike: clipping changes the plan's schedule)."""
    if args.max_grad_norm is None:
        args.max_grad_norm = DEFAULT_MAX_GRAD_NORM if Path(args.model).is_dir() else 0.0


def parse_train_args(argv: list[str] | None = None, checkpoint_settings=None, resolve=None) -> RunConfig:
    """The run's configuration: the resumed checkpoint's (``checkpoint_settings(DIR)``, given by the
    command, which reads checkpoints), then ``--config``'s, then the command line's settings
    (:mod:`mobius.config.sources`), defaults resolved, checked.  ``--print-config`` prints it as
    the run would use it (``resolve(cfg)``: the backend and precision decided, given by the command)."""
    parser = build_train_parser()
    args = parser.parse_args(layered_argv(parser, list(sys.argv[1:] if argv is None else argv),
                                          checkpoint_settings, BACKEND_OPTIONS))
    if args.steps is not None and args.epochs is not None:
        raise InputError("give --steps or --epochs, not both")
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if args.lr is None:
        kind = "lora" if args.lora_rank else "full" if Path(args.model).is_dir() else "preset"
        args.lr = DEFAULT_LR[kind]
    resolve_max_grad_norm(args)
    cfg = RunConfig.from_dict(vars(args))
    check_paths(cfg)
    if args.print_config:
        import contextlib

        import yaml

        with contextlib.redirect_stdout(sys.stderr):  # stdout is the YAML alone: what probing says goes aside
            settings = (resolve(cfg) if resolve else cfg).to_dict()
        shown = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}  # YAML lists
        print(yaml.safe_dump(shown, sort_keys=False), end="")
        raise SystemExit(0)
    return cfg


# The options a backend owns: a resume on another backend inherits none of them.
BACKEND_OPTIONS = tuple(option for option, (section, _) in OPTIONS.items()
                        if section in ("pipeline", "chunked", "emulation"))
