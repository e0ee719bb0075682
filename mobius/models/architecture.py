"""The shape of a decoder-only transformer (:class:`GPTConfig`) and of its layer list: what the
presets, the Hugging Face reader and the model itself share."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True)
class GPTConfig:
    """Shape and flavour of a decoder-only transformer.

    The defaults are this project's GPT (LayerNorm, learned positions, GELU MLP).  The other
    fields describe the Hugging Face families we load: GPT-2 (tanh GELU, biases), OPT (ReLU,
    position offset 2), Llama/Mistral/Qwen2 (RMSNorm, rotary positions, SwiGLU, grouped-query
    attention, optional q/k/v biases, Mistral's sliding window), Qwen3 (a head size of its own,
    RMSNorm of each head's queries and keys), Phi-3 (rotation of part of each head, LongRoPE) and
    Gemma 2 and 3 (scaled embeddings, (1 + w) RMSNorms before and after attention and MLP, GeGLU,
    a query scale of their own, soft-capped scores and logits, local sliding-window layers between
    global ones, each kind with its own rotary base); Mixtral and Qwen3-MoE are Mistral and Qwen3 whose
    MLPs are mixtures of experts; GPT-OSS adds attention sinks, biased experts behind a top-k-then-softmax
    router, a clamped SwiGLU and YaRN-scaled rotary positions.
    """

    vocab_size: int
    context: int
    n_layer: int
    hidden: int
    heads: int
    bias: bool = False  # default for every bias below that is left as None
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    norm: str = "layernorm"  # layernorm | rmsnorm | rmsnorm_gemma (in fp32, scaled by 1 + weight)
    mlp: str = "gelu"  # gelu | gelu_tanh | relu | swiglu | geglu (tanh GELU of the gate, times up)
    intermediate: int | None = None  # MLP width (default 4 * hidden)
    kv_heads: int | None = None  # grouped-query attention (default: heads)
    head_size: int | None = None  # per attention head (default: hidden / heads; Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before the rotation (Qwen3)
    positions: str = "learned"  # learned | rope
    position_offset: int = 0  # OPT's learned positions start at index 2
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_context) | ("linear", factor) |
    # ("longrope", short_factors, long_factors, original_context, attention_factor) |
    # ("yarn", factor, beta_fast, beta_slow, original_context, truncate, attention_factor)
    rope_scaling: tuple | None = None
    rotary_dims: int | None = None  # the leading dims of each head that rotate (default: all; Phi-4-mini 3/4)
    embed_scale: bool = False  # token embeddings times sqrt(hidden), in the weights' dtype (Gemma)
    sandwich_norm: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    query_scale: float | None = None  # attention scores' scale (default 1 / sqrt(head_dim))
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) before the mask (Gemma 2)
    logit_softcap: float | None = None  # the same for the LM head's logits (Gemma 2)
    sliding_window: int | None = None  # a sliding layer's query sees the last `sliding_window` tokens
    sliding_layers: tuple = ()  # the blocks (0-based) with sliding-window attention
    local_rope_theta: float | None = None  # the sliding blocks' rotary base, without scaling (Gemma 3)
    # A learned logit per head that joins every query's softmax and is then dropped, so a query may
    # attend to nothing (GPT-OSS's sinks).
    attn_sinks: bool = False
    qkv_bias: bool | None = None
    proj_bias: bool | None = None
    mlp_bias: bool | None = None
    norm_bias: bool | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): each MoE block's MLP is ``experts`` gated MLPs of width
    # ``expert_intermediate``, ``experts_per_token`` of them per token, picked by a linear router's
    # softmax (renormalised over the picked ones where ``norm_topk``); the blocks in ``dense_blocks``
    # (0-based) keep a dense MLP.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int | None = None
    norm_topk: bool = False
    dense_blocks: tuple = ()
    # GPT-OSS's mixture: the router has a bias and softmaxes only the top-k logits it picked; every
    # expert's projections have biases; its SwiGLU clamps the gate above and the up projection both
    # ways at ``swiglu_limit`` and computes gate * sigmoid(alpha * gate) * (up + 1).
    topk_then_softmax: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # The routers' load-balancing loss (transformers' output_router_logits) with this coefficient;
    # 0: off (mobius.models.router_balance).
    router_aux_loss_coef: float = 0.0
    checkpoint: str | None = None  # a Hugging Face directory the weights are loaded from
    # its model_type (gpt2, opt, llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, gemma3, mixtral,
    # qwen3_moe, gpt_oss)
    hf_arch: str | None = None
    # LoRA (mobius.models.lora): rank 0 trains every weight; else only adapters on the projections
    # named in lora_targets train, the base weights are frozen.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0  # on the adapters' input, in training steps (mobius.models.lora)
    lora_dora: bool = False  # DoRA: each output's magnitude trained apart from the adapted direction
    lora_4bit: bool = False  # QLoRA: every block's projections a frozen NF4 base (mobius.models.quant)

    def shape_problem(self) -> str | None:
        """Why this shape cannot run, or None.  (Table 3 prints 80 heads for h=9216, which do not
        divide it: ``mobius-51b`` is plannable from its sizes, not runnable.)"""
        for name in ("vocab_size", "context", "n_layer", "hidden", "heads", "n_kv_heads", "ffn"):
            if getattr(self, name) < 1:
                return f"{name} must be positive, got {getattr(self, name)}"
        if self.head_size is None and self.hidden % self.heads:
            return f"hidden size {self.hidden} is not divisible by {self.heads} attention heads"
        if self.heads % self.n_kv_heads:
            return f"{self.heads} attention heads are not divisible by {self.n_kv_heads} key-value heads"
        return None

    @property
    def runnable(self) -> bool:
        return self.shape_problem() is None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """The queries' width (all heads), which the output projection maps back to ``hidden``."""
        return self.heads * self.head_size if self.head_size else self.hidden

    @property
    def kv_width(self) -> int:
        """The keys' width (and the values'): all key-value heads."""
        return self.attention_width * self.n_kv_heads // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def gated_mlp(self) -> bool:
        """The MLP's input projection is gate | up (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has a mixture of experts for its MLP."""
        return self.experts > 0 and block not in self.dense_blocks

    @property
    def expert_ffn(self) -> int:
        return self.expert_intermediate or self.ffn

    def is_sliding(self, block: int) -> bool:
        """Whether block ``block`` (0-based) attends through the sliding window."""
        return self.sliding_window is not None and block in self.sliding_layers

    def flag(self, name: str) -> bool:
        value = getattr(self, name)
        return self.bias if value is None else value

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def defaults(cls) -> dict:
        """The fields that have a default, with it (those a shape may leave out)."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def layer_count(config: GPTConfig) -> int:
    return config.n_layer + 2
