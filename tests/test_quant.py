"""The 4-bit base of QLoRA (mobius.models.quant): bitsandbytes' NF4 format, in plain torch."""

from __future__ import annotations

import pytest
import torch

from mobius.config import RunConfig
from mobius.models import build_layer, get_config
from mobius.models.lora import parts
from mobius.models.quant import BLOCK, NF4, dequantize, quantize
from mobius.runtime.inputs import model_config_for


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(96, 64), (33, 50), (7, 3), (1, 1)])
def test_codes_and_scales_are_bitsandbytes_own(shape):
    bf = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05
    packed, state = bf.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4")
    codes, absmax = quantize(w)
    assert torch.equal(packed.reshape(-1), codes) and torch.equal(state.absmax, absmax)
    assert torch.equal(bf.dequantize_4bit(packed, state), dequantize(codes, absmax, shape, torch.float32))


def test_quantization_takes_the_nearest_level_of_each_block_scaled_by_its_largest_magnitude():
    levels = torch.tensor(NF4)
    w = torch.cat([levels * 3.0, levels.flip(0) * 3.0, torch.linspace(-0.5, 0.5, 2 * BLOCK - 32)]).view(2, BLOCK)
    codes, absmax = quantize(w)
    assert absmax.tolist() == [3.0, 0.5]
    back = dequantize(codes, absmax, (2, BLOCK), torch.float32)
    assert torch.equal(back[0, :32], w[0, :32])  # the levels themselves come back exactly
    nearest = (w[1, :, None] / 0.5 - levels).abs().argmin(dim=1)
    assert torch.equal(back[1], levels[nearest] * 0.5)


def test_a_4bit_block_holds_a_quarter_of_the_bytes_and_keeps_its_scales_through_a_cast():
    cfg = RunConfig.of(model="small", lora_rank=4, load_in_4bit=True)
    config = model_config_for(cfg)
    full = build_layer(model_config_for(RunConfig.of(model="small", lora_rank=4)), 1, seed=3)
    block = build_layer(config, 1, seed=3)
    projections = ("qkv", "proj", "fc", "fc_out")
    full_bytes = sum(getattr(full, n).weight.numel() * 4 for n in projections)
    held = sum(b.numel() * b.element_size() for b in block.buffers())
    assert held == pytest.approx(full_bytes / 8 * (1 + 8 / BLOCK))  # 4 bits a weight, an fp32 scale a block
    for name in projections:  # each Hugging Face module's rows quantized apart, as PEFT's model holds them
        rows = getattr(full, name).weight.detach().split(parts(config, name))
        want = torch.cat([dequantize(*quantize(r), tuple(r.shape), torch.float32) for r in rows])
        assert torch.equal(getattr(block, name).weight, want), name
    before = block.qkv.weight
    block.to(torch.bfloat16)  # the model cast to its compute dtype: the scales are not rounded
    assert torch.equal(block.qkv.weight, before)
    described = build_layer(config, 1, seed=3, device="meta")
    assert {n: b.shape for n, b in described.named_buffers()} == {n: b.shape for n, b in block.named_buffers()}
    assert get_config("small").hidden % BLOCK == 0
