"""Hugging Face model directories in and out: GPT-2, OPT and the Llama family (Llama, Mistral,
Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3: text-only, or the language model of the checkpoint with
its vision tower, whose tensors an export carries unchanged).

A directory (``config.json`` + ``*.safetensors`` [+ ``tokenizer.json``]) becomes a
:class:`GPTConfig` with ``checkpoint`` set.  :func:`mobius.models.gpt.build_layer` then fills each
layer from the safetensors files, reading only that layer's tensors.  Weights are streamed layer by
layer and never held twice.  Nothing here touches the network, and ``transformers`` is not needed.

Each family maps its tensor names onto our layer list (see :func:`_layer_map`):

* GPT-2 stores ``Conv1D`` weights as (in, out): they are transposed.  ``c_attn`` is already q|k|v.
* OPT, Llama and Gemma store q, k and v separately: they are concatenated into our ``qkv`` (and
  split again on export).  Their gate and up projections go into our ``fc`` the same way.  Phi-3
  stores both fused already.

Export writes the same tensor names, dtypes and shapes the directory had (tensors we do not train,
such as GPT-2's old attention-mask buffers, are copied through), plus config, generation config and
tokenizer files.  Exporting an untrained model reproduces the input tensors exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mobius.boundary import ownership
from mobius.boundary.checks import REQUIRED, Fields, read_json
from mobius.boundary.errors import InputError
from mobius.models.architecture import GPTConfig, layer_count

# Rotary positions, RMSNorm, a gated MLP and grouped-query attention, each with a twist or two.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                "gpt_oss")
MIXTURES = ("mixtral", "qwen3_moe", "gpt_oss")  # their MLPs mixtures of experts
GEMMA = ("gemma2", "gemma3_text")
# What a family's config.json may leave out, as transformers' config classes default it.
DEFAULT_THETA = {"gemma3_text": 1e6, "gpt_oss": 150000.0}
DEFAULT_WINDOW = {"gemma2": 4096, "gemma3_text": 4096, "gpt_oss": 128}
SUPPORTED = ("gpt2", "opt", *LLAMA_FAMILY, "gemma3")
# Gemma 3 with its vision tower stores only what differs from these in its text_config
# (transformers' Gemma3TextConfig defaults: the 4B model's shape).
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                        "sliding_window": 4096, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
# Gemma 3's tensors outside the language model, carried through exports unchanged.
PASSTHROUGH_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")
# No size in a config exceeds these: the largest models have about 10^2 layers, 10^5 widths and
# 10^6 positions; a typo of 10^7 must be refused at once, not built layer by layer.
MAX_LAYERS = 2**14
MAX_SIZE = 2**24
# What a model directory holds besides its weights that an export must carry: the config, the
# generation settings, every tokenizer file and the chat template.
TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
COPIED_FILES = ("config.json", *TOKENIZER_FILES)


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_config(path: str) -> Fields:
    source = f"--model {path}: config.json"
    return Fields(read_json(Path(path, "config.json"), source), source)


def load_hf_config(path: str, weights: bool = True) -> GPTConfig:
    """Our config for a Hugging Face directory (``weights=False``: config.json alone, for planning).
    Every value is type- and range-checked here, so a bad config is one line naming the key."""
    c = _read_config(path)
    kind = c.get("model_type", "str")
    if kind not in SUPPORTED:
        raise InputError(f"--model {path}: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    common = {"checkpoint": os.path.abspath(path) if weights else None, "hf_arch": kind}
    if kind == "gemma3":  # the language model of Gemma 3 with its vision tower (which exports unchanged)
        text = {**GEMMA3_TEXT_DEFAULTS, **c.get("text_config", "dict", {})}
        c, kind = Fields(text, f"--model {path}: config.json text_config"), "gemma3_text"

    def size(key: str, default=REQUIRED):
        value = c.get(key, "int", default, minimum=1)
        most = MAX_LAYERS if key in ("n_layer", "num_hidden_layers") else MAX_SIZE
        if value is not None and value > most:  # checked before anything is built from it
            raise InputError(f"--model {path}: config.json {key} = {value} is beyond any model that can be built "
                             f"(at most {most:,})")
        return value

    if kind == "gpt2":
        config = GPTConfig(vocab_size=size("vocab_size"), context=size("n_positions"), n_layer=size("n_layer"),
                           hidden=size("n_embd"), heads=size("n_head"), bias=True,
                           tie_embeddings=c.get("tie_word_embeddings", "bool", True),
                           norm_eps=c.get("layer_norm_epsilon", "number", 1e-5, minimum=0),
                           mlp=_gpt2_activation(c, path), intermediate=size("n_inner", None), **common)
    elif kind == "opt":
        hidden = size("hidden_size")
        if not c.get("do_layer_norm_before", "bool", True):
            _unsupported(path, "post-LayerNorm OPT (opt-350m)")
        if c.get("word_embed_proj_dim", "int", hidden) != hidden:
            _unsupported(path, "OPT with project_in/out (word_embed_proj_dim)")
        if c.get("activation_function", "str", "relu") != "relu":
            _unsupported(path, f"OPT activation {c.get('activation_function', 'str')!r}")
        config = GPTConfig(vocab_size=size("vocab_size"), context=size("max_position_embeddings"),
                           n_layer=size("num_hidden_layers"), hidden=hidden, heads=size("num_attention_heads"),
                           bias=c.get("enable_bias", "bool", True), tie_embeddings=c.get("tie_word_embeddings", "bool", True),
                           mlp="relu", intermediate=size("ffn_dim"), position_offset=2, **common)
    else:
        config = _llama_family(c, path, kind, size, common)
    problem = config.shape_problem()
    if problem:
        raise InputError(f"--model {path}: config.json: {problem}")
    return config


def _unsupported(path: str, what: str):
    raise InputError(f"--model {path}: {what} is not supported")


def _llama_family(c: Fields, path: str, kind: str, size, common: dict) -> GPTConfig:
    """Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 (text) from their config.json."""
    heads, hidden, n_layer = size("num_attention_heads"), size("hidden_size"), size("num_hidden_layers")
    head_size = size("head_dim", None)
    if head_size is None and hidden % heads:
        raise InputError(f"--model {path}: config.json: hidden_size {hidden} is not divisible by "
                         f"num_attention_heads {heads}")
    head_dim = head_size or hidden // heads
    gemma = kind in GEMMA
    act = (c.get("hidden_activation", "str", None) if gemma else None) or c.get("hidden_act", "str", "silu")
    if act not in (("gelu_pytorch_tanh", "gelu_new") if gemma else ("silu",)):
        _unsupported(path, f"hidden_act {act!r} for {kind}")
    rope_parameters = c.get("rope_parameters", "dict", {})
    rope = Fields(rope_parameters, f"--model {path}: config.json rope_parameters")
    partial = c.get("partial_rotary_factor", "number", rope.get("partial_rotary_factor", "number", 1.0), minimum=1e-9)
    rotary_dims = int(head_dim * partial)
    if rotary_dims % 2 or not 0 < rotary_dims <= head_dim:
        raise InputError(f"--model {path}: config.json: partial_rotary_factor {partial:g} of head size {head_dim} "
                         f"gives {rotary_dims} rotated dims, not an even number in 2..{head_dim}")
    local_theta = None
    if kind == "gemma3_text":  # a global base (scaled) and a local one, in either layout of config.json
        if "full_attention" in rope:
            rope = Fields(rope.get("full_attention", "dict"),
                          f"--model {path}: config.json rope_parameters.full_attention")
            local = Fields(rope_parameters.get("sliding_attention") or {},
                           f"--model {path}: config.json rope_parameters.sliding_attention")
            local_theta = local.get("rope_theta", "number", 10000.0, minimum=1e-9)
        else:
            local_theta = c.get("rope_local_base_freq", "number", 10000.0, minimum=1e-9)
    theta = c.get("rope_theta", "number", rope.get("rope_theta", "number", DEFAULT_THETA.get(kind, 10000.0)),
                  minimum=1e-9)
    scaling = c.get("rope_scaling", "dict", None)
    if scaling is None and rope.get("rope_type", "str", "default") != "default":
        scaling = rope.obj
    window, sliding = _sliding_layers(c, path, kind, n_layer)
    if c.get("use_bidirectional_attention", "bool", False):
        _unsupported(path, "bidirectional attention (use_bidirectional_attention)")
    attn_bias = c.get("attention_bias", "bool", kind == "gpt_oss")
    moe = _mixture(c, path, kind, n_layer, size) if kind in MIXTURES else {}
    query_scalar = c.get("query_pre_attn_scalar", "number", None, minimum=1e-9) if gemma else None
    return GPTConfig(vocab_size=size("vocab_size"), context=size("max_position_embeddings"), n_layer=n_layer,
                     hidden=hidden, heads=heads, kv_heads=size("num_key_value_heads", heads),
                     intermediate=size("intermediate_size"), norm="rmsnorm_gemma" if gemma else "rmsnorm",
                     norm_eps=c.get("rms_norm_eps", "number", 1e-6, minimum=0), mlp="geglu" if gemma else "swiglu",
                     positions="rope", rope_theta=theta, local_rope_theta=local_theta,
                     rope_scaling=_rope_scaling(c, path, kind, scaling, rotary_dims) if scaling else None,
                     rotary_dims=rotary_dims if rotary_dims != head_dim else None,
                     tie_embeddings=c.get("tie_word_embeddings", "bool", gemma),
                     head_size=head_size if head_size != hidden // heads else None,
                     qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
                     qkv_bias=True if kind == "qwen2" else attn_bias, proj_bias=attn_bias,
                     mlp_bias=c.get("mlp_bias", "bool", False), embed_scale=gemma, sandwich_norm=gemma,
                     query_scale=query_scalar ** -0.5 if query_scalar else None,
                     attn_softcap=c.get("attn_logit_softcapping", "number", None, minimum=1e-9) if gemma else None,
                     logit_softcap=c.get("final_logit_softcapping", "number", None, minimum=1e-9) if gemma else None,
                     sliding_window=window, sliding_layers=sliding, attn_sinks=kind == "gpt_oss", **moe, **common)


def _mixture(c: Fields, path: str, kind: str, n_layer: int, size) -> dict:
    """The mixture of experts of Mixtral, Qwen3-MoE and GPT-OSS: how many experts, how many a token
    uses, their width, how the picked ones are weighted, Qwen3-MoE's dense blocks and GPT-OSS's
    biases and clamped SwiGLU; the routers' load-balancing loss where ``output_router_logits`` turns it
    on, with transformers' default coefficient."""
    balance = c.get("output_router_logits", "bool", False)
    coef = c.get("router_aux_loss_coef", "number", 0.001, minimum=0) if balance else 0.0
    # Each family's key, or the other (transformers writes Qwen3-MoE's count under Mixtral's name).
    own, other = ("num_experts", "num_local_experts") if kind == "qwen3_moe" else ("num_local_experts", "num_experts")
    experts = size(own, None) or size(other)
    if kind == "mixtral":
        out = {"expert_intermediate": None, "norm_topk": True, "dense_blocks": ()}
    elif kind == "gpt_oss":
        out = {"expert_intermediate": None, "dense_blocks": (), "topk_then_softmax": True, "expert_bias": True,
               "swiglu_limit": c.get("swiglu_limit", "number", 7.0, minimum=1e-9),
               "swiglu_alpha": c.get("swiglu_alpha", "number", 1.702, minimum=1e-9)}
    else:
        every = c.get("decoder_sparse_step", "int", 1, minimum=1)
        only = c.get("mlp_only_layers", "list", [])
        if not all(isinstance(i, int) for i in only):
            raise InputError(f"--model {path}: config.json mlp_only_layers must list block numbers")
        out = {"expert_intermediate": size("moe_intermediate_size"),
               "norm_topk": c.get("norm_topk_prob", "bool", False),
               "dense_blocks": tuple(i for i in range(n_layer) if i in only or (i + 1) % every)}
    k = size("num_experts_per_tok")
    if k > experts:
        raise InputError(f"--model {path}: config.json num_experts_per_tok {k} is more than the {experts} experts")
    return {"experts": experts, "experts_per_token": k, "router_aux_loss_coef": coef, **out}


def _sliding_layers(c: Fields, path: str, kind: str, n_layer: int) -> tuple[int | None, tuple]:
    """The sliding window and the blocks that use it: every block (Mistral, Phi-3), the blocks
    ``layer_types`` names, or the family's pattern (every other block local in Gemma 2 and GPT-OSS,
    five of each six in Gemma 3)."""
    if kind in ("qwen2", "qwen3"):
        if c.get("use_sliding_window", "bool", False):
            _unsupported(path, f"sliding-window attention (use_sliding_window) for {kind}")
        return None, ()
    if kind == "qwen3_moe" and c.get("use_sliding_window", "bool", False):
        _unsupported(path, f"sliding-window attention (use_sliding_window) for {kind}")
    if kind not in ("mistral", "mixtral", "phi3", "gpt_oss", *GEMMA):
        return None, ()
    window = c.get("sliding_window", "int", DEFAULT_WINDOW.get(kind), minimum=1)
    if window is None:
        return None, ()
    if kind not in (*GEMMA, "gpt_oss"):
        return window, tuple(range(n_layer))
    types = c.get("layer_types", "list", None)
    if types is None:
        every = 2 if kind in ("gemma2", "gpt_oss") else c.get("sliding_window_pattern", "int", 6, minimum=1)
        return window, tuple(i for i in range(n_layer) if (i + 1) % every)
    if len(types) != n_layer or not set(types) <= {"sliding_attention", "full_attention"}:
        raise InputError(f"--model {path}: config.json layer_types must name 'sliding_attention' or "
                         f"'full_attention' for each of the {n_layer} layers")
    return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _rope_scaling(c: Fields, path: str, kind: str, scaling: dict, rotary_dims: int) -> tuple:
    """The rotary scaling of config.json: Llama 3.1's, linear (Gemma 3's global layers) or LongRoPE (Phi-3)."""
    s = Fields(scaling, f"--model {path}: config.json rope_scaling")
    rtype = s.get("rope_type", "str", None) or s.get("type", "str", None)
    if rtype == "llama3":
        return ("llama3", s.get("factor", "number", minimum=1e-9), s.get("low_freq_factor", "number", minimum=1e-9),
                s.get("high_freq_factor", "number", minimum=1e-9),
                s.get("original_max_position_embeddings", "int", minimum=1))
    if rtype == "linear":
        return ("linear", s.get("factor", "number", minimum=1e-9))
    if rtype == "yarn" and kind != "phi3":
        return _yarn(c, s)
    if kind == "phi3" and rtype in ("longrope", "su", "yarn"):  # transformers reads all three as LongRoPE
        original = (s.get("original_max_position_embeddings", "int", None, minimum=1)
                    or c.get("original_max_position_embeddings", "int", minimum=1))
        factors = []
        for key in ("short_factor", "long_factor"):
            values = s.get(key, "list")
            if len(values) != rotary_dims // 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                          and v > 0 for v in values):
                raise InputError(f"--model {path}: config.json rope_scaling {key} must be {rotary_dims // 2} "
                                 "positive numbers")
            factors.append(tuple(float(v) for v in values))
        factor = s.get("factor", "number", None, minimum=1e-9) or c.get("max_position_embeddings", "int") / original
        attention = s.get("attention_factor", "number", None, minimum=1e-9)
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return ("longrope", *factors, original, attention)
    raise InputError(f"--model {path}: rope scaling {rtype!r} is not supported for {kind} "
                     f"(llama3, linear, {'longrope' if kind == 'phi3' else 'yarn'})")


def _yarn(c: Fields, s: Fields) -> tuple:
    """YaRN's settings as transformers reads them (GPT-OSS): the attention factor, where not given,
    from the scaling factor (and DeepSeek's ``mscale`` pair where both are)."""
    original = s.get("original_max_position_embeddings", "int", minimum=1)
    factor = s.get("factor", "number", None, minimum=1e-9) or c.get("max_position_embeddings", "int") / original

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = s.get("attention_factor", "number", None, minimum=1e-9)
    if attention is None:
        pair = s.get("mscale", "number", None), s.get("mscale_all_dim", "number", None)
        attention = mscale(pair[0]) / mscale(pair[1]) if all(pair) else mscale()
    return ("yarn", factor, s.get("beta_fast", "number", None) or 32.0, s.get("beta_slow", "number", None) or 1.0,
            original, s.get("truncate", "bool", True), attention)


def _gpt2_activation(c: Fields, path: str) -> str:
    act = c.get("activation_function", "str", "gelu_new")
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    if act == "gelu":
        return "gelu"
    if act == "relu":
        return "relu"
    raise InputError(f"--model {path}: activation {act!r} is not supported")


class HFWeights:
    """The safetensors files of a directory: which file holds which tensor, read on demand."""

    def __init__(self, path: str):
        self.path = path
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise InputError(f"--model {path}: no *.safetensors files (pytorch_model.bin is not read: it unpickles)")
        from safetensors import SafetensorError, safe_open

        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[torch.dtype, tuple]] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        if k in self.where:
                            raise InputError(f"--model {path}: tensor {k!r} is in both {self.where[k].name} and {f.name}")
                        dtype = h.get_slice(k).get_dtype()
                        if dtype not in _DTYPES:
                            raise InputError(f"--model {path}: {f.name}: tensor {k!r} has dtype {dtype}, which Mobius "
                                             f"does not load (supported: {', '.join(_DTYPES)})")
                        self.where[k] = f
                        self.meta[k] = (_DTYPES[dtype], tuple(h.get_slice(k).get_shape()))
            except (OSError, SafetensorError) as err:
                raise InputError(f"--model {path}: {f.name} is not a readable safetensors file ({err})") from None
        self.packed = self._mxfp4_pairs()
        keys = set(self.where)
        self.prefix = _detect_prefix(keys)

    def _mxfp4_pairs(self) -> dict[str, tuple[str, Path, str, Path]]:
        """MXFP4 tensors (GPT-OSS's experts as published: ``X_blocks`` of packed 4-bit values and
        ``X_scales`` of their blocks' exponents) stand as the bf16 tensor ``X`` they dequantize to,
        of the shape transformers gives it, (experts, in, out): {X: (blocks, its file, scales, its file)}."""
        pairs = {}
        for blocks in [k for k in self.where if k.endswith("_blocks")]:
            name = blocks[:-len("_blocks")]
            scales = name + "_scales"
            shape, scale_shape = self.meta[blocks][1], self.meta.get(scales, (None, None))[1]
            if scale_shape is None or len(shape) != 4 or shape[3] != 16 or tuple(shape[:3]) != tuple(scale_shape) or \
                    self.meta[blocks][0] != torch.uint8 or self.meta[scales][0] != torch.uint8:
                raise InputError(f"--model {self.path}: {blocks} and {scales} are not an MXFP4 pair "
                                 "(U8 blocks (E, out, groups, 16) and U8 scales (E, out, groups))")
            experts, rows, groups, width = shape
            pairs[name] = (blocks, self.where.pop(blocks), scales, self.where.pop(scales))
            del self.meta[blocks], self.meta[scales]
            self.where[name] = pairs[name][1]
            self.meta[name] = (torch.bfloat16, (experts, groups * width * 2, rows))
        return pairs

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise InputError(f"--model {self.path}: tensor {name!r} is missing from the safetensors files")
        if name in self.packed:
            blocks, blocks_file, scales, scales_file = self.packed[name]
            with safe_open(str(blocks_file), framework="pt") as h:
                packed = h.get_tensor(blocks)
            with safe_open(str(scales_file), framework="pt") as h:
                return dequantize_mxfp4(packed, h.get_tensor(scales))
        with safe_open(str(self.where[name]), framework="pt") as h:
            return h.get_tensor(name)


# The 16 values of an FP4 (e2m1) code, by its 4 bits.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to bf16: each byte of ``blocks`` (E, out, groups, 16) holds two 4-bit codes (the low
    nibble first), each group of 32 shares the power of two ``scales - 127``; the result is (E, in,
    out), as transformers lays out GPT-OSS's expert weights.  Every value is exact in bf16."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # (E, out, G, 16, 2)
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127)[..., None])  # (E, out, G, 32)
    return values.flatten(-2).transpose(1, 2).contiguous()


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool, "I8": torch.int8}


def _detect_prefix(keys: set[str]) -> str:
    for prefix in ("language_model.model.", "model.language_model.", "transformer.", "model.decoder.", "decoder.",
                   "model.", ""):
        if any(k.startswith(prefix + p) for k in keys for p in ("wte.", "h.0.", "embed_tokens.", "layers.0.")):
            return prefix
    return ""


# Tensors of a directory that are buffers, not weights (GPT-2's causal masks, rotary tables).
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

_OPEN: dict[str, HFWeights] = {}


def open_weights(path: str) -> HFWeights:
    if path not in _OPEN:
        _OPEN[path] = HFWeights(path)
    return _OPEN[path]


@dataclass
class Piece:
    """Our parameter ``ours`` is built from the HF tensors ``names`` (concatenated on dim 0),
    transposed first when ``transpose`` (GPT-2's Conv1D).  ``experts`` names a tensor that stacks
    every expert's projection on dim 0 as (in, out) matrices (GPT-OSS): ``"gate_up"``, whose outputs
    alternate gate and up, or ``"down"``; a bias is a vector per expert."""

    ours: str
    names: tuple[str, ...]
    transpose: bool = False
    experts: str | None = None

    def to_ours(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.experts:
            (t,) = tensors
            t = t.transpose(1, 2) if t.dim() == 3 else t  # to (out, in) per expert
            if self.experts == "gate_up":  # outputs in our order: every gate, then every up
                t = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
            return t.flatten(0, 1)
        parts = [t.t() if self.transpose else t for t in tensors]
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]

    def to_hf(self, value: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
        """``value`` (ours) split back into the tensors ``names`` of ``shapes``."""
        if self.experts:
            (shape,) = shapes
            t = value.view(shape[0], -1, *value.shape[1:])  # (experts, out[, in])
            if self.experts == "gate_up":
                gate, up = t.chunk(2, dim=1)
                t = torch.stack((gate, up), dim=2).flatten(1, 2)
            return [t.transpose(1, 2) if t.dim() == 3 else t]
        parts = value.split([s[0] for s in shapes], dim=0) if len(shapes) > 1 else [value]  # never transposed
        return [t.t() if self.transpose else t for t in parts]


def _layer_map(config: GPTConfig, index: int, prefix: str, keys: set[str] | None = None) -> list[Piece]:
    arch, n = config.hf_arch, layer_count(config)
    p = prefix
    bias = [("weight",), ("weight", "bias")]
    if index == 0:
        if arch == "gpt2":
            return [Piece("wte.weight", (p + "wte.weight",)), Piece("wpe.weight", (p + "wpe.weight",))]
        if arch == "opt":
            return [Piece("wte.weight", (p + "embed_tokens.weight",)),
                    Piece("wpe.weight", (p + "embed_positions.weight",))]
        return [Piece("wte.weight", (p + "embed_tokens.weight",))]
    if index == n - 1:
        head = "lm_head.weight"
        if keys is not None and head not in keys:
            head = _layer_map(config, 0, prefix)[0].names[0]  # tied: the token table
        if arch == "gpt2":
            norm = [Piece(f"ln_f.{w}", (f"{p}ln_f.{w}",)) for w in bias[1]]
        elif arch == "opt":
            norm = [Piece(f"ln_f.{w}", (f"{p}final_layer_norm.{w}",)) for w in bias[1]]
        else:
            norm = [Piece("ln_f.weight", (f"{p}norm.weight",))]
        return norm + [Piece("lm_head.weight", (head,))]
    j = index - 1
    out: list[Piece] = []
    if arch == "gpt2":
        b = f"{p}h.{j}."
        for w in bias[1]:
            t = w == "weight"
            out += [Piece(f"ln1.{w}", (f"{b}ln_1.{w}",)), Piece(f"ln2.{w}", (f"{b}ln_2.{w}",)),
                    Piece(f"qkv.{w}", (f"{b}attn.c_attn.{w}",), t), Piece(f"proj.{w}", (f"{b}attn.c_proj.{w}",), t),
                    Piece(f"fc.{w}", (f"{b}mlp.c_fc.{w}",), t), Piece(f"fc_out.{w}", (f"{b}mlp.c_proj.{w}",), t)]
        return out
    if arch == "opt":
        b = f"{p}layers.{j}."
        for w in bias[1]:
            out += [Piece(f"ln1.{w}", (f"{b}self_attn_layer_norm.{w}",)), Piece(f"ln2.{w}", (f"{b}final_layer_norm.{w}",)),
                    Piece(f"qkv.{w}", tuple(f"{b}self_attn.{x}_proj.{w}" for x in "qkv")),
                    Piece(f"proj.{w}", (f"{b}self_attn.out_proj.{w}",)),
                    Piece(f"fc.{w}", (f"{b}fc1.{w}",)), Piece(f"fc_out.{w}", (f"{b}fc2.{w}",))]
        return out
    b = f"{p}layers.{j}."
    if config.sandwich_norm:  # Gemma: a norm before and after attention and MLP each
        norms = [Piece("ln1.weight", (f"{b}input_layernorm.weight",)),
                 Piece("ln1_post.weight", (f"{b}post_attention_layernorm.weight",)),
                 Piece("ln2.weight", (f"{b}pre_feedforward_layernorm.weight",)),
                 Piece("ln2_post.weight", (f"{b}post_feedforward_layernorm.weight",))]
    else:
        norms = [Piece("ln1.weight", (f"{b}input_layernorm.weight",)),
                 Piece("ln2.weight", (f"{b}post_attention_layernorm.weight",))]
    if arch == "phi3":  # stored fused, as we hold them
        qkv, fc = (f"{b}self_attn.qkv_proj.weight",), (f"{b}mlp.gate_up_proj.weight",)
    else:
        qkv = tuple(f"{b}self_attn.{x}_proj.weight" for x in "qkv")
        fc = (f"{b}mlp.gate_proj.weight", f"{b}mlp.up_proj.weight")
    out = norms + [Piece("qkv.weight", qkv), Piece("proj.weight", (f"{b}self_attn.o_proj.weight",))]
    if config.is_moe(j) and arch == "gpt_oss":  # stored stacked already, biases beside
        m = f"{b}mlp."
        out += [Piece("router.weight", (f"{m}router.weight",)), Piece("router.bias", (f"{m}router.bias",)),
                Piece("experts_fc", (f"{m}experts.gate_up_proj",), experts="gate_up"),
                Piece("experts_fc_bias", (f"{m}experts.gate_up_proj_bias",), experts="gate_up"),
                Piece("experts_out", (f"{m}experts.down_proj",), experts="down"),
                Piece("experts_out_bias", (f"{m}experts.down_proj_bias",), experts="down")]
    elif config.is_moe(j):  # every expert's tensors stacked in expert order (gate then up, each)
        e = range(config.experts)
        if arch == "mixtral":
            m = f"{b}block_sparse_moe."
            names = (f"{m}gate.weight", [(f"{m}experts.{i}.w1.weight", f"{m}experts.{i}.w3.weight") for i in e],
                     [f"{m}experts.{i}.w2.weight" for i in e])
        else:
            m = f"{b}mlp."
            names = (f"{m}gate.weight", [(f"{m}experts.{i}.gate_proj.weight", f"{m}experts.{i}.up_proj.weight")
                                         for i in e], [f"{m}experts.{i}.down_proj.weight" for i in e])
        out += [Piece("router.weight", (names[0],)), Piece("experts_fc", tuple(n for pair in names[1] for n in pair)),
                Piece("experts_out", tuple(names[2]))]
    else:
        out += [Piece("fc.weight", fc), Piece("fc_out.weight", (f"{b}mlp.down_proj.weight",))]
    if config.qk_norm:
        out += [Piece("q_norm.weight", (f"{b}self_attn.q_norm.weight",)),
                Piece("k_norm.weight", (f"{b}self_attn.k_norm.weight",))]
    if config.flag("qkv_bias"):
        out.append(Piece("qkv.bias", tuple(f"{b}self_attn.{x}_proj.bias" for x in "qkv")))
    if config.flag("proj_bias"):
        out.append(Piece("proj.bias", (f"{b}self_attn.o_proj.bias",)))
    if config.attn_sinks:
        out.append(Piece("sinks", (f"{b}self_attn.sinks",)))
    if config.flag("mlp_bias") and not config.is_moe(j):
        out += [Piece("fc.bias", (f"{b}mlp.gate_proj.bias", f"{b}mlp.up_proj.bias")),
                Piece("fc_out.bias", (f"{b}mlp.down_proj.bias",))]
    return out


def check_weights(config: GPTConfig) -> None:
    """Pre-flight of a directory's weights: every tensor the model needs is there and floating
    point, and nothing is there that we would silently ignore."""
    w = open_weights(config.checkpoint)
    keys = set(w.where)
    needed = {name for i in range(layer_count(config)) for piece in _layer_map(config, i, w.prefix, keys)
              for name in piece.names}
    carried = PASSTHROUGH_PREFIXES if config.hf_arch == "gemma3" else ()  # its vision tower
    problems = [("missing", sorted(needed - keys)),
                ("not floating point", sorted(n for n in needed & keys if not w.meta[n][0].is_floating_point)),
                ("not used by this model", sorted(k for k in keys - needed if not k.endswith(BUFFER_SUFFIXES)
                                                  and not (carried and k.startswith(carried))))]
    for what, names in problems:
        if names:
            raise InputError(f"--model {config.checkpoint}: {len(names)} tensors {what} ({', '.join(names[:3])}"
                             f"{', ...' if len(names) > 3 else ''})")


def load_layer_weights(config: GPTConfig, index: int, layer: torch.nn.Module) -> None:
    """Fill ``layer`` (layer ``index`` of the list) from the directory's safetensors."""
    w = open_weights(config.checkpoint)
    params = dict(layer.named_parameters())
    for piece in _layer_map(config, index, w.prefix, set(w.where)):
        value = piece.to_ours([w.get(name) for name in piece.names])
        target = params[piece.ours]
        if tuple(value.shape) != tuple(target.shape):
            raise InputError(f"--model {config.checkpoint}: {piece.names[0]} has shape {tuple(value.shape)}, "
                             f"expected {tuple(target.shape)} from config.json")
        with torch.no_grad():
            target.copy_(value)


def export_layer_tensors(config: GPTConfig, index: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors (original dtypes) for layer ``index`` from its local-name state."""
    w = open_weights(config.checkpoint)
    out: dict[str, torch.Tensor] = {}
    for piece in _layer_map(config, index, w.prefix, set(w.where)):
        if piece.ours not in state or piece.names[0] in out:
            continue
        if index == layer_count(config) - 1 and piece.ours == "lm_head.weight" and "lm_head.weight" not in w.where:
            continue  # tied and not stored: the token table (exported with the embedding) is it
        value = state[piece.ours].detach().cpu()
        for name, part in zip(piece.names, piece.to_hf(value, [w.meta[name][1] for name in piece.names])):
            out[name] = part.to(w.meta[name][0]).contiguous()
    return out


def untrained_tensors(config: GPTConfig) -> dict[str, torch.Tensor]:
    """Tensors of the directory that are not our parameters (e.g. GPT-2's attention-mask buffers)."""
    w = open_weights(config.checkpoint)
    ours = {name for i in range(layer_count(config)) for piece in _layer_map(config, i, w.prefix, set(w.where))
            for name in piece.names}
    return {k: w.get(k) for k in w.where if k not in ours}


EXPORT_KIND = "export"


def staging_dir(out_dir: str) -> Path:
    """Where an export is assembled before the atomic rename into ``out_dir``."""
    return ownership.sibling(out_dir, "partial")


def write_shard(config: GPTConfig, staging: Path, name: str, layers: dict[int, dict[str, torch.Tensor]]) -> None:
    """One safetensors file with the HF-named tensors of ``layers`` ({layer index: local-name state})."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for index, state in layers.items():
        tensors.update(export_layer_tensors(config, index, state))
    if tensors:
        with export_errors(staging):
            save_file(tensors, str(staging / f"{name}.safetensors"), metadata={"format": "pt"})


def finalize_export(config: GPTConfig, staging: Path, out_dir: str) -> None:
    """Add the untouched tensors, the index, config and tokenizer files, then rename into place:
    ``out_dir`` is never half-written, and a previous export there is replaced only when complete."""
    with export_errors(out_dir):
        _complete_export(config, staging)
        ownership.swap_into_place(staging, out_dir, EXPORT_KIND)


def _complete_export(config: GPTConfig, staging: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    if open_weights(config.checkpoint).packed:  # experts exported dequantized, so the config says no quantization
        settings = json.loads(Path(config.checkpoint, "config.json").read_text())
        settings.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    extra = untrained_tensors(config)
    if extra:
        save_file(extra, str(staging / "extra.safetensors"), metadata={"format": "pt"})
    files = sorted(staging.glob("*.safetensors"))
    if len(files) == 1:
        files[0].rename(staging / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for k, f in enumerate(files):
            target = staging / f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            f.rename(target)
            with safe_open(str(target), framework="pt") as h:
                for key in h.keys():
                    weight_map[key] = target.name
                    sl = h.get_slice(key)
                    total += math.prod(sl.get_shape()) * _DTYPES[sl.get_dtype()].itemsize
        (staging / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    copy_model_files(config, staging, COPIED_FILES)


def copy_model_files(config: GPTConfig, staging: Path, names: tuple[str, ...]) -> None:
    """The model directory's ``names`` into the export, unless the run wrote its own (a
    ``--chat-template`` the model was tuned with)."""
    for f in _model_files(config, names):
        if not (staging / f).exists():
            shutil.copy2(Path(config.checkpoint, f), staging / f)


def _model_files(config: GPTConfig, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` the model directory holds; each must be a regular file inside it
    (confinement: a link out of it, to a key say, is refused, naming it)."""
    model_dir = Path(config.checkpoint).resolve()
    found = []
    for f in names:
        src = Path(config.checkpoint, f)
        if not (src.exists() or src.is_symlink()):
            continue
        if not src.is_file() or model_dir not in src.resolve().parents:
            raise InputError(f"--model {config.checkpoint}: {f} is not a regular file inside the model directory "
                             f"(it leads to {src.resolve()}); refusing to copy it into an export")
        found.append(f)
    return found


def start_export(out_dir: str, chat_template: str | None = None) -> Path:
    """The export's staging directory; with ``chat_template`` (``--chat-template``), the template
    the model was tuned with goes into it as ``chat_template.jinja``."""
    with export_errors(out_dir):
        staging = ownership.fresh_dir(staging_dir(out_dir), EXPORT_KIND)
        if chat_template:
            shutil.copyfile(chat_template, staging / "chat_template.jinja")
        return staging


def export_errors(out_dir: str | os.PathLike):
    return ownership.writing("the export", out_dir, "nothing was replaced")


def check_export_target(config: GPTConfig, out_dir: str, option: str = "--export") -> None:
    """Pre-flight: only Hugging Face directories export, and only into a new or empty directory or
    over an export of ours that holds nothing else (the model being read is an input: see
    :func:`mobius.boundary.ownership.check_paths`)."""
    if not config.checkpoint:
        raise InputError(f"{option} needs --model to be a Hugging Face directory (presets have nothing to export to)")
    _model_files(config, COPIED_FILES)  # what the export will copy, checked before training
    ownership.check_swapped_dir(option, out_dir, EXPORT_KIND, replaced=True)
