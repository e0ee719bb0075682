"""Tiny random models of every Hugging Face family we read, saved as model directories: what the
tests that read, fine-tune and export them share (``transformers`` is a test extra)."""

import torch
import transformers
from conftest import save_hf_model


def make_dirs(root):
    torch.manual_seed(0)
    T = transformers
    models = {
        "gpt2": T.GPT2LMHeadModel(T.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
        "opt": T.OPTForCausalLM(T.OPTConfig(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                            word_embed_proj_dim=32)),
        "llama": T.LlamaForCausalLM(T.LlamaConfig(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                  intermediate_size=48)),
        # Llama with widths of whole 64-value blocks, as bitsandbytes' CPU kernels want (QLoRA).
        "llama64": T.LlamaForCausalLM(T.LlamaConfig(vocab_size=300, max_position_embeddings=64, hidden_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    intermediate_size=128)),
        # Qwen3: a head size of its own (16, not 32 / 4), q/k RMSNorm per head; tied like Llama 3.2.
        "qwen3": T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, intermediate_size=48, tie_word_embeddings=True)),
        # Phi-3: q|k|v and gate|up stored fused, half of each head rotated, LongRoPE (the long factors
        # past 16 tokens), a sliding window of 8.
        "phi3": T.Phi3ForCausalLM(T.Phi3Config(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=48, sliding_window=8, pad_token_id=0,
                                               partial_rotary_factor=0.5, original_max_position_embeddings=16,
                                               rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5],
                                                             "long_factor": [2.0, 3.0]})),
        # Gemma 2: sliding (8) and global blocks alternating, soft-capped scores and logits (caps small
        # enough to bend a tiny model's values), a query scale of its own, GeGLU, sandwich norms, tied.
        "gemma2": T.Gemma2ForCausalLM(T.Gemma2Config(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                     head_dim=16, intermediate_size=48, sliding_window=8,
                                                     query_pre_attn_scalar=24, attn_logit_softcapping=0.05,
                                                     final_logit_softcapping=0.5)),
        # Gemma 3: q/k norms, a local rotary base for the sliding blocks and a scaled global one.
        "gemma3": T.Gemma3ForCausalLM(T.Gemma3TextConfig(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                         num_hidden_layers=3, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                         sliding_window=8, sliding_window_pattern=2,
                                                         query_pre_attn_scalar=24,
                                                         rope_scaling={"rope_type": "linear", "factor": 2.0})),
        # Gemma 3 with its vision tower: the language model is read, the tower exported unchanged.
        "gemma3mm": T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            text_config=dict(vocab_size=300, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                             sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)),
    }
    noisy_norms(models, root, ("phi3", "gemma2", "gemma3", "gemma3mm"))
    # Made after the others, whose weights stay the draws they were before these were added.
    mixtures = {
        # Mixtures of experts: Mixtral (4 experts, 2 a token, renormalised; Mistral's attention) and
        # Qwen3-MoE (experts narrower than the dense MLP of block 1, not renormalised, q/k norms).
        "mixtral": T.MixtralForCausalLM(T.MixtralConfig(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                        num_hidden_layers=3, num_attention_heads=4,
                                                        num_key_value_heads=2, intermediate_size=48,
                                                        num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(vocab_size=300, max_position_embeddings=64, hidden_size=32,
                                                            num_hidden_layers=3, num_attention_heads=4,
                                                            num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                            moe_intermediate_size=24, num_experts=4,
                                                            num_experts_per_tok=2, mlp_only_layers=[1])),
    }
    noisy_norms(mixtures, root, ("qwen3_moe",))
    # GPT-OSS: sinks, biased router and experts (drawn, where transformers starts them at zero), a
    # SwiGLU clamp low enough to bend, alternating sliding (8) and full blocks, YaRN past 16 tokens.
    gpt_oss = T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=300, max_position_embeddings=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, swiglu_limit=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}))
    with torch.no_grad():
        for name, p in gpt_oss.named_parameters():
            if name.endswith(("bias", "sinks", "norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.5)
    save_hf_model(gpt_oss, root / "gpt_oss")
    return {name: str(root / name) for name in {**models, **mixtures, "gpt_oss": None}}


def noisy_norms(models: dict, root, noisy: tuple[str, ...]) -> None:
    """Each model saved under ``root``; those ``noisy`` names with norms not all ones (Gemma's: not all zeros)."""
    for name, m in models.items():
        if name in noisy:
            with torch.no_grad():
                for param_name, p in m.named_parameters():
                    if "norm" in param_name:
                        p.add_(torch.randn_like(p) * 0.1)
        save_hf_model(m, root / name)
