"""The routers' load-balancing loss of a mixture of experts (Switch Transformer's), as transformers
computes it for Mixtral, Qwen3-MoE and GPT-OSS when their config turns on ``output_router_logits``.

The loss couples every MoE block of a micro-batch:

    aux = E * sum_e f_e * P_e

with ``f_e`` the fraction of the (token, block) top-k picks that went to expert ``e`` and ``P_e``
the mean router probability of ``e``, both over every MoE block's tokens, padding left out.  Only
``P`` carries a gradient, so each block's router receives ``E * f / rows``, which depends on every
block of the micro-batch, including those of later stages.

So each MoE block adds its counts, probability sums and rows to a *tally* of the micro-batch, and
the tally travels with the hidden states: between layers the activation is one tensor, the
*wire*, shape ``(B, T * hidden + extra)``: the hidden states flattened per row, and behind row 0
the fp32 tally's bytes in the hidden states' dtype (the rest of the tail zero).  Every schedule,
link and executor moves it as it moves the hidden states, and autograd brings the loss's gradient
back to every block through the same tensor.  The tally's bits are never computed on between the
pack and the unpack (only copied), so a 16-bit wire carries them exactly.

The head adds ``coef * share * aux``: ``share`` is the micro-batch's share of the mean over the
step's micro-batches (:class:`~mobius.models.layout.TokenLayout`'s ``balance_share``), so with one
micro-batch the loss is transformers' ``loss`` with ``router_aux_loss_coef``.
"""

from __future__ import annotations

import math

import torch

from mobius.models.architecture import GPTConfig


def carries_tally(config: GPTConfig) -> bool:
    """Whether the layers of this model pass the wire (the load-balancing loss is on)."""
    return config.router_aux_loss_coef > 0


def tally_size(config: GPTConfig) -> int:
    """The tally's fp32 entries: counts per expert, probability sums per expert, rows."""
    return 2 * config.experts + 1


def _extra(config: GPTConfig, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` behind the hidden states of a wire row that hold the tally's bytes."""
    return -(-tally_size(config) * 4 // dtype.itemsize)


def activation_shape(config: GPTConfig, tokens_shape, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of the tensor between layers for a micro-batch of ``tokens_shape`` (B, T)."""
    b, t = tokens_shape
    if not carries_tally(config):
        return (b, t, config.hidden)
    return (b, t * config.hidden + _extra(config, dtype))


def activation_bytes(config: GPTConfig, batch: int, seq: int, dtype: torch.dtype) -> int:
    return math.prod(activation_shape(config, (batch, seq), dtype)) * dtype.itemsize


def _bits(tally: torch.Tensor, dtype: torch.dtype, extra: int) -> torch.Tensor:
    """The fp32 ``tally``'s bytes as ``extra`` elements of ``dtype`` (zero-padded)."""
    raw = tally.detach().contiguous().view(torch.uint8)
    pad = extra * dtype.itemsize - raw.numel()
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(dtype)


def _from_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 tally of ``n`` entries whose bytes ``bits`` holds."""
    return bits.clone().view(torch.uint8)[:n * 4].view(torch.float32)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, tally: torch.Tensor, extra: int) -> torch.Tensor:
        b, t, h = hidden.shape
        wire = hidden.new_zeros(b, t * h + extra)
        wire[:, :t * h] = hidden.reshape(b, t * h)
        wire[0, t * h:] = _bits(tally, hidden.dtype, extra)
        ctx.shape, ctx.n = (b, t, h), tally.numel()
        return wire

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, t, h = ctx.shape
        return grad[:, :t * h].reshape(b, t, h), _from_bits(grad[0, t * h:], ctx.n), None


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wire: torch.Tensor, hidden_size: int, n: int, extra: int):
        b, width = wire.shape
        th = width - extra
        hidden = wire.new_empty(b, th // hidden_size, hidden_size)
        hidden.view(b, th).copy_(wire[:, :th])
        ctx.shape, ctx.th, ctx.dtype, ctx.device = wire.shape, th, wire.dtype, wire.device
        return hidden, _from_bits(wire[0, th:], n)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor | None, grad_tally: torch.Tensor | None):
        b, width = ctx.shape
        th = ctx.th
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        if grad_hidden is not None:
            grad[:, :th] = grad_hidden.reshape(b, th)
        if grad_tally is not None:
            grad[0, th:] = _bits(grad_tally, grad.dtype, width - th)
        return grad, None, None, None


def pack(config: GPTConfig, hidden: torch.Tensor, tally: torch.Tensor) -> torch.Tensor:
    """Hidden states (B, T, hidden) and the tally -> the wire."""
    return _Pack.apply(hidden, tally, _extra(config, hidden.dtype))


def unpack(config: GPTConfig, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire -> hidden states (B, T, hidden), tally."""
    return _Unpack.apply(wire, config.hidden, tally_size(config), _extra(config, wire.dtype))


def is_wire(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_floating_point()


def empty_tally(config: GPTConfig, device: torch.device) -> torch.Tensor:
    return torch.zeros(tally_size(config), dtype=torch.float32, device=device)


def block_tally(config: GPTConfig, logits: torch.Tensor, chosen: torch.Tensor,
                real: torch.Tensor | None) -> torch.Tensor:
    """One MoE block's part of the tally: ``logits`` (N, E) its router's, ``chosen`` (N, k) the
    experts each token went to, ``real`` (N,) False at padding (None: no padding).  As transformers'
    ``load_balancing_loss_func`` sums a layer (the probabilities in fp32)."""
    e, k = config.experts, chosen.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)
    weight = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device) if real is None \
        else real.reshape(-1).to(torch.float32)
    counts = torch.zeros(e, dtype=torch.float32, device=logits.device) \
        .scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(k))
    sums = (probs * weight[:, None]).sum(dim=0) if real is not None else probs.sum(dim=0)
    return torch.cat([counts, sums, weight.sum().view(1)])


def balance_loss(config: GPTConfig, tally: torch.Tensor) -> torch.Tensor:
    """``aux`` of the micro-batch from its tally (0 for a micro-batch of padding alone)."""
    e = config.experts
    counts, sums, rows = tally[:e], tally[e:2 * e], tally[2 * e].clamp(min=1)  # no rows: no counts, no sums
    return (counts / rows * (sums / rows)).sum() * e
