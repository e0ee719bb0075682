"""Published ``config.json`` values of the models the planning scripts plan (nothing is
downloaded), and a directory holding one, as ``--model`` takes it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from mobius.boundary.janitor import scratch_dir

_LLAMA_3_1 = {
    "model_type": "llama", "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "hidden_act": "silu"}
CONFIGS = {
    "Llama-3.1-8B": {**_LLAMA_3_1, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32},
    "Llama-3.1-70B": {**_LLAMA_3_1, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64},
    "Qwen2.5-32B": {
        "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu"},
    # Mixtures of experts (each config.json's values as published).
    "Mixtral-8x7B": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2,
        "sliding_window": None, "output_router_logits": False, "tie_word_embeddings": False, "hidden_act": "silu"},
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": False, "tie_word_embeddings": False, "hidden_act": "silu"},
    "Qwen3-235B-A22B": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": False, "tie_word_embeddings": False, "hidden_act": "silu"},
    "GPT-OSS-20B": {**(_GPT_OSS := {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "attention_bias": True, "sliding_window": 128,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "num_experts_per_tok": 4, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}),
        "num_hidden_layers": 24, "num_local_experts": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 12},
    "GPT-OSS-120B": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18},
}


@contextlib.contextmanager
def model_dir(name: str):
    """A directory (ours, removed afterwards) holding model ``name``'s ``config.json``."""
    with scratch_dir(f"mobius-{name}-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIGS[name]))
        yield tmp
