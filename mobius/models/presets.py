"""Model presets by name.

``mobius-*`` are the Mobius paper's Table 3 models (hidden / layers / heads exactly as printed,
sequence length 512, GPT-2 vocabulary, no biases, untied embeddings).  Their parameter counts are
12·L·h² for the blocks plus embeddings, head and norm weights.  Table 3's nominal sizes are loose:
"15B" (h=5120, L=40) computes to about 12.6B and "51B" to about 51.9B with embeddings.  Table 3 also prints 80 heads for h=9216, which do
not divide it: ``mobius-51b`` is describable and plannable (meta device) but not runnable.

``gpt2*`` are the published GPT-2 shapes (biases, tied embeddings): 124M, 355M, 774M, 1.56B.
``tiny`` (and ``tiny8``, eight blocks for many-stage pipeline tests) is for tests and ``small`` (~21M) is the CPU demo; both use the byte vocabulary.
"""

from __future__ import annotations

import glob
import os

from mobius.boundary.errors import InputError
from mobius.models.architecture import GPTConfig
from mobius.models.hf import is_hf_dir, load_hf_config

GPT2_VOCAB = 50257

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, context=128, n_layer=4, hidden=64, heads=4),
    # tiny's shape with 8 blocks: enough layers for 8-stage pipeline tests
    "tiny8": GPTConfig(vocab_size=256, context=128, n_layer=8, hidden=64, heads=4),
    "small": GPTConfig(vocab_size=256, context=256, n_layer=12, hidden=384, heads=6),
    "mobius-3b": GPTConfig(vocab_size=GPT2_VOCAB, context=512, n_layer=64, hidden=2048, heads=32),
    "mobius-8b": GPTConfig(vocab_size=GPT2_VOCAB, context=512, n_layer=40, hidden=4096, heads=32),
    "mobius-15b": GPTConfig(vocab_size=GPT2_VOCAB, context=512, n_layer=40, hidden=5120, heads=64),
    "mobius-51b": GPTConfig(vocab_size=GPT2_VOCAB, context=512, n_layer=50, hidden=9216, heads=80),
    "gpt2": GPTConfig(GPT2_VOCAB, 1024, 12, 768, 12, bias=True, tie_embeddings=True),
    "gpt2-medium": GPTConfig(GPT2_VOCAB, 1024, 24, 1024, 16, bias=True, tie_embeddings=True),
    "gpt2-large": GPTConfig(GPT2_VOCAB, 1024, 36, 1280, 20, bias=True, tie_embeddings=True),
    "gpt2-xl": GPTConfig(GPT2_VOCAB, 1024, 48, 1600, 25, bias=True, tie_embeddings=True),
}

# Table 3's micro-batch size for the paper's models.
PAPER_MICRO_BATCH = {"mobius-3b": 2, "mobius-8b": 2, "mobius-15b": 1, "mobius-51b": 1}


def get_config(name: str) -> GPTConfig:
    """A preset by name, or a Hugging Face model directory (config.json [+ safetensors])."""
    if is_hf_dir(name):
        return load_hf_config(name, weights=bool(glob.glob(os.path.join(name, "*.safetensors"))))
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(f"unknown model preset {name!r} (and not a Hugging Face directory); choose one of: {', '.join(PRESETS)}") from None
