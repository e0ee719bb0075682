"""The routers' load-balancing loss of mixtures of experts (``output_router_logits`` on): equal to
transformers' loss and gradients, a step's micro-batches averaged, the tally's bits carried
exactly in 16-bit activations, and every schedule equal to the reference on padded examples."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import run_in_threads, save_hf_model  # noqa: E402
from make_tiny_chat_model import SPECIAL_TOKENS, write_chat_tokenizer  # noqa: E402

from mobius.backends import resolve
from mobius.config import RunConfig  # noqa: E402
from mobius.models import IGNORE, TokenLayout, build_model, get_config  # noqa: E402
from mobius.models.router_balance import pack, unpack  # noqa: E402
from mobius.reference import ReferenceTrainer  # noqa: E402
from mobius.runtime.inputs import make_batches, model_config_for  # noqa: E402

COEF = 0.05  # larger than transformers' 0.001, so that a lost term shows


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny Mixtral, Qwen3-MoE (block 1 dense) and GPT-OSS with the loss on, and a byte tokenizer
    with ChatML's tokens (so they also fine-tune on chat examples)."""
    root = tmp_path_factory.mktemp("balanced")
    torch.manual_seed(0)
    T = transformers
    common = dict(vocab_size=256 + len(SPECIAL_TOKENS), max_position_embeddings=256, hidden_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=COEF, eos_token_id=256, pad_token_id=256,
                  bos_token_id=None)
    models = {
        "mixtral": T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)),
        "qwen3_moe": T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                                                            num_experts=4, mlp_only_layers=[1], **common)),
        "gpt_oss": T.GptOssForCausalLM(T.GptOssConfig(head_dim=16, intermediate_size=24, num_local_experts=4,
                                                      sliding_window=8, **common)),
    }
    with torch.no_grad():  # GPT-OSS's biases drawn (transformers starts them at zero)
        for name, p in models["gpt_oss"].named_parameters():
            if name.endswith(("bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.5)
    out = {}
    for name, model in models.items():
        save_hf_model(model, root / name)
        write_chat_tokenizer(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_loss_and_every_gradient_equal_transformers(moe_dirs, arch, tmp_path):
    """One micro-batch, with and without padding: the loss (cross-entropy + coef x aux) and every
    gradient equal transformers' (fp32, 1e-5); the load-balancing term is large enough to matter."""
    config = get_config(moe_dirs[arch])
    assert config.router_aux_loss_coef == COEF
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    for k, padding in enumerate((None, mask)):
        ours = build_model(config)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs[arch], dtype=torch.float32)
        labels = tokens if padding is None else tokens.masked_fill(padding == 0, IGNORE)
        out = theirs(tokens, attention_mask=padding, labels=labels)
        out.loss.backward()
        targets = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
        loss = ours(tokens, TokenLayout(targets=targets, real=None if padding is None else padding.bool()))
        loss.backward()
        assert loss.item() == pytest.approx(out.loss.item(), rel=1e-5)
        assert COEF * out.aux_loss.item() > 1e-2  # the term these gradients carry
        # Their gradients saved as a checkpoint of theirs, read back by our reader under our names.
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(p.grad)
        save_hf_model(theirs, tmp_path / str(k))
        want = dict(build_model(get_config(str(tmp_path / str(k)))).named_parameters())
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, want[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_weighs_each_micro_batch_loss_by_its_share(moe_dirs):
    """Two micro-batches of text windows: the step's loss is the token mean of the cross-entropy
    plus the coefficient times the mean of the micro-batches' load-balancing losses."""
    cfg = RunConfig.of(model=moe_dirs["qwen3_moe"], steps=1, micro_batch_size=2, micro_batches=2, seq_len=16,
                       precision="fp32", progress=False)
    config = model_config_for(cfg)
    batches = make_batches(cfg, config)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    micro = batches.step(0)
    want = 0.0
    with torch.no_grad():
        for mb in micro:
            out = theirs(mb.tokens, output_router_logits=True)
            logits = out.logits.reshape(-1, out.logits.shape[-1])
            ce = torch.nn.functional.cross_entropy(logits, mb.targets.reshape(-1), reduction="sum")
            want += ce.item() / mb.layout.loss_tokens + COEF * out.aux_loss.item() / len(micro)
    got = ReferenceTrainer(cfg, config, batches, torch.device("cpu")).step(0).loss
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_tally_travels_bit_for_bit_in_any_activation_dtype(moe_dirs, dtype):
    """Packed with 16-bit hidden states, a tally whose halves read as NaNs and subnormals comes
    back with every bit, and so does its gradient."""
    config = get_config(moe_dirs["mixtral"])
    n = 2 * config.experts + 1
    raw = torch.tensor([0x7FC1FFFF, 0x0001FFC1, 0x7F800001, 0x3F800000] * n, dtype=torch.int64)[:n].to(torch.int32)
    weird = raw.view(torch.float32)
    tally = torch.randn(n, requires_grad=True)
    hidden = torch.randn(3, 5, config.hidden).to(dtype).requires_grad_()
    h, t = unpack(config, pack(config, hidden, tally))
    assert torch.equal(h, hidden) and torch.equal(t, tally)
    g_hidden = torch.randn_like(h)
    got_hidden, got_tally = torch.autograd.grad([h, t], [hidden, tally], [g_hidden, weird])
    assert torch.equal(got_hidden, g_hidden) and torch.equal(got_tally.view(torch.int32), raw)


def chat_config(moe_dirs, tmp_path, **kw) -> RunConfig:
    records = []
    for i in range(16):
        w = ["alpha", "beta", "gamma", "delta", "epsilon"][i % 5]
        records.append({"messages": [{"role": "user", "content": f"say {w} {'twice' if i % 2 else 'once'}"},
                                     {"role": "assistant", "content": (w + " ") * (1 + i % 3)}]})
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    base = dict(model=moe_dirs["qwen3_moe"], data=str(data), steps=3, seq_len=96, micro_batch_size=2,
                micro_batches=4, lr=1e-2, precision="fp32", progress=False, topology="cpu", packing="off")
    return RunConfig.of(**{**base, **kw})


@pytest.mark.slow
def test_padded_examples_through_both_schedules_equal_the_reference(moe_dirs, tmp_path):
    """Chat examples one to a padded row (the padding left out of the routers' tally on every
    stage): the bound pipeline on 2 and 3 workers (recomputing or not) and the dispatched schedule
    (a head split over two GPUs, a recomputed boundary inside a forward stage) give the reference's
    losses and weights; the chunked engine on 2 processes its losses."""
    from test_dispatch import run
    from topology import cpu_topology

    from mobius.backends.chunked import launch_chunked
    from mobius.runtime.inputs import make_data
    from mobius.runtime.spec import DispatchedShape

    cfg = chat_config(moe_dirs, tmp_path)
    batches = make_batches(cfg, model_config_for(cfg))
    assert any(mb.layout.real is not None and not mb.layout.real.all() for mb in batches.step(0))
    ref = ReferenceTrainer(cfg.changed(backend="single"), model_config_for(cfg), batches, torch.device("cpu"))
    want = [ref.step(k).loss for k in range(3)]
    want_weights = {n: p.detach() for n, p in ref.model.named_parameters()}
    runs = {}
    for workers, stages, recompute in ((2, 4, "on"), (3, 5, "off")):
        runs[f"bound {workers}"] = run_in_threads(cfg.changed(backend="pipeline", cpu_workers=workers, stages=stages,
                                                              recompute=recompute))
    shape = DispatchedShape([(0, 2), (2, 3), (3, 5)], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], [1, 0], head_gpus=2)
    losses, weights, _ = run(cfg.changed(backend="pipeline", cpu_workers=2, schedule="dispatched"), shape)
    runs["dispatched"] = (losses, weights)
    for name, (losses, weights) in runs.items():
        assert losses == pytest.approx(want, rel=1e-5), name
        for n, w in want_weights.items():
            torch.testing.assert_close(weights[n], w, rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")
    chunked = cfg.changed(backend="chunked", cpu_workers=2)
    history = launch_chunked(resolve(chunked, cpu_topology(2), "chunked"), model_config_for(chunked),
                             data=make_data(chunked, model_config_for(chunked)))
    assert [m.loss for m in history] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_lora_with_the_loss_equals_peft(moe_dirs):
    """LoRA on attention (the router and experts frozen, the loss's gradient reaching the adapters
    through the routers' inputs): the reference and a 2-worker pipeline equal PEFT's losses."""
    from test_lora import STEPS, lora_cfg, peer_losses

    path = moe_dirs["mixtral"]
    cfg = lora_cfg(path)
    want = peer_losses(path, cfg)
    trainer = ReferenceTrainer(cfg, model_config_for(cfg), make_batches(cfg, model_config_for(cfg)),
                               torch.device("cpu"))
    assert [trainer.step(k).loss for k in range(STEPS)] == pytest.approx(want, rel=1e-5)
    losses, _ = run_in_threads(lora_cfg(path, topology="cpu", cpu_workers=2, stages=4, recompute="on"))
    assert losses == pytest.approx(want, rel=1e-5)
