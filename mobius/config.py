"""The run configuration: one typed dataclass, parsed from ``python -m mobius.train``'s command
line (and the ``--config`` file and resumed checkpoint beneath it, :mod:`mobius.config_sources`) and
checked before anything expensive happens."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from mobius.config_sources import comma_names, layered_argv
from mobius.data.records import FORMATS
from mobius.errors import InputError, shown
from mobius.models.lora import LORA_MODULES
from mobius.models.precision import PRECISIONS

BACKENDS = ("auto", "pipeline", "chunked", "single")
# Peak learning rates: our presets train from scratch; a pretrained Hugging Face model is fine-tuned
# at the rates common practice uses (full: 1e-5 to 5e-5; LoRA adapters: 1e-4 to 3e-4).
DEFAULT_LR = {"preset": 1e-3, "full": 2e-5, "lora": 2e-4}
# The learning-rate schedules (mobius.runtime.optim.UpdateRule), Hugging Face Trainer's names.
SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")
# Hugging Face's Trainer, TRL and axolotl clip at 1.0 by default; our presets train from scratch
# without it (their losses are the suite's references).
DEFAULT_MAX_GRAD_NORM = 1.0


# The projections LoRA can adapt: q|k|v, attention output, MLP in, MLP out.
LORA_TARGETS = LORA_MODULES


# Where a run's scalars may go besides --metrics (mobius.reporting), each an optional package.
REPORTERS = ("tensorboard", "wandb", "mlflow")

# No GPU has more memory than this (GB): a larger --gpu-mem-gb is a typo, not a budget.
MAX_DEVICE_MEMORY_GB = 4096


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


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
    path: str | None = None  # --data; None: this Python's stdlib sources
    format: str | None = None  # --data-format; None: detected from the records' fields
    packing: str = "auto"  # auto (on for examples, text windows for a corpus) | on | off
    train_on_prompt: bool = False  # examples: loss on every token, not only on the answers
    chat_template: str | None = None  # a Jinja file for a model without a chat template of its own
    truncate: bool = True  # an example longer than --seq-len is cut (False: refused)
    eval_path: str | None = None  # --eval-data: held-out records
    eval_split: float = 0.0  # or this fraction of --data's records, drawn by the seed
    eval_every: int = 0  # evaluate every N steps (and at the end); 0: at the end only
    skip_bad_records: bool = False  # leave out a record that is refused (and say how many), instead of stopping

    def __post_init__(self):
        if not (math.isfinite(self.eval_split) and 0 <= self.eval_split < 1):
            raise InputError(f"--eval-split must be at least 0 and below 1, got {self.eval_split}")
        if self.eval_split and (self.eval_path or not self.path):
            raise InputError("--eval-split holds out part of --data: give --data, and not --eval-data beside it")
        if self.eval_every < 0:
            raise InputError(f"--eval-every must be zero or positive, got {self.eval_every}")
        if self.eval_every and not (self.eval_path or self.eval_split):
            raise InputError("--eval-every needs --eval-data PATH or --eval-split FRACTION")


# Sizes past which a batch is refused at once: 2**24 tokens in one micro-batch are over 100 GB of
# activations for the smallest model's blocks; 2**34 a step is days of any box's compute.
MAX_MICRO_BATCH_TOKENS = 2**24
MAX_STEP_TOKENS = 2**34


@dataclass(frozen=True)
class BatchConfig:
    """One optimizer step's tokens: micro_batches x micro_batch_size sequences of seq_len."""
    micro_batch_size: int = 4
    micro_batches: int = 4
    seq_len: int = 128

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
    steps: int = 40
    epochs: float | None = None  # instead of --steps: passes over the training sequences
    lr: float = DEFAULT_LR["preset"]
    seed: int = 0
    precision: str | None = None  # None: bf16 on CUDA, fp32 on CPU
    optimizer_lag: int = 0  # 1: step k's update is applied while step k+1 computes (pipeline, single)
    # The update rule (mobius.runtime.optim.UpdateRule), with Hugging Face Trainer's names
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.01  # on matrices, not on biases and norms
    lr_scheduler: str = "cosine"  # cosine | linear | constant | constant_with_warmup
    warmup_ratio: float = 0.1  # of the steps (at least one when positive)
    warmup_steps: int | None = None  # instead of --warmup-ratio
    min_lr_ratio: float = 0.1  # where cosine and linear decay end, a fraction of --lr
    max_grad_norm: float | None = None  # clip the global gradient norm (0: off; None: 1.0 for HF models, else off)

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


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run's state is saved and what it continues from."""
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    resume_with_changes: bool = False  # a resume may change lr, steps, precision, batch shape, data
    stop_after: int | None = None

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
    metrics: str | None = None
    tensorboard: str | None = None  # a TensorBoard log directory (a new event file in it)
    report_to: tuple[str, ...] = ()  # REPORTERS that get the step's scalars, each in its place under report_dir
    report_dir: str | None = None
    trace: str | None = None
    export: str | None = None
    export_merged: str | None = None  # LoRA: a full Hugging Face model with the adapters merged
    progress: bool = True

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
    recompute: str = "auto"  # auto | on | off
    partitioner: str = "mip"
    stages: int | None = None  # force a stage count (uniform partition); None: the partitioner decides
    mapping: str = "cross"  # cross (adjacent stages under different root complexes) | sequential
    prefetch: bool = True  # load the next stage while the current one computes
    device_optimizer: str = "auto"  # auto: stages that fit stay on their device, updated there | off
    data_parallel: int | None = None  # replicas of the pipeline (None: the nodes under torchrun, else 1)
    replan: str = "off"  # auto: re-plan once, mid-run, with the rates the run measured (mobius.replan) | off
    offload_dir: str | None = None  # AdamW's moments of the host's stages wait here, on disk (mobius.swap.disk)

    def __post_init__(self):
        _positive(self, ("stages", "data_parallel"))
        if self.replan not in ("auto", "off"):
            raise InputError(f"--replan must be auto or off, got {self.replan!r}")


@dataclass(frozen=True)
class ChunkedConfig:
    """The chunked backend's own choices (Elixir, PatrickStar)."""
    chunk_size: int | None = None  # elements per chunk (None: searched)
    rcache_blocks: int | None = None  # rCache blocks (None: searched)
    offload: str = "auto"  # auto (searched placement) | on (all chunks on the host) | off
    prefetch: bool = True  # gather the next layer's chunks while this one computes

    def __post_init__(self):
        _positive(self, ("chunk_size", "rcache_blocks"))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on frozen base weights; rank 0 trains every weight."""
    rank: int = 0
    alpha: float | None = None  # None: the rank (scaling 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    use_dora: bool = False  # DoRA (PEFT's use_dora): magnitudes trained apart from the directions
    load_in_4bit: bool = False  # QLoRA: the frozen base's projections in NF4 (mobius.models.quant)

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
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise InputError(f"--lora-targets {','.join(self.targets)!r}: give distinct names among "
                             f"{', '.join(LORA_TARGETS)}")


@dataclass(frozen=True)
class EmulationConfig:
    """--emulate: CPU workers stand for the topology's GPUs with emulated links and dilated time."""
    enabled: bool = False
    dilation: float | None = None  # wall seconds per emulated second (None: chosen for the run)

    def __post_init__(self):
        if self.dilation is not None and not self.enabled:
            raise InputError("--dilation F needs --emulate")
        if self.dilation is not None and not (math.isfinite(self.dilation) and self.dilation >= 1):
            raise InputError(f"--dilation must be a finite number of at least 1, got {self.dilation}")


# Where each command-line option lives: option -> (section, attribute).  The command line, a
# --config file, --print-config and a checkpoint's stored configuration all speak options; the
# code reads sections.
SECTIONS = {"data": DataConfig, "batch": BatchConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
            "outputs": OutputConfig, "pipeline": PipelineConfig, "chunked": ChunkedConfig, "lora": LoraConfig,
            "emulation": EmulationConfig}
_RENAMED = {"data": ("data", "path"), "data_format": ("data", "format"), "eval_data": ("data", "eval_path"),
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
    topology: str = "auto"
    backend: str = "auto"
    model: str = "small"
    gpu_mem_gb: float | None = None
    host_adam_gbps: float | None = None  # the planned host's memory bandwidth for its AdamW (analytic profiles)
    cpu_workers: int = 2
    network: str | None = None  # between nodes: a preset (25gbe) or GB/s; None: the topology's, else assumed
    host_mem_gb: float | None = None  # the host memory the run may use (None: the topology's, or what is available)
    drive_gbps: tuple[str, ...] = ()  # the disk tier's drives, GB/s each (none: the topology's, else one assumed)
    data: DataConfig = DataConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    outputs: OutputConfig = OutputConfig()
    pipeline: PipelineConfig = PipelineConfig()
    chunked: ChunkedConfig = ChunkedConfig()
    lora: LoraConfig = LoraConfig()
    emulation: EmulationConfig = EmulationConfig()

    def __post_init__(self):
        _positive(self, ("cpu_workers", "gpu_mem_gb", "host_adam_gbps", "host_mem_gb"))
        for text in self.drive_gbps:
            try:
                ok = 0 < float(text) < 1e4
            except ValueError:
                ok = False
            if not ok:
                raise InputError(f"--drive-gbps {','.join(self.drive_gbps)!r}: give each drive's GB/s, a positive "
                                 "number below 10000")
        if (self.host_mem_gb or self.drive_gbps) and not self.pipeline.offload_dir:
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
        replicas = self.pipeline.data_parallel or 1
        if self.batch.micro_batches % replicas:
            raise InputError(f"--micro-batches {self.batch.micro_batches} is not divisible by --data-parallel "
                             f"{replicas}: each replica runs an equal share of the step's micro-batches")

    @classmethod
    def of(cls, **options) -> "RunConfig":
        """A configuration from option names (``micro_batch_size=2``, ``lora_rank=8``), the others at
        their defaults."""
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
        return RunConfig.from_dict({**self.to_dict(), **options})


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless it is None or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or "") or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {shown(message)} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def add_model_and_batch_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``mobius.train`` and ``mobius.plan``."""
    d = RunConfig().to_dict()
    p.add_argument("--topology", default=d["topology"],
                   help="auto (probe this machine), a preset name, or a topology JSON file")
    p.add_argument("--model", default=d["model"],
                   help="a preset (tiny, small, mobius-3b, gpt2, ...) or a Hugging Face directory (GPT-2, OPT, "
                        "Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank on frozen base weights (0: full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scaling numerator (default: the rank)")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input in training (masks seeded per step, micro-batch, layer and "
                        "module: every backend and every recomputation draws the same)")
    p.add_argument("--lora-targets", type=comma_names, default=d["lora_targets"],
                   help="comma-separated projections that get adapters: qkv (q, k, v), proj (attention output), "
                        "fc (MLP in; gate and up), fc_out (MLP out)")
    p.add_argument("--use-dora", action="store_true",
                   help="DoRA (weight-decomposed LoRA, PEFT's use_dora): each output row's magnitude trains apart "
                        "from the adapted direction, whose norm is held constant in backward, as PEFT does")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: hold every block's projections as a frozen 4-bit NF4 base (bitsandbytes' format, "
                        "blocks of 64, fp32 scales), dequantized where they compute; --backend single")
    p.add_argument("--micro-batch-size", type=int, default=d["micro_batch_size"], help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=d["micro_batches"],
                   help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per sequence")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="compute precision (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="cap each device's memory (on CPU workers: the budget the runtime enforces)")
    p.add_argument("--host-adam-gbps", type=float, default=None,
                   help="memory bandwidth (GB/s) of the host the plan is for, which bounds its AdamW, when that "
                        "host is not this one (default: the topology's host.memory_bandwidth_gbps, else an assumed "
                        "1e9 parameters/s per GPU)")
    p.add_argument("--cpu-workers", type=int, default=d["cpu_workers"],
                   help="virtual workers of the CPU topology when no GPU is found")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default=d["recompute"],
                   help="recompute stage activations in backward (auto: the plan's memory decides)")
    p.add_argument("--partitioner", choices=("mip", "min", "max", "uniform", "balanced"),
                   default=d["partitioner"], help="how the model is cut into stages")
    p.add_argument("--stages", type=int, default=None,
                   help="force this many stages (uniform split) instead of the partitioner's choice")
    p.add_argument("--mapping", choices=("cross", "sequential"), default=d["mapping"],
                   help="place adjacent stages under different root complexes (cross, Mobius §3.3) or GPUs in order")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="load each stage only when the previous one is released (to see what prefetching gains)")
    p.add_argument("--device-optimizer", choices=("auto", "off"), default=d["device_optimizer"],
                   help="auto: the stages whose weights, gradients and AdamW state fit in a GPU's spare memory "
                        "stay there and are updated there, when the plan says the step is faster for it; off: "
                        "every stage swaps and is updated by the host's AdamW")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="keep AdamW's two moments (8 bytes a trained parameter) in files in DIR, on an NVMe drive, "
                        "between updates, read back ahead of each stage's update and written after it, overlapped "
                        "(ZeRO-Infinity's disk tier): for a host with less memory than the run needs; DIR must be "
                        "empty or absent, and the files go when the run ends (pipeline backend)")
    p.add_argument("--host-mem-gb", type=float, default=None,
                   help="with --offload-dir: the host memory the run may use; the plan puts the AdamW moments of as "
                        "many stages on disk as it takes to fit (default: every stage's)")
    p.add_argument("--drive-gbps", type=comma_names, default=(), metavar="GBPS[,GBPS...]",
                   help="with --offload-dir: the drives the disk tier uses, each one's sequential GB/s (default: the "
                        "topology's drives, else one of 3.5 GB/s assumed)")
    p.add_argument("--data-parallel", type=int, default=None, metavar="D",
                   help="D replicas of the pipeline, each on M/D of the step's micro-batches, gradients summed across "
                        "them and the host AdamW sharded across them (ZeRO-1); default: the number of nodes under "
                        "torchrun, else 1")
    p.add_argument("--network", default=None, metavar="NAME|GBPS",
                   help="the network between the nodes of --data-parallel replicas: 10gbe, 25gbe, 100gbe, ib-hdr, "
                        "ib-ndr or a bandwidth in GB/s (default: the topology's, else 10gbe assumed)")
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip the global norm of each step's gradients (over every stage, worker and chunk) to this; "
                        "0: no clipping (default: 1.0 to fine-tune a Hugging Face model, as its peers do; off for a "
                        "preset)")
    p.add_argument("--optimizer-lag", type=int, choices=(0, 1), default=0,
                   help="1: apply step k's AdamW update while step k+1 computes (its forward uses weights one "
                        "update old), so the CPU optimizer leaves the critical path; pipeline and single backends")


def build_train_parser() -> argparse.ArgumentParser:
    d = RunConfig().to_dict()
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
    add_model_and_batch_args(p)
    p.add_argument("--backend", choices=BACKENDS, default=d["backend"],
                   help="auto: chunked on NVLink topologies, else pipeline; single: plain PyTorch reference")
    p.add_argument("--replan", choices=("auto", "off"), default=d["replan"],
                   help="auto: when the run's first steps show a lane of its plan off by more than 20%%, plan again "
                        "with the measured rates and switch plans at a step boundary if the new plan is predicted to "
                        "save more than the switch costs (pipeline backend; the training state carries over)")
    p.add_argument("--emulate", action="store_true",
                   help="rehearse --topology's GPUs on CPU workers: emulated PCIe links and root complexes, "
                        "compute as long as on the GPUs, all time dilated by one factor (pipeline backend)")
    p.add_argument("--dilation", type=float, default=None, metavar="F",
                   help="--emulate: wall seconds per emulated second, fixed (the same F for every variant of a "
                        "comparison); default: chosen from this machine's CPU work for the model")
    _add_data_args(p)
    _add_update_args(p, d)
    _add_output_args(p)
    return p


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """What the run trains and evaluates on."""
    d = RunConfig().to_dict()
    p.add_argument("--data", default=None,
                   help="records (.jsonl, .json, .parquet, a datasets.save_to_disk directory) or text files, or a "
                        "directory of them (default: this Python's stdlib sources)")
    p.add_argument("--data-format", choices=FORMATS, default=None,
                   help="the records' shape (default: detected from their fields)")
    p.add_argument("--packing", choices=("auto", "on", "off"), default=d["packing"],
                   help="on: examples packed into --seq-len sequences, each attending only to itself; off: one "
                        "example per sequence, padded; auto: on for examples, random windows of a text corpus")
    p.add_argument("--train-on-prompt", action="store_true",
                   help="loss on every token of an example, not only on its answers")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, for a model without one of its own")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="leave out records that would be refused (no answer, roles out of order, an empty answer, "
                        "malformed), saying how many and the first one's line and reason, instead of stopping")
    p.add_argument("--no-truncate", dest="truncate", action="store_false",
                   help="refuse an example longer than --seq-len instead of cutting it")
    p.add_argument("--eval-data", default=None, help="held-out records: loss and perplexity, forward only")
    p.add_argument("--eval-split", type=float, default=d["eval_split"],
                   help="hold out this fraction of --data's records (drawn by --seed) for evaluation")
    p.add_argument("--eval-every", type=int, default=d["eval_every"],
                   help="evaluate every N steps, and at the end (0: at the end only)")


def _add_update_args(p: argparse.ArgumentParser, d: dict) -> None:
    """The run's length and its update rule (AdamW, the schedule)."""
    p.add_argument("--steps", type=int, default=None,
                   help=f"total optimizer steps of the run (default: {d['steps']}, or as many as --epochs take)")
    p.add_argument("--epochs", type=float, default=None,
                   help="instead of --steps: train this many passes over the training sequences")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: {DEFAULT_LR['preset']:g} for a preset, {DEFAULT_LR['full']:g} "
                        f"to fine-tune a Hugging Face model, {DEFAULT_LR['lora']:g} with --lora-rank)")
    p.add_argument("--adam-beta1", type=float, default=d["adam_beta1"], help="AdamW's first-moment decay")
    p.add_argument("--adam-beta2", type=float, default=d["adam_beta2"], help="AdamW's second-moment decay")
    p.add_argument("--adam-eps", type=float, default=d["adam_eps"], help="AdamW's epsilon")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"],
                   help="AdamW's decoupled weight decay, on weight matrices and embeddings (not biases and norms)")
    p.add_argument("--lr-scheduler", choices=SCHEDULERS, default=d["lr_scheduler"],
                   help="after the warm-up: cosine or linear decay to --min-lr-ratio of --lr, or constant (constant: "
                        "no warm-up either)")
    p.add_argument("--warmup-ratio", type=float, default=d["warmup_ratio"],
                   help="linear warm-up over this fraction of --steps (at least one step when positive)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up over this many steps, instead")
    p.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"],
                   help="the learning rate the decay ends at, as a fraction of --lr")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the weights and of the data order")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """What the run writes, and the chunked backend's own options."""
    d = RunConfig().to_dict()
    p.add_argument("--metrics", default=None, help="write per-step metrics to this JSONL file")
    p.add_argument("--tensorboard", default=None,
                   help="write loss, eval loss, learning rate, tokens/s and step time as TensorBoard events here")
    p.add_argument("--report-to", type=comma_names, default=d["report_to"],
                   help=f"also report the step's scalars to these, comma-separated: {', '.join(REPORTERS)} (offline: "
                        "wandb unless WANDB_MODE=online, mlflow in a local store unless MLFLOW_TRACKING_URI is set)")
    p.add_argument("--report-dir", default=None,
                   help="where --report-to writes: DIR/tensorboard, DIR/wandb, DIR/mlruns")
    p.add_argument("--trace", default=None, help="write a Chrome trace (Perfetto) to this JSON file")
    p.add_argument("--save", default=None, help="checkpoint directory (written every --save-every steps and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end or on a stop)")
    p.add_argument("--resume", default=None, help="continue from this checkpoint (any backend or topology)")
    p.add_argument("--resume-with-changes", action="store_true",
                   help="allow --resume with settings that differ from the checkpoint's run (lr, steps, precision, ...)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this run after K steps with a checkpoint, as a signal would (--steps stays the total)")
    p.add_argument("--export", default=None, help="write the fine-tuned model here as a Hugging Face directory "
                   "(under LoRA: a PEFT adapter directory)")
    p.add_argument("--export-merged", default=None,
                   help="LoRA: write the base model with the adapters merged here, as a Hugging Face directory")
    p.add_argument("--chunk-size", type=int, default=None, help="chunked backend: elements per chunk (default: searched)")
    p.add_argument("--rcache-blocks", type=int, default=None, help="chunked backend: rCache blocks (default: searched)")
    p.add_argument("--offload", choices=("auto", "on", "off"), default="auto",
                   help="chunked backend: keep chunks and their AdamW on the host (on), the device (off), or as searched")
    p.add_argument("--no-chunk-prefetch", dest="chunk_prefetch", action="store_false",
                   help="chunked backend: gather each chunk only when it is needed")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


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
        if not installed(name):
            raise InputError(f"--report-to {name} needs the '{name}' package: pip install 'mobius-train[{name}]'")


def resolve_max_grad_norm(args: argparse.Namespace) -> None:
    """``--max-grad-norm``'s default: the peers' 1.0 for a Hugging Face model, off for a preset
    (``mobius.train`` and ``mobius.plan`` alike: clipping changes the plan's schedule)."""
    if args.max_grad_norm is None:
        args.max_grad_norm = DEFAULT_MAX_GRAD_NORM if Path(args.model).is_dir() else 0.0


def parse_train_args(argv: list[str] | None = None, checkpoint_settings=None, resolve=None) -> RunConfig:
    """The run's configuration: the resumed checkpoint's (``checkpoint_settings(DIR)``, given by the
    command, which reads checkpoints), then ``--config``'s, then the command line's settings
    (:mod:`mobius.config_sources`), defaults resolved, checked.  ``--print-config`` prints it as
    the run would use it (``resolve(cfg)``: the backend and precision decided, given by the command)."""
    parser = build_train_parser()
    args = parser.parse_args(layered_argv(parser, list(sys.argv[1:] if argv is None else argv),
                                          checkpoint_settings, BACKEND_OPTIONS))
    if args.steps is not None and args.epochs is not None:
        raise InputError("give --steps or --epochs, not both")
    if args.steps is None:
        args.steps = OptimConfig.steps
    if args.lr is None:
        kind = "lora" if args.lora_rank else "full" if Path(args.model).is_dir() else "preset"
        args.lr = DEFAULT_LR[kind]
    resolve_max_grad_norm(args)
    cfg = RunConfig.from_dict(vars(args))
    check_paths(cfg)
    if args.print_config:
        import yaml

        settings = (resolve(cfg) if resolve else cfg).to_dict()
        shown = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}  # YAML lists
        print(yaml.safe_dump(shown, sort_keys=False), end="")
        raise SystemExit(0)
    return cfg


# The options a backend owns: a resume on another backend inherits none of them.
BACKEND_OPTIONS = tuple(option for option, (section, _) in OPTIONS.items()
                        if section in ("pipeline", "chunked", "emulation"))
