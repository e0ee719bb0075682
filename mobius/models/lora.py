"""LoRA adapters on the linear projections of attention and MLP, with PEFT's conventions.

``y = x W^T + b + (alpha / r) * (x A^T) B^T`` with ``A`` (r x in) drawn like ``nn.Linear``'s weight
(Kaiming-uniform, a = sqrt(5)) and ``B`` (out x r) zero, so training starts from the base model.
The base ``W`` and ``b`` are frozen; only ``A`` and ``B`` train.

Dropout on an adapter's input (``--lora-dropout p``, PEFT's ``lora_dropout``) must give every
backend the same masks, and recomputation the mask of the forward it redoes, so a mask is not drawn
from a global generator: it is a pure function of (run seed, step, micro-batch, layer, module, part),
drawn on the CPU.  The trainer names the micro-batch being computed (:func:`dropout_micro_batch`);
outside of that (evaluation, exports) no dropout applies.

Our blocks fuse projections that Hugging Face models keep apart (q|k|v in ``qkv`` for Llama,
OPT and Gemma, gate|up in ``fc`` for SwiGLU and GeGLU): such a projection carries one adapter per
Hugging Face module, each on its slice of the output, exactly as PEFT puts one on each module, so
an exported adapter loads into PEFT unchanged.  A target names a projection (every part adapted) or
one part of it, ``qkv.0`` (q_proj alone: PEFT's ``q_proj``); a part without an adapter adds nothing.
Where the checkpoint fuses them too (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``)
there is one module and one adapter.  Parameter names: ``<module>.lora_A.<part>``,
``<module>.lora_B.<part>``.

A mixture of experts' router and stacked experts (:data:`MOE_TARGETS`) take adapters as PEFT puts
them on parameters (``target_parameters``), without dropout or DoRA: the router one like a
projection's, the experts' gate | up (``experts_fc``) and down (``experts_out``) one rank-r pair per
expert, stored as PEFT stores them, ``lora_A`` (r x experts, in) and ``lora_B`` (out, r x experts),
expert ``e`` the rows ``e r .. e r + r - 1`` of A and the columns ``k experts + e`` of B
(:class:`ExpertAdapters`; names ``experts_fc_lora.lora_A``, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F
from torch import nn

from mobius.models.architecture import GPTConfig
from mobius.models.quant import Linear4bit

# Every projection an adapter can sit on (q|k|v, attention output, MLP in, MLP out), numbered for
# the dropout masks.
LORA_MODULES = ("qkv", "proj", "fc", "fc_out")
# A mixture of experts' router and stacked experts: adapted as PEFT adapts parameters.
MOE_TARGETS = ("router", "experts_fc", "experts_out")
ADAPTABLE = LORA_MODULES + MOE_TARGETS

# Adapters are initialised from a generator of their own per layer, so adding them changes no
# base weight of a seeded preset.
SEED_OFFSET = 2**40

# (run seed, step, micro-batch) of the micro-batch this thread computes, or None: no dropout.
_MICRO_BATCH: contextvars.ContextVar = contextvars.ContextVar("lora_micro_batch", default=None)


@contextlib.contextmanager
def dropout_micro_batch(seed: int, step: int, micro_batch: int):
    """Adapter dropout within this block draws the masks of micro-batch ``micro_batch`` of ``step``."""
    token = _MICRO_BATCH.set((seed, step, micro_batch))
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def _mix(*values: int) -> int:
    h = 0
    for v in values:
        h = (h * 1_000_003 + int(v)) % (2**63 - 1)
    return h


# Our fused projections that a family's checkpoint stores as one module too (our presets: all).
FUSED_IN_CHECKPOINT = {None: ("qkv", "fc"), "gpt2": ("qkv", "fc"), "phi3": ("qkv", "fc")}


def adapted_parts(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our projections that carry adapters, in :data:`LORA_MODULES` order, and the parts of each
    that do (``config.lora_targets``: ``qkv`` adapts every part, ``qkv.2`` the third alone)."""
    chosen: dict[str, set[int]] = {}
    for target in config.lora_targets:
        module, _, part = target.partition(".")
        chosen.setdefault(module, set()).update([int(part)] if part else range(len(parts(config, module))))
    return {m: tuple(sorted(chosen[m])) for m in ADAPTABLE if m in chosen}


def parts(config: GPTConfig, module: str) -> list[int]:
    """Output sizes of the Hugging Face modules fused in our ``module``."""
    h, kv = config.hidden, config.kv_width
    fused = module in FUSED_IN_CHECKPOINT.get(config.hf_arch, ())
    if module == "qkv":
        return [config.attention_width + 2 * kv] if fused else [config.attention_width, kv, kv]  # q, k, v_proj
    if module == "fc" and config.gated_mlp:
        return [2 * config.ffn] if fused else [config.ffn, config.ffn]  # gate_proj, up_proj
    if module == "fc":
        return [config.ffn]
    if module == "router":
        return [config.experts]
    if module == "experts_fc":
        return [2 * config.expert_ffn]
    return [h]  # proj, fc_out, experts_out


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus one low-rank adapter per part of its output."""

    def add_adapters(self, sizes: list[int], rank: int, alpha: float, dropout: float = 0.0,
                     where: tuple[int, int] = (0, 0), dora: bool = False,
                     chosen: tuple[int, ...] | None = None) -> None:
        """``where``: (layer index, module number), what a dropout mask is a function of.  ``dora``:
        each part also trains the magnitude of each of its output rows (DoRA, PEFT's ``use_dora``).
        ``chosen``: the parts that get adapters (default: all), named by their index."""
        assert sum(sizes) == self.out_features
        self.scaling = alpha / rank
        self.dropout, self.where, self.sizes = dropout, where, list(sizes)
        chosen = range(len(sizes)) if chosen is None else chosen
        self.lora_A = nn.ParameterDict({str(k): nn.Parameter(self.weight.new_empty(
            (rank, self.in_features), dtype=torch.get_default_dtype())) for k in chosen})
        self.lora_B = nn.ParameterDict({str(k): nn.Parameter(torch.zeros(sizes[k], rank, device=self.weight.device))
                                        for k in chosen})
        self.lora_magnitude = nn.ParameterDict({str(k): nn.Parameter(self.weight.new_empty(
            sizes[k], dtype=torch.get_default_dtype())) for k in chosen} if dora else {})
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)

    def reset_adapters(self, generator: torch.Generator) -> None:
        rows = self.weight.split(self.sizes)
        for k in self.lora_A:
            nn.init.kaiming_uniform_(self.lora_A[k], a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B[k])
        for k, magnitude in self.lora_magnitude.items():
            magnitude.copy_(torch.linalg.norm(rows[int(k)].float(), dim=1))  # B = 0: the base rows' own norms

    def _dropped(self, x: torch.Tensor, part: int) -> torch.Tensor:
        key = _MICRO_BATCH.get()
        if not self.dropout or key is None:
            return x
        generator = torch.Generator().manual_seed(_mix(*key, *self.where, part))
        keep = torch.rand(x.shape, generator=generator) >= self.dropout
        return x * keep.to(device=x.device, dtype=x.dtype) * (1.0 / (1.0 - self.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)  # taken once: a 4-bit base's is dequantized (in fp32) on each read
        y = F.linear(x, weight, self.bias)
        if len(self.lora_magnitude):
            return y + self._dora(x, y, weight)
        deltas = [F.linear(F.linear(self._dropped(x, k), self.lora_A[str(k)]), self.lora_B[str(k)])
                  if str(k) in self.lora_A else x.new_zeros(*x.shape[:-1], n) for k, n in enumerate(self.sizes)]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return y + delta * self.scaling

    def _dora(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """DoRA's addition to the base output ``y`` of ``weight`` (in ``x``'s dtype), part by part, as
        PEFT computes it: the rows of ``W + s B A`` rescaled to the trained magnitudes ``m``, their
        norms a constant in backward (DoRA §4.3):
        ``(m / |W + s B A| - 1) x W^T + (m / |W + s B A|) s (x A^T) B^T``."""
        outs, row = [], 0
        for k, n in enumerate(self.sizes):
            if str(k) not in self.lora_A:  # no adapter: the base rows as they are
                outs.append(y.new_zeros(*y.shape[:-1], n))
                row += n
                continue
            a, b, magnitude = self.lora_A[str(k)], self.lora_B[str(k)], self.lora_magnitude[str(k)]
            w = weight[row:row + n]
            lora_weight = (b @ a).detach().to(x.dtype)
            scale = (magnitude / torch.linalg.norm(w + self.scaling * lora_weight, dim=1).detach()).view(1, -1)
            dropped = self._dropped(x, k)
            lora = F.linear(F.linear(dropped, a), b)
            if dropped is x:  # the base output already computed, its bias taken off
                base = y[..., row:row + n] - (self.bias[row:row + n] if self.bias is not None else 0)
            else:  # PEFT takes the dropped input's base output then
                base = F.linear(dropped, w)
            outs.append((scale - 1) * base + scale * lora * self.scaling)
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class LoRALinear4bit(LoRALinear, Linear4bit):
    """Adapters on a 4-bit base (QLoRA): LoRA's forward, the base weight dequantized."""


class ExpertAdapters(nn.Module):
    """One rank-r adapter per expert on a stack of expert matrices, each ``out x in``, as PEFT's
    ``ParamWrapper`` holds them (see the module's docstring); computed per expert as LoRA is,
    ``x W_e^T + s (x A_e^T) B_e^T``."""

    def __init__(self, experts: int, rank: int, in_features: int, out_features: int, scaling: float,
                 like: torch.Tensor) -> None:
        super().__init__()
        self.experts, self.rank, self.scaling = experts, rank, scaling
        self.lora_A = nn.Parameter(like.new_empty((rank * experts, in_features), dtype=torch.get_default_dtype()))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank * experts, device=like.device))

    def reset_adapters(self, generator: torch.Generator) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B)

    def factors(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s (A, B): r x in, out x r."""
        a = self.lora_A.view(self.experts, self.rank, -1)[expert]
        return a, self.lora_B.view(self.lora_B.shape[0], self.rank, self.experts)[:, :, expert]

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """What the adapter of ``expert`` adds to its output for inputs ``x``."""
        a, b = self.factors(expert)
        return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scaling


def add_lora(block: nn.Module, config: GPTConfig, seed: int | None, index: int = 0) -> None:
    """Freeze every parameter of ``block`` (layer ``index``) and put adapters on its target
    projections, initialised from ``seed`` (None: left uninitialised, e.g. on the meta device)."""
    for p in block.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(SEED_OFFSET + seed) if seed is not None else None
    for name, chosen in adapted_parts(config).items():
        if name in ("experts_fc", "experts_out"):
            if getattr(block, "moe", False):
                out, inputs = parts(config, name)[0], config.hidden if name == "experts_fc" else config.expert_ffn
                adapters = ExpertAdapters(config.experts, config.lora_rank, inputs, out,
                                          config.lora_alpha / config.lora_rank, getattr(block, name))
                setattr(block, f"{name}_lora", adapters)
                if generator is not None:
                    with torch.no_grad():
                        adapters.reset_adapters(generator)
            continue
        lin = getattr(block, name, None)
        if lin is None:  # a block without it: a mixture's has no dense MLP, a dense one no router
            continue
        lin.__class__ = LoRALinear4bit if isinstance(lin, Linear4bit) else LoRALinear
        lin.add_adapters(parts(config, name), config.lora_rank, config.lora_alpha, config.lora_dropout,
                         (index, ADAPTABLE.index(name)), config.lora_dora, chosen)
        if generator is not None:
            with torch.no_grad():
                lin.reset_adapters(generator)


def freeze(layer: nn.Module) -> None:
    """Embedding and head under LoRA: frozen, no adapters."""
    for p in layer.parameters():
        p.requires_grad_(False)

