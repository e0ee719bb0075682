"""A GPT written as an ordered list of layers.

``embedding -> N transformer blocks -> final norm + LM head + loss``.  The list is the contract
the profiler, the partitioner and the stage builder consume: every layer reports its parameter
bytes, forward FLOPs and output size for a micro-batch without running (so a 51B model can be
described on the meta device and planned on a laptop).

Blocks are pre-LayerNorm with causal attention through ``scaled_dot_product_attention`` and a GELU
MLP, or whatever a Hugging Face family asks of them (:class:`~mobius.models.architecture.GPTConfig`);
there is no dropout (fine-tuning runs are compared bitwise against the reference trainer).

Tied embeddings are handled explicitly: with ``tie_embeddings`` the head's output projection *is*
the embedding's token table.  On one device that is one Parameter used twice, so autograd sums its
gradient over both uses.  When the embedding and the head sit in different pipeline stages each
stage holds a copy and the runtime sums the two gradients before the (identical) update; see
:func:`tied_parameter_names`.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mobius.boundary.errors import InputError
from mobius.models.architecture import GPTConfig, layer_count
from mobius.models.hf import load_layer_weights
from mobius.models.layout import IGNORE, TokenLayout, as_layout, causal_mask
from mobius.models.preference import pair_loss
from mobius.models.lora import LORA_MODULES, add_lora, freeze, parts
from mobius.models.quant import quantize_projections
from mobius.models import router_balance as balance


class GPTLayer(nn.Module):
    """One element of the layer list; subclasses say what they cost without running."""

    kind = "layer"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config

    def param_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of this layer's parameters (a tied weight counts: the stage must hold it)."""
        return sum(p.numel() for p in self.parameters()) * dtype.itemsize

    def forward_flops(self, batch: int, seq: int) -> int:
        raise NotImplementedError

    def output_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        return balance.activation_bytes(self.config, batch, seq, dtype)

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        """Activation memory autograd keeps for one micro-batch while this layer runs forward with
        gradients."""
        return self.output_bytes(batch, seq, dtype)

    def held_bytes(self) -> int:
        """Device memory this layer holds once per pass of its stage, however many micro-batches
        run (beyond :meth:`working_bytes` of each)."""
        return 0

    def signature(self) -> tuple:
        """Layers with equal signatures are interchangeable for profiling (layer similarity)."""
        return (self.kind, tuple((n, tuple(p.shape)) for n, p in self.named_parameters()))


class Embedding(GPTLayer):
    kind = "embedding"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        if config.positions == "learned":
            self.wpe = nn.Embedding(config.context + config.position_offset, config.hidden)

    def forward(self, tokens: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        x = self.wte(tokens)
        if self.config.embed_scale:  # Gemma: sqrt(hidden) rounded to the table's dtype, as it trained
            x = x * torch.tensor(self.config.hidden ** 0.5, dtype=torch.float32).to(x.dtype)
        if self.config.positions == "learned":
            positions = layout.positions if layout is not None and layout.positions is not None \
                else torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.wpe(positions + self.config.position_offset)
        if balance.carries_tally(self.config):  # the routers' tally starts here (mobius.models.router_balance)
            return balance.pack(self.config, x, balance.empty_tally(self.config, x.device))
        return x

    def forward_flops(self, batch: int, seq: int) -> int:
        return batch * seq * self.config.hidden  # the position add; the lookup is a gather

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.wte.weight, std=0.02, generator=generator)
        if self.config.positions == "learned":
            nn.init.normal_(self.wpe.weight, std=0.01, generator=generator)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: computed in fp32 and scaled by ``1 + weight`` (the weight starts at zero),
    cast back to the input's dtype only at the end."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def make_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """The family's norm over ``width`` features (default: the hidden size)."""
    width = width or config.hidden
    if config.norm == "rmsnorm_gemma":
        return GemmaRMSNorm(width, config.norm_eps)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps, bias=config.flag("norm_bias"))


def rotary_tables(config: GPTConfig, positions: torch.Tensor, dtype,
                  sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of rotary ``positions`` (the Llama convention: the two halves of the rotated dims
    turn): (T, dims) for a (T,) range, (B, 1, T, dims) for per-row (B, T) positions.  A sliding
    block of a model with a local base (Gemma 3) rotates by that base, unscaled."""
    d = config.rotary_dims or config.head_dim
    local = sliding and config.local_rope_theta is not None
    theta, scaling = (config.local_rope_theta, None) if local else (config.rope_theta, config.rope_scaling)
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d
    inv_freq, attention = 1.0 / (theta ** exponents), 1.0
    if scaling is not None and scaling[0] == "llama3":
        inv_freq = _llama3_scaled(inv_freq, *scaling[1:])
    elif scaling is not None and scaling[0] == "linear":
        inv_freq = inv_freq / scaling[1]
    elif scaling is not None and scaling[0] == "yarn":
        inv_freq, attention = _yarn_scaled(inv_freq, theta, d, *scaling[1:])
    elif scaling is not None:  # LongRoPE (Phi-3): per-frequency factors, the long ones past the original context
        short, long, original, attention = scaling[1:]
        factors = long if positions.shape[-1] > original else short
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32, device=positions.device) * theta ** exponents)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:
        emb = emb[:, None]  # broadcast over heads
    if attention != 1.0:
        return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths slowed by ``factor``, short kept, smooth between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_scaled(inv_freq: torch.Tensor, theta: float, dims: int, factor: float, beta_fast: float, beta_slow: float,
                 original: int, truncate: bool, attention: float) -> tuple[torch.Tensor, float]:
    """YaRN (GPT-OSS): the frequencies that turn fewer than ``beta_slow`` times over the original
    context are slowed by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp
    between (over the dims those turn counts fall on, as transformers computes it)."""
    def dim_of(turns: float) -> float:
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dims // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left unscaled
    return inv_freq / factor * (1 - kept) + inv_freq * kept, attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions applied to the leading ``cos.shape[-1]`` dims of each head; the rest pass."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :d], x[..., d:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def eager_attention(config: GPTConfig) -> bool:
    """Whether attention runs as Hugging Face's eager attention (its scores held whole) instead of SDPA."""
    return config.attn_softcap is not None or config.attn_sinks


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout | None, config: GPTConfig,
              window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of (B, heads, T, d) queries, keys and values, each example of a packed row
    alone, through a sliding ``window`` when given.  Soft-capped scores (Gemma 2) and ``sinks``
    (GPT-OSS: one logit per head in each query's softmax, then dropped) are computed as Hugging
    Face's eager attention does them; everything else goes through SDPA."""
    t = q.shape[2]
    if layout is not None and layout.packed:  # examples packed in a row see only themselves
        mask = layout.attention_mask(window)
    else:
        mask = causal_mask(t, window, q.device) if window is not None and window < t else None
    if not eager_attention(config):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=config.query_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=config.query_scale)
    scores = (q @ k.transpose(-1, -2)) * (config.query_scale or q.shape[-1] ** -0.5)
    if config.attn_softcap is not None:
        cap = config.attn_softcap
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~(causal_mask(t, None, q.device) if mask is None else mask), float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    b, heads = scores.shape[:2]
    scores = torch.cat([scores, sinks.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, t, 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values  # as transformers: no overflow in 16 bits
    return torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype) @ v


class Block(GPTLayer):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)); with
    ``sandwich_norm`` (Gemma) each branch's output is normed again before it is added
    (``ln1_post``, ``ln2_post``).

    q, k and v share one projection (``qkv``: (heads + 2 * kv_heads) * head_dim outputs); a gated
    MLP's gate and up projections share ``fc`` (gate first).  With ``qk_norm`` each head's queries
    and keys are normalised (``q_norm``, ``k_norm``) before the rotation.  Block ``index`` of the
    layer list (1-based: the embedding is layer 0) knows whether it attends through the sliding
    window, and whether its MLP is a mixture of experts: a ``router`` and every expert's gate | up
    (``experts_fc``) and down (``experts_out``) projections, each stacked into one flat tensor (a
    stage streams them as one buffer), computed as transformers computes Mixtral's and Qwen3-MoE's."""

    kind = "block"

    def __init__(self, config: GPTConfig, index: int = 1) -> None:
        super().__init__(config)
        h, q_width = config.hidden, config.attention_width
        kv_width = config.kv_width  # k and v each
        mlp_out = 2 * config.ffn if config.gated_mlp else config.ffn
        self.window = config.sliding_window if config.is_sliding(index - 1) else None
        self.ln1 = make_norm(config)
        self.qkv = nn.Linear(h, q_width + 2 * kv_width, bias=config.flag("qkv_bias"))
        if config.qk_norm:
            self.q_norm = make_norm(config, config.head_dim)
            self.k_norm = make_norm(config, config.head_dim)
        self.proj = nn.Linear(q_width, h, bias=config.flag("proj_bias"))
        if config.attn_sinks:
            self.sinks = nn.Parameter(torch.empty(config.heads))
        self.ln2 = make_norm(config)
        self.moe = config.is_moe(index - 1)
        if self.moe:
            e, width = config.experts, config.expert_ffn
            self.router = nn.Linear(h, e, bias=config.expert_bias)
            self.experts_fc = nn.Parameter(torch.empty(e * 2 * width, h))
            self.experts_out = nn.Parameter(torch.empty(e * h, width))
            if config.expert_bias:
                self.experts_fc_bias = nn.Parameter(torch.empty(e * 2 * width))
                self.experts_out_bias = nn.Parameter(torch.empty(e * h))
        else:
            self.fc = nn.Linear(h, mlp_out, bias=config.flag("mlp_bias"))
            self.fc_out = nn.Linear(config.ffn, h, bias=config.flag("mlp_bias"))
        if config.sandwich_norm:
            self.ln1_post = make_norm(config)
            self.ln2_post = make_norm(config)

    def norms(self) -> list[nn.Module]:
        names = ("ln1", "ln2", "q_norm", "k_norm", "ln1_post", "ln2_post")
        return [getattr(self, n) for n in names if hasattr(self, n)]

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        """Hidden states (B, T, hidden) -> the block's; or the wire of hidden states and the routers'
        tally (:mod:`mobius.models.router_balance`) -> the wire, this block's routing added."""
        if not balance.is_wire(x):
            return self._forward(x, layout, tallied=False)[0]
        h, tally = balance.unpack(self.config, x)
        y, part = self._forward(h, layout, tallied=True)
        return balance.pack(self.config, y, tally if part is None else tally + part)

    def _forward(self, x: torch.Tensor, layout: TokenLayout | None, tallied: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output, and where ``tallied`` its routing's part of the tally (None: no routing)."""
        c = self.config
        b, t, h = x.shape
        heads, kv, d = c.heads, c.n_kv_heads, c.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([heads * d, kv * d, kv * d], dim=2)
        q = q.view(b, t, heads, d)
        k = k.view(b, t, kv, d)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, kv, d).transpose(1, 2)
        if c.positions == "rope":
            positions = layout.positions if layout is not None and layout.packed else torch.arange(t, device=x.device)
            cos, sin = rotary_tables(c, positions, q.dtype, sliding=self.window is not None)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if kv != heads:
            k = k.repeat_interleave(heads // kv, dim=1)
            v = v.repeat_interleave(heads // kv, dim=1)
        y = attention(q, k, v, layout, c, self.window, self.sinks if c.attn_sinks else None)
        y = self.proj(y.transpose(1, 2).reshape(b, t, heads * d))
        x = x + (self.ln1_post(y) if c.sandwich_norm else y)
        part = None
        if self.moe:
            y, part = self._experts(self.ln2(x), layout, tallied)
        else:
            y = self.fc_out(self._activation(self.fc(self.ln2(x))))
        return x + (self.ln2_post(y) if c.sandwich_norm else y), part

    def _experts(self, x: torch.Tensor, layout: TokenLayout | None, tallied: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mixture of experts: each token's top-k experts by the router's softmax (in fp32),
        their outputs weighted by those probabilities (renormalised where ``norm_topk``) and summed,
        expert by expert in transformers' order.  GPT-OSS softmaxes the k picked logits alone (in
        their dtype) and its experts add biases.  Where ``tallied``: the routing's part of the
        load-balancing tally too (:func:`~mobius.models.router_balance.block_tally`), padding left out."""
        c = self.config
        e, width, h = c.experts, c.expert_ffn, c.hidden
        flat = x.reshape(-1, h)
        logits = self.router(flat)
        fc_bias, out_bias = (self.experts_fc_bias.view(e, 2 * width), self.experts_out_bias.view(e, h)) \
            if c.expert_bias else (None, None)
        if flat.is_meta:  # tracing which weights a layer reads (no values to route by): all of them, as a whole
            z = F.linear(flat, self.experts_fc)[:, :width]
            y = F.linear(z if fc_bias is None else z + fc_bias.sum(), self.experts_out)[:, :h]
            return (y if out_bias is None else y + out_bias.sum()).view_as(x), None
        if c.topk_then_softmax:
            weights, chosen = torch.topk(logits, c.experts_per_token, dim=-1)
            weights = torch.softmax(weights, dim=-1, dtype=weights.dtype)
        else:
            weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), c.experts_per_token, dim=-1)
            if c.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(logits.dtype)
        fc, out = self.experts_fc.view(e, 2 * width, h), self.experts_out.view(e, h, width)
        fc_lora, out_lora = getattr(self, "experts_fc_lora", None), getattr(self, "experts_out_lora", None)
        y = torch.zeros_like(flat)
        for j in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == j)
            x_j = flat[token]
            z = F.linear(x_j, fc[j], None if fc_bias is None else fc_bias[j])
            if fc_lora is not None:
                z = z + fc_lora(x_j, j)
            a = self._activation(z)
            part = F.linear(a, out[j], None if out_bias is None else out_bias[j])
            if out_lora is not None:
                part = part + out_lora(a, j)
            y.index_add_(0, token, (part * weights[token, slot, None]).to(y.dtype))
        real = layout.real if layout is not None else None
        tally = balance.block_tally(c, logits, chosen, real) if tallied else None
        return y.view_as(x), tally

    def _activation(self, z: torch.Tensor) -> torch.Tensor:
        kind = self.config.mlp
        if kind == "swiglu" and self.config.swiglu_limit is not None:  # GPT-OSS's clamped SwiGLU
            gate, up = z.chunk(2, dim=-1)
            limit = self.config.swiglu_limit
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return gate * torch.sigmoid(gate * self.config.swiglu_alpha) * (up + 1)
        if kind == "swiglu":
            gate, up = z.chunk(2, dim=-1)
            return F.silu(gate) * up
        if kind == "geglu":
            gate, up = z.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if kind == "relu":
            return F.relu(z)
        return F.gelu(z, approximate="tanh" if kind == "gelu_tanh" else "none")

    def forward_flops(self, batch: int, seq: int) -> int:
        # 2 FLOPs per weight a token computes with (of the experts, the k it is routed to); QK^T and
        # AV: 2 * 2 b t^2 h.
        weights = sum(m.weight.numel() for m in (self.qkv, self.proj))
        if self.moe:
            c = self.config
            weights += self.router.weight.numel() + 3 * c.experts_per_token * c.hidden * c.expert_ffn
        else:
            weights += self.fc.weight.numel() + self.fc_out.weight.numel()
        return 2 * batch * seq * weights + 4 * batch * seq * seq * self.config.attention_width

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        # Saved tensors of one block with fused attention: about 17 b*t*h elements for a 4h MLP
        # (inputs of ln1, qkv, attention out, proj, ln2, fc, gelu (4h each), fc_out).
        c = self.config
        h = c.hidden
        # A mixture saves its k experts' gate | up of each token, and the router's fp32 softmax.
        mlp = 2 * c.experts_per_token * 2 * c.expert_ffn + 4 * c.experts if self.moe else 2 * self.fc.out_features
        # Eager attention keeps its scores and their softmax (fp32 without sinks), every head's T x T.
        scores = c.heads * seq * (2 if c.attn_sinks else 3) if eager_attention(c) else 0
        return (9 * h + mlp + scores) * batch * seq * dtype.itemsize

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # In this order (a preset's weights are the draws' sequence): the inputs' projections, then
        # the residual ones, scaled by 1/sqrt(2 * n_layer) as GPT-2's.
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        mlp_in, mlp_out = ((self.router.weight, self.experts_fc), (self.experts_out,)) if self.moe else \
            ((self.fc.weight,), (self.fc_out.weight,))
        for w in (self.qkv.weight, *mlp_in):
            nn.init.normal_(w, std=0.02, generator=generator)
        for w in (self.proj.weight, *mlp_out):
            nn.init.normal_(w, std=std, generator=generator)
        for lin in (self.qkv, self.proj) + ((self.router,) if self.moe else (self.fc, self.fc_out)):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.moe and self.config.expert_bias:
            nn.init.zeros_(self.experts_fc_bias)
            nn.init.zeros_(self.experts_out_bias)
        if self.config.attn_sinks:
            nn.init.zeros_(self.sinks)
        for ln in self.norms():
            ln.reset_parameters()


# The head's loss walks the tokens in chunks whose fp32 logits take at most this many bytes, so a
# 128k vocabulary at 32k tokens never holds its 17 GB of logits at once.
CE_CHUNK_BYTES = 2**28


def ce_chunk_tokens(vocab_size: int) -> int:
    return max(1, CE_CHUNK_BYTES // (4 * vocab_size))


class WeightGradSum:
    """The LM head's weight gradient, summed over the micro-batches whose forward ran since a
    backward last took it (:class:`ChunkedCrossEntropy`).

    The pipeline runs a stage's forward for every micro-batch before any backward: a weight
    gradient per micro-batch would hold M copies of the head's weights (M x 822 MB in fp32 for
    Llama-3.1-8B's head) from forward to backward; one running sum holds one.  The first backward
    to arrive takes the sum (scaled by its incoming gradient, the loss scale, which is the same for
    every micro-batch of a step) and the others add nothing; with forward and backward alternating
    (the reference trainer, recomputation) each backward takes its own micro-batch's."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h @ weight.T`` against ``targets``, divided by ``divisor``, over
    chunks of tokens: only one chunk's logits exist at a time.  The loss is the last operation of
    the model, so when gradients will be wanted forward also computes them, chunk by chunk, in fp32
    (one logits matmul per chunk, as plain autograd would do, not two): the input's (``need_h``)
    and the weight's, into ``weight_grads`` (None: the weight is frozen).  Backward only scales
    them by the incoming gradient (the loss scale, in fp16) before casting."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, need_h: bool,
                weight_grads: WeightGradSum | None, divisor: int, softcap: float | None = None) -> torch.Tensor:
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = h.new_empty(h.shape, dtype=torch.float32) if need_h else None
        grad_w, created = None, False
        if weight_grads is not None:
            created = weight_grads.total is None
            if created:
                weight_grads.total = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
            grad_w = weight_grads.total
        for a in range(0, n, chunk):
            hc, tc = h[a:a + chunk], targets[a:a + chunk]
            logits = (hc @ weight.t()).float()
            if softcap is not None:  # cap * tanh(z / cap) (Gemma 2); d/dz = 1 - tanh^2
                capped = torch.tanh(logits.div_(softcap))
                logits = capped * softcap
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            rows = torch.arange(hc.shape[0], device=h.device)
            total -= logp[rows, tc].sum()
            if need_h or grad_w is not None:  # d loss / d logits = (softmax - one-hot) / divisor, in logp's memory
                p = logp.exp_()
                p[rows, tc] -= 1.0
                if softcap is not None:
                    p.mul_(1.0 - capped.square_())
                p = p.div_(divisor).to(h.dtype)
                if need_h:
                    grad_h[a:a + chunk] = p @ weight
                # Accumulated in place: an fp32 temporary per chunk would be a second copy of the
                # head's gradient on the device (206 MB for GPT-2 medium); in bf16 the product
                # needs one, at half that size, to be added in fp32.
                if grad_w is not None and p.dtype == torch.float32:
                    grad_w.addmm_(p.t(), hc)
                elif grad_w is not None:
                    grad_w.add_(p.t() @ hc)
        # Saved (and so accounted as this micro-batch's, by the runtime and the profiler): the
        # input's gradient, and the weight's sum by the forward that started it.
        ctx.save_for_backward(*(t for t in (grad_h, grad_w if created else None) if t is not None))
        ctx.need_h, ctx.weight_grads, ctx.dtypes = need_h, weight_grads, (h.dtype, weight.dtype)
        return total / divisor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.float()
        # Scaled in place (these buffers are this call's own), then cast to the inputs' dtypes.
        grad_h = ctx.saved_tensors[0].mul_(grad).to(ctx.dtypes[0]) if ctx.need_h else None
        grad_w, sums = None, ctx.weight_grads
        if sums is not None and sums.total is not None:  # the first backward since those forwards
            grad_w, sums.total = sums.total.mul_(grad).to(ctx.dtypes[1]), None
        return grad_h, grad_w, None, None, None, None, None, None


class Head(GPTLayer):
    """Final norm, LM head and the cross-entropy of the micro-batch's trained tokens, summed and
    divided by the step's trained tokens (:mod:`mobius.models.layout`), computed in token chunks
    (:class:`ChunkedCrossEntropy`) without ever holding the full logits."""

    kind = "head"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.weight_grads = WeightGradSum()

    def forward(self, x: torch.Tensor, layout: TokenLayout | torch.Tensor) -> torch.Tensor:
        """``layout``: the micro-batch's :class:`TokenLayout`, or its targets alone (every token trained).
        From the wire (:mod:`mobius.models.router_balance`): plus the routers' load-balancing loss,
        its coefficient times the micro-batch's share of the step's mean."""
        layout = as_layout(layout)
        if balance.is_wire(x):
            x, tally = balance.unpack(self.config, x)
            aux = balance.balance_loss(self.config, tally) * (self.config.router_aux_loss_coef * layout.balance_share)
            return self._loss(x, layout) + aux
        return self._loss(x, layout)

    def _loss(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        h = self.ln_f(x).reshape(-1, x.shape[-1])
        targets = layout.targets.reshape(-1)
        sides = None if layout.pairs is None else layout.pairs.sides.reshape(-1)
        if not layout.every_target_trained:  # prompts and padding: only the trained rows reach the head
            trained = targets != IGNORE
            h, targets = h[trained], targets[trained]
            sides = None if sides is None else sides[trained]
        weight = self.lm_head.weight
        chunk = ce_chunk_tokens(self.config.vocab_size)
        kind, cap = h.device.type, self.config.logit_softcap
        autocast = kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)
        # The loss runs its matmuls itself: under autocast, it is handed the autocast dtype.
        dtype = torch.get_autocast_dtype(kind) if autocast else h.dtype
        with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
            h, weight = h.to(dtype), weight.to(dtype)
            if layout.pairs is not None:
                return pair_loss(h, weight, targets, sides, layout.pairs, chunk, cap)
            grads = torch.is_grad_enabled()
            need_h = grads and h.requires_grad
            sums = self.weight_grads if grads and self.lm_head.weight.requires_grad else None
            divisor = layout.loss_tokens or max(1, targets.numel())
            return ChunkedCrossEntropy.apply(h, weight, targets, chunk, need_h, sums, divisor, cap)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if balance.is_wire(x):
            x = balance.unpack(self.config, x)[0]
        z = self.lm_head(self.ln_f(x))
        cap = self.config.logit_softcap
        return z if cap is None else torch.tanh(z / cap) * cap

    def forward_flops(self, batch: int, seq: int) -> int:
        return 2 * batch * seq * self.config.hidden * self.config.vocab_size

    def output_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        return 4  # the scalar loss

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        # The fp32 gradient of its input the loss computes in forward, and one chunk of logits: in
        # the compute dtype, their fp32 copy and the softmax (the weight's: :meth:`held_bytes`).
        tokens, vocab, hidden = batch * seq, self.config.vocab_size, self.config.hidden
        chunk = min(tokens, ce_chunk_tokens(vocab))
        capped = 4 if self.config.logit_softcap is not None else 0  # the chunk's tanh, kept for its gradient
        return tokens * hidden * 4 + chunk * vocab * (dtype.itemsize + 8 + capped)

    def held_bytes(self) -> int:
        # The fp32 sum of the LM head's weight gradient over a stage's micro-batches (WeightGradSum).
        return self.lm_head.weight.numel() * 4 if self.lm_head.weight.requires_grad else 0

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.ln_f.reset_parameters()
        nn.init.normal_(self.lm_head.weight, std=0.02, generator=generator)


class _NothingDrawn(TorchFunctionMode):
    """Random initialisation skipped while a layer is constructed.  On the meta device there is
    nothing to draw into, and torch draws meta tensors through its Python references, whose first
    use imports the compiler stack (most of a second, in every process that describes a model).  A
    layer initialised from its seed draws every drawn weight again in ``reset_parameters``: the
    constructors' draws were half the time of building a model (a minute for 3.4B parameters)."""

    DRAWS = (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.trunc_normal_,
             nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_normal_,
             torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DRAWS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_layer(config: GPTConfig, index: int, seed: int, device: str | torch.device = "cpu") -> GPTLayer:
    """Layer ``index`` of the list, initialised from ``(seed, index)`` alone.

    Seeding per layer lets every pipeline worker build exactly the layers it owns and still get
    the weights the single-device trainer gets.
    """
    n = layer_count(config)
    if not 0 <= index < n:
        raise IndexError(index)
    cls = Embedding if index == 0 else Head if index == n - 1 else Block
    device = torch.device(device)
    seeded = device.type != "meta" and not config.checkpoint  # initialised from (seed, index) below
    if device.type != "meta" and not config.runnable:
        raise InputError(
            f"hidden size {config.hidden} is not divisible by {config.heads} heads: "
            "this preset can be planned (meta device) but not run"
        )
    with torch.device(device), _NothingDrawn() if device.type == "meta" or seeded else contextlib.nullcontext():
        layer = Block(config, index) if cls is Block else cls(config)
    if device.type != "meta" and config.checkpoint:
        load_layer_weights(config, index, layer)
    elif seeded:
        # The layer's own generator, not the global one: the global stream stays untouched, and
        # layers can be built at once on several threads (:func:`built_layers`).
        generator = torch.Generator(device).manual_seed(seed * 100_003 + index)
        with torch.no_grad():
            layer.reset_parameters(generator)
            if cls is Head and config.tie_embeddings:
                # Same values as the embedding's token table (built from the embedding's seed).
                layer.lm_head.weight.copy_(build_layer(config, 0, seed).wte.weight)
    if config.lora_rank:
        if cls is Block:
            if config.lora_4bit:  # quantized from the weights just built or read
                quantize_projections(layer, LORA_MODULES, lambda name: parts(config, name))
            add_lora(layer, config, None if device.type == "meta" else seed * 100_003 + index, index)
        else:
            freeze(layer)
    return layer


class LayerList(nn.Module):
    """The whole model as ``nn.ModuleList`` of layers, run in sequence."""

    def __init__(self, config: GPTConfig, layers: list[GPTLayer]) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        if config.tie_embeddings:
            self.layers[-1].lm_head.weight = self.layers[0].wte.weight

    def forward(self, tokens: torch.Tensor, layout: TokenLayout | torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss; ``layout``: its :class:`TokenLayout`, or its targets alone."""
        return run_layers(self.layers, tokens, as_layout(layout))

    def logits(self, tokens: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        x = tokens
        for layer in self.layers[:-1]:
            x = layer(x, layout)
        return self.layers[-1].logits(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once


def run_layers(layers, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Run consecutive layers of the list (a stage, or the whole model) on one micro-batch."""
    for layer in layers:
        x = layer(x, layout)
    return x


def built_layers(config: GPTConfig, indices, seed: int, device: str | torch.device = "cpu") -> Iterator[GPTLayer]:
    """Layers ``indices`` in order, each as :func:`build_layer` makes it, drawn on a thread per core
    this process has (a draw holds one core and lets the others run).  At most that many are built
    ahead of the one handed out, so a caller that keeps one layer at a time holds a few."""
    indices = list(indices)
    threads = min(len(indices), torch.get_num_threads())
    if threads <= 1 or torch.device(device).type == "meta":
        yield from (build_layer(config, i, seed, device) for i in indices)
        return
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for i in indices:
            pending.append(pool.submit(build_layer, config, i, seed, device))
            if len(pending) == threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def build_model(config: GPTConfig, seed: int = 0, device: str | torch.device = "cpu") -> LayerList:
    return LayerList(config, list(built_layers(config, range(layer_count(config)), seed, device)))


def tied_parameter_names(config: GPTConfig) -> dict[str, str]:
    """Layer-local parameter names that alias another layer's parameter: {alias: canonical}."""
    if not config.tie_embeddings:
        return {}
    return {f"layers.{layer_count(config) - 1}.lm_head.weight": "layers.0.wte.weight"}
