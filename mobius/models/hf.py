"""Hugging Face model directories in and out: GPT-2, OPT and Llama-family (Llama, Mistral, Qwen2).

A directory (``config.json`` + ``*.safetensors`` [+ ``tokenizer.json``]) becomes a
:class:`GPTConfig` with ``checkpoint`` set.  :func:`mobius.models.gpt.build_layer` then fills each
layer from the safetensors files, reading only that layer's tensors.  Weights are streamed layer by
layer and never held twice.  Nothing here touches the network, and ``transformers`` is not needed.

Each family maps its tensor names onto our layer list (see :func:`_layer_map`):

* GPT-2 stores ``Conv1D`` weights as (in, out): they are transposed.  ``c_attn`` is already q|k|v.
* OPT and Llama store q, k and v separately: they are concatenated into our ``qkv`` (and split
  again on export).  Llama's gate and up projections go into our ``fc`` the same way.

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

from mobius import ownership
from mobius.errors import InputError
from mobius.models.gpt import GPTConfig, layer_count

SUPPORTED = ("gpt2", "opt", "llama", "mistral", "qwen2")
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_config(path: str) -> dict:
    try:
        return json.loads(Path(path, "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"--model {path}: cannot read config.json: {err}") from None


def load_hf_config(path: str, weights: bool = True) -> GPTConfig:
    """Our config for a Hugging Face directory (``weights=False``: config.json alone, for planning)."""
    c = _read_config(path)
    kind = c.get("model_type")
    if kind not in SUPPORTED:
        raise InputError(f"--model {path}: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")

    def need(key: str):
        if key not in c:
            raise InputError(f"--model {path}: config.json lacks {key!r}")
        return c[key]

    common = {"checkpoint": os.path.abspath(path) if weights else None, "hf_arch": kind}
    if kind == "gpt2":
        return GPTConfig(vocab_size=need("vocab_size"), context=need("n_positions"), n_layer=need("n_layer"),
                         hidden=need("n_embd"), heads=need("n_head"), bias=True,
                         tie_embeddings=c.get("tie_word_embeddings", True), norm_eps=c.get("layer_norm_epsilon", 1e-5),
                         mlp=_gpt2_activation(c, path), intermediate=c.get("n_inner"), **common)
    if kind == "opt":
        if not c.get("do_layer_norm_before", True):
            raise InputError(f"--model {path}: post-LayerNorm OPT (opt-350m) is not supported")
        if c.get("word_embed_proj_dim", c["hidden_size"]) != c["hidden_size"]:
            raise InputError(f"--model {path}: OPT with project_in/out (word_embed_proj_dim) is not supported")
        if c.get("activation_function", "relu") != "relu":
            raise InputError(f"--model {path}: OPT activation {c.get('activation_function')!r} is not supported")
        return GPTConfig(vocab_size=need("vocab_size"), context=need("max_position_embeddings"),
                         n_layer=need("num_hidden_layers"), hidden=need("hidden_size"), heads=need("num_attention_heads"),
                         bias=c.get("enable_bias", True), tie_embeddings=c.get("tie_word_embeddings", True),
                         mlp="relu", intermediate=need("ffn_dim"), position_offset=2, **common)
    # Llama family
    heads, hidden = need("num_attention_heads"), need("hidden_size")
    if c.get("head_dim") not in (None, hidden // heads):
        raise InputError(f"--model {path}: head_dim {c['head_dim']} != hidden_size/heads is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise InputError(f"--model {path}: hidden_act {c.get('hidden_act')!r} is not supported")
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    scaling_t = None
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type"))
        if rtype != "llama3":
            raise InputError(f"--model {path}: rope scaling {rtype!r} is not supported (only llama3)")
        scaling_t = ("llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                     float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    attn_bias = c.get("attention_bias", False)
    return GPTConfig(vocab_size=need("vocab_size"), context=need("max_position_embeddings"),
                     n_layer=need("num_hidden_layers"), hidden=hidden, heads=heads,
                     kv_heads=c.get("num_key_value_heads", heads), intermediate=need("intermediate_size"),
                     norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6), mlp="swiglu", positions="rope",
                     rope_theta=float(theta), rope_scaling=scaling_t, tie_embeddings=c.get("tie_word_embeddings", False),
                     qkv_bias=True if kind == "qwen2" else attn_bias, proj_bias=attn_bias,
                     mlp_bias=c.get("mlp_bias", False), **common)


def _gpt2_activation(c: dict, path: str) -> str:
    act = c.get("activation_function", "gelu_new")
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
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[torch.dtype, tuple]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self.where[k] = f
                    sl = h.get_slice(k)
                    self.meta[k] = (_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))
        keys = set(self.where)
        self.prefix = _detect_prefix(keys)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise InputError(f"--model {self.path}: tensor {name!r} is missing from the safetensors files")
        with safe_open(str(self.where[name]), framework="pt") as h:
            return h.get_tensor(name)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool, "I8": torch.int8}


def _detect_prefix(keys: set[str]) -> str:
    for prefix in ("transformer.", "model.decoder.", "decoder.", "model.", ""):
        if any(k.startswith(prefix + p) for k in keys for p in ("wte.", "h.0.", "embed_tokens.", "layers.0.")):
            return prefix
    return ""


_OPEN: dict[str, HFWeights] = {}


def open_weights(path: str) -> HFWeights:
    if path not in _OPEN:
        _OPEN[path] = HFWeights(path)
    return _OPEN[path]


@dataclass
class Piece:
    """Our parameter ``ours`` is built from the HF tensors ``names`` (concatenated on dim 0),
    transposed first when ``transpose`` (GPT-2's Conv1D)."""

    ours: str
    names: tuple[str, ...]
    transpose: bool = False


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
    out = [Piece("ln1.weight", (f"{b}input_layernorm.weight",)), Piece("ln2.weight", (f"{b}post_attention_layernorm.weight",)),
           Piece("qkv.weight", tuple(f"{b}self_attn.{x}_proj.weight" for x in "qkv")),
           Piece("proj.weight", (f"{b}self_attn.o_proj.weight",)),
           Piece("fc.weight", (f"{b}mlp.gate_proj.weight", f"{b}mlp.up_proj.weight")),
           Piece("fc_out.weight", (f"{b}mlp.down_proj.weight",))]
    if config.flag("qkv_bias"):
        out.append(Piece("qkv.bias", tuple(f"{b}self_attn.{x}_proj.bias" for x in "qkv")))
    if config.flag("proj_bias"):
        out.append(Piece("proj.bias", (f"{b}self_attn.o_proj.bias",)))
    if config.flag("mlp_bias"):
        out += [Piece("fc.bias", (f"{b}mlp.gate_proj.bias", f"{b}mlp.up_proj.bias")),
                Piece("fc_out.bias", (f"{b}mlp.down_proj.bias",))]
    return out


def load_layer_weights(config: GPTConfig, index: int, layer: torch.nn.Module) -> None:
    """Fill ``layer`` (layer ``index`` of the list) from the directory's safetensors."""
    w = open_weights(config.checkpoint)
    params = dict(layer.named_parameters())
    for piece in _layer_map(config, index, w.prefix, set(w.where)):
        parts = [w.get(name) for name in piece.names]
        parts = [t.t() if piece.transpose else t for t in parts]
        value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
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
        sizes = [w.meta[name][1][0] for name in piece.names]  # concatenated pieces are never transposed
        for name, part in zip(piece.names, value.split(sizes, dim=0) if len(piece.names) > 1 else [value]):
            part = part.t() if piece.transpose else part
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
        save_file(tensors, str(staging / f"{name}.safetensors"), metadata={"format": "pt"})


def finalize_export(config: GPTConfig, staging: Path, out_dir: str) -> None:
    """Add the untouched tensors, the index, config and tokenizer files, then rename into place:
    ``out_dir`` is never half-written, and a previous export there is replaced only when complete."""
    from safetensors import safe_open
    from safetensors.torch import save_file

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
    for f in COPIED_FILES:
        src = Path(config.checkpoint, f)
        if src.is_file():
            shutil.copy2(src, staging / f)
    ownership.swap_into_place(staging, out_dir, EXPORT_KIND)


def start_export(out_dir: str) -> Path:
    return ownership.fresh_dir(staging_dir(out_dir), EXPORT_KIND)


def check_export_target(config: GPTConfig, out_dir: str) -> None:
    """Pre-flight: only Hugging Face directories export, and only into a new or empty directory or
    over an export of ours that holds nothing else (the model being read is an input: see
    :func:`mobius.ownership.check_paths`)."""
    if not config.checkpoint:
        raise InputError("--export needs --model to be a Hugging Face directory (presets have nothing to export to)")
    ownership.check_output_dir_parent("--export", out_dir)
    for path in (Path(out_dir), staging_dir(out_dir), ownership.sibling(out_dir, "previous")):
        ownership.check_removable(path, EXPORT_KIND, "--export")
