"""A 4-bit base for LoRA (QLoRA, ``--load-in-4bit``): the frozen projections of every block held
as NF4 codes, dequantized to the compute dtype where a layer computes.

The format is bitsandbytes' ``quant_type="nf4"`` without nested quantization, as
``transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` stores a
checkpoint's linear layers: each Hugging Face module's weight, flattened, in blocks of
:data:`BLOCK` values, each block scaled by its largest magnitude (an fp32 ``absmax``) and every
value replaced by the nearest of the 16 NF4 levels (the QLoRA paper's quantiles of a normal
distribution), two 4-bit codes to a byte, the first in the high half.  A weight is quantized from
the checkpoint's values, and dequantized as ``level * absmax`` in fp32, then cast: the values
bitsandbytes' own kernels give, in plain torch, on every device.

Our fused projections (q|k|v, gate|up) quantize each Hugging Face module's rows apart
(:func:`mobius.models.lora.parts`), so their blocks are those of PEFT's model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64

# The NF4 levels, in code order (bitsandbytes.functional.get_4bit_type("nf4")).
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4, dtype=torch.float32, device=device)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, two to a byte, uint8; absmax per block, fp32) of ``weight``.  A last block of fewer
    than :data:`BLOCK` values has its own absmax."""
    flat = weight.detach().reshape(-1).float()
    full = flat.numel() - flat.numel() % BLOCK
    blocks = flat[:full].view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1)).clamp(-1, 1).reshape(-1)
    if full < flat.numel():
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.view(1)])
        scaled = torch.cat([scaled, (flat[full:] / last).clamp(-1, 1)])
    if scaled.numel() % 2:
        scaled = F.pad(scaled, (0, 1))
    levels = _levels(weight.device)
    codes = torch.bucketize(scaled, (levels[:-1] + levels[1:]) / 2, out_int32=True).to(torch.uint8)
    return (codes[::2] << 4) | codes[1::2], absmax


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` that :func:`quantize` gave ``packed`` and ``absmax`` for, in ``dtype``."""
    n = math.prod(shape)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    values = _levels(packed.device)[codes]
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return (values * scale).reshape(shape).to(dtype)


def buffer_sizes(n: int) -> tuple[int, int]:
    """(bytes of codes, blocks) of a weight of ``n`` values."""
    return (n + 1) // 2, -(-n // BLOCK)


class Linear4bit(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is held as NF4 codes, one set per Hugging Face module
    fused in it (buffers ``weight_codes`` and ``weight_absmax``, the parts' concatenated).  Its
    ``weight`` is the dequantized matrix in fp32 (what bitsandbytes computes before it casts), so
    every user of a linear's weight (the forward, LoRA, DoRA's norms) reads what the 4-bit base
    holds, cast to its input's dtype.  The absmax is kept as its bits (int32): casting the model to
    16 bits must not round the scales."""

    def quantize_base(self, sizes: list[int]) -> None:
        weight = self._parameters.pop("weight")
        self.sizes = list(sizes)
        codes, absmax = [], []
        for rows in weight.detach().split(sizes):
            if weight.device.type == "meta":  # a description: the buffers' shapes alone
                n_codes, n_blocks = buffer_sizes(rows.numel())
                codes.append(torch.empty(n_codes, dtype=torch.uint8, device="meta"))
                absmax.append(torch.empty(n_blocks, dtype=torch.float32, device="meta"))
            else:
                c, a = quantize(rows)
                codes.append(c)
                absmax.append(a)
        self.register_buffer("weight_codes", torch.cat(codes))
        self.register_buffer("weight_absmax", torch.cat(absmax).view(torch.int32))

    @property
    def weight(self) -> torch.Tensor:
        parts, at_code, at_block = [], 0, 0
        absmax = self.weight_absmax.view(torch.float32)
        for rows in self.sizes:
            n = rows * self.in_features
            codes, blocks = buffer_sizes(n)
            parts.append(dequantize(self.weight_codes[at_code:at_code + codes], absmax[at_block:at_block + blocks],
                                    (rows, self.in_features), torch.float32))
            at_code, at_block = at_code + codes, at_block + blocks
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def quantize_projections(block: nn.Module, names, part_sizes) -> None:
    """The projections ``names`` of ``block`` to a 4-bit base; ``part_sizes(name)``: the rows of each
    Hugging Face module fused in one."""
    for name in names:
        linear = getattr(block, name)
        linear.__class__ = Linear4bit
        linear.quantize_base(part_sizes(name))
