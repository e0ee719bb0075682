"""A GPT written as an ordered list of layers.

``embedding -> N transformer blocks -> final norm + LM head + loss``.  The list is the contract
the profiler, the partitioner and the stage builder consume: every layer reports its parameter
bytes, forward FLOPs and output size for a micro-batch without running (so a 51B model can be
described on the meta device and planned on a laptop).

Blocks are pre-LayerNorm with causal attention through ``scaled_dot_product_attention`` and a GELU
MLP; there is no dropout (fine-tuning runs are compared bitwise against the reference trainer).

Tied embeddings are handled explicitly: with ``tie_embeddings`` the head's output projection *is*
the embedding's token table.  On one device that is one Parameter used twice, so autograd sums its
gradient over both uses.  When the embedding and the head sit in different pipeline stages each
stage holds a copy and the runtime sums the two gradients before the (identical) update; see
:func:`tied_parameter_names`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mobius.errors import InputError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    context: int
    n_layer: int
    hidden: int
    heads: int
    bias: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    @property
    def runnable(self) -> bool:
        """Table 3 prints 80 heads for h=9216, which do not divide it: plan-only, not runnable."""
        return self.hidden % self.heads == 0

    def to_dict(self) -> dict:
        return asdict(self)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class GPTLayer(nn.Module):
    """One element of the layer list; subclasses say what they cost without running."""

    kind = "layer"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config

    def param_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of this layer's parameters (a tied weight counts: the stage must hold it)."""
        return sum(p.numel() for p in self.parameters()) * dtype_bytes(dtype)

    def forward_flops(self, batch: int, seq: int) -> int:
        raise NotImplementedError

    def output_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        return batch * seq * self.config.hidden * dtype_bytes(dtype)

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        """Activation memory autograd keeps while this layer runs forward with gradients."""
        return self.output_bytes(batch, seq, dtype)

    def signature(self) -> tuple:
        """Layers with equal signatures are interchangeable for profiling (layer similarity)."""
        return (self.kind, tuple((n, tuple(p.shape)) for n, p in self.named_parameters()))


class Embedding(GPTLayer):
    kind = "embedding"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.context, config.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)

    def forward_flops(self, batch: int, seq: int) -> int:
        return batch * seq * self.config.hidden  # the position add; the lookup is a gather

    def reset_parameters(self) -> None:
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)


class Block(GPTLayer):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    kind = "block"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        h, bias = config.hidden, config.bias
        self.ln1 = nn.LayerNorm(h, eps=config.norm_eps, bias=bias)
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.ln2 = nn.LayerNorm(h, eps=config.norm_eps, bias=bias)
        self.fc = nn.Linear(h, 4 * h, bias=bias)
        self.fc_out = nn.Linear(4 * h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        heads = self.config.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, heads, h // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    def forward_flops(self, batch: int, seq: int) -> int:
        h = self.config.hidden
        # 12h^2 weights -> 24 b t h^2 multiply-adds*2; QK^T and AV: 2 * 2 b t^2 h.
        return 24 * batch * seq * h * h + 4 * batch * seq * seq * h

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        # Saved tensors of one block with fused attention: about 17 b*t*h elements
        # (inputs of ln1, qkv, attention out, proj, ln2, fc, gelu (4h each), fc_out).
        return 17 * batch * seq * self.config.hidden * dtype_bytes(dtype)

    def reset_parameters(self) -> None:
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, std=0.02)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer).
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for lin in (self.proj, self.fc_out):
            nn.init.normal_(lin.weight, std=std)
        for lin in (self.qkv, self.proj, self.fc, self.fc_out):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for ln in (self.ln1, self.ln2):
            ln.reset_parameters()


class Head(GPTLayer):
    """Final LayerNorm, LM head and the mean cross-entropy over the micro-batch's tokens."""

    kind = "head"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def forward_flops(self, batch: int, seq: int) -> int:
        return 2 * batch * seq * self.config.hidden * self.config.vocab_size

    def output_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        return 4  # the scalar loss

    def working_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
        # logits in the compute dtype plus their fp32 copy for the loss
        return batch * seq * self.config.vocab_size * (dtype_bytes(dtype) + 4)

    def reset_parameters(self) -> None:
        self.ln_f.reset_parameters()
        nn.init.normal_(self.lm_head.weight, std=0.02)


def layer_count(config: GPTConfig) -> int:
    return config.n_layer + 2


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
    if device.type != "meta" and not config.runnable:
        raise InputError(
            f"hidden size {config.hidden} is not divisible by {config.heads} heads: "
            "this preset can be planned (meta device) but not run"
        )
    with torch.device(device):
        layer = cls(config)
    if device.type != "meta":
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed * 100_003 + index)
        with torch.no_grad():
            layer.reset_parameters()
            if cls is Head and config.tie_embeddings:
                # Same values as the embedding's token table (built from the embedding's seed).
                layer.lm_head.weight.copy_(build_layer(config, 0, seed).wte.weight)
        torch.random.set_rng_state(gen_state)
    return layer


class LayerList(nn.Module):
    """The whole model as ``nn.ModuleList`` of layers, run in sequence."""

    def __init__(self, config: GPTConfig, layers: list[GPTLayer]) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        if config.tie_embeddings:
            self.layers[-1].lm_head.weight = self.layers[0].wte.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers[:-1]:
            x = layer(x)
        return self.layers[-1](x, targets)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers[:-1]:
            x = layer(x)
        return self.layers[-1].logits(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once


def build_model(config: GPTConfig, seed: int = 0, device: str | torch.device = "cpu") -> LayerList:
    return LayerList(config, [build_layer(config, i, seed, device) for i in range(layer_count(config))])


def tied_parameter_names(config: GPTConfig) -> dict[str, str]:
    """Layer-local parameter names that alias another layer's parameter: {alias: canonical}."""
    if not config.tie_embeddings:
        return {}
    return {f"layers.{layer_count(config) - 1}.lm_head.weight": "layers.0.wte.weight"}
