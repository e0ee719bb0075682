"""Hugging Face directories: our layer list against ``transformers``, export round trips, and
fine-tuning through every backend.  ``transformers`` is a test extra, never a runtime need."""

import glob
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tiny_hf_models import make_dirs  # noqa: E402

from mobius.backends import resolve
from mobius.config import RunConfig  # noqa: E402
from mobius.data import load_corpus, tokenizer_for  # noqa: E402
from mobius.models import build_model, get_config  # noqa: E402
from mobius.models.hf import finalize_export, start_export, write_shard  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("hf"))


def reference_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


FAMILIES = ["gpt2", "opt", "llama", "qwen3", "phi3", "gemma2", "gemma3", "gemma3mm", "mixtral", "qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_equal_transformers(hf_dirs, arch):
    config = get_config(hf_dirs[arch])
    if arch == "llama":
        assert config.n_kv_heads == 2 and config.heads == 4  # grouped-query attention
    ours = build_model(config)
    for length in (12, 24):  # inside and past the sliding window and Phi-3's original context
        tokens = torch.randint(0, 300, (2, length))
        with torch.no_grad():
            torch.testing.assert_close(ours.logits(tokens), reference_logits(hf_dirs[arch], tokens), rtol=1e-5,
                                       atol=1e-5)


def export_model(config, model, out):
    staging = start_export(out)
    write_shard(config, staging, "all", {i: dict(l.named_parameters()) for i, l in enumerate(model.layers)})
    finalize_export(config, staging, out)


def load_all(path):
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_export_without_training_reproduces_the_input_exactly(hf_dirs, arch, tmp_path):
    config = get_config(hf_dirs[arch])
    export_model(config, build_model(config), str(tmp_path / "out"))
    before, after = load_all(hf_dirs[arch]), load_all(str(tmp_path / "out"))
    assert set(before) == set(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads(open(os.path.join(hf_dirs[arch], "config.json")).read())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "phi3", "gemma2", "gemma3", "gemma3mm", "mixtral",
                                  "qwen3_moe", "gpt_oss"])
def test_fine_tune_then_export_loads_in_transformers(hf_dirs, arch, tmp_path):
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches

    cfg = RunConfig.of(model=hf_dirs[arch], steps=3, micro_batch_size=2, micro_batches=2, seq_len=16, lr=1e-2,
                       precision="fp32")
    config = get_config(cfg.model)
    trainer = ReferenceTrainer(cfg, config, make_batches(cfg, config), torch.device("cpu"))
    losses = [trainer.step(k).loss for k in range(3)]
    assert losses[-1] < losses[0]
    out = str(tmp_path / "tuned")
    export_model(config, trainer.model, out)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        ours = trainer.model.logits(tokens)
    torch.testing.assert_close(reference_logits(out, tokens), ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reference_logits(hf_dirs[arch], tokens), ours, atol=1e-3)  # it did change


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "gpt_oss"])
def test_single_and_pipeline_fine_tune_alike(hf_dirs, arch):
    """Full fine-tuning (fp32): the reference and pipelines of 2 and 4 workers (threads), at a
    sequence longer than the sliding window, give the same per-step losses and final weights."""
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches
    from conftest import run_in_threads

    cfg = RunConfig.of(model=hf_dirs[arch], steps=3, micro_batch_size=2, micro_batches=2, seq_len=24, lr=1e-2,
                       precision="fp32", progress=False)
    config = get_config(cfg.model)
    ref = ReferenceTrainer(cfg, config, make_batches(cfg, config), torch.device("cpu"))
    want = [ref.step(k).loss for k in range(3)]
    for workers in (2, 4):
        losses, weights = run_in_threads(RunConfig.from_dict({**cfg.to_dict(), "topology": "cpu", "backend": "pipeline",
                                                               "cpu_workers": workers, "stages": 5}))
        assert losses == pytest.approx(want, rel=1e-5), workers
        for name, p in ref.model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_packed_examples_see_only_themselves_through_a_sliding_window(hf_dirs):
    """Two examples packed in one row of Gemma 2 (sliding window 8 on alternate blocks, longer
    examples than that): each example's logits are those it has alone."""
    from mobius.models.layout import TokenLayout

    model = build_model(get_config(hf_dirs["gemma2"]))
    a, b = torch.randint(0, 300, (1, 13)), torch.randint(0, 300, (1, 11))
    layout = TokenLayout(positions=torch.cat([torch.arange(13), torch.arange(11)])[None],
                         segments=torch.tensor([0] * 13 + [1] * 11)[None])
    with torch.no_grad():
        packed = model.logits(torch.cat([a, b], dim=1), layout)
        torch.testing.assert_close(packed[:, :13], model.logits(a), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(packed[:, 13:], model.logits(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_pipeline_fine_tunes_llama_dir_like_single_and_exports(hf_dirs, tmp_path):
    from mobius.backends.pipeline import launch_pipeline
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches

    out = str(tmp_path / "piped")
    cfg = RunConfig.of(model=hf_dirs["llama"], backend="pipeline", topology="cpu", cpu_workers=2, stages=4, steps=3,
                       micro_batch_size=2, micro_batches=2, seq_len=16, lr=1e-2, progress=False, export=out)
    config = get_config(cfg.model)
    history = launch_pipeline(resolve(cfg, backend="pipeline"), config)
    ref_cfg = RunConfig.from_dict({**cfg.to_dict(), "precision": "fp32", "export": None})
    ref = ReferenceTrainer(ref_cfg, config, make_batches(ref_cfg, config), torch.device("cpu"))
    ref_losses = [ref.step(k).loss for k in range(3)]
    for m, r in zip(history, ref_losses):
        assert abs(m.loss - r) / r < 1e-5
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reference_logits(out, tokens), ref.model.logits(tokens), rtol=1e-4, atol=1e-5)


def test_tokenizer_json_and_jsonl_data(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    tok.save(str(model_dir / "tokenizer.json"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "again hello"}) + "\n")
    ids = load_corpus(data, tokenizer=tokenizer_for(str(model_dir)))
    assert list(ids) == [1, 2, 3, 1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    from mobius.boundary.errors import InputError
    with pytest.raises(InputError, match="line 1: a record with fields \\['content'\\] is of no known shape"):
        load_corpus(bad)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["8x3090-4+4", "4x4090"])
def test_plans_for_llama_8b_and_qwen_32b_shapes_from_config_only(tmp_path, topology):
    from mobius.planning.planner import make_plan
    from mobius.planning.prepare import get_profile
    from topology import load_preset

    shapes = {
        "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                         "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                         "rope_theta": 500000.0, "tie_word_embeddings": False,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        "qwen2.5-32b": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
                        "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 64,
                        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                        "rope_theta": 1000000.0, "tie_word_embeddings": False},
    }
    for name, cfg in shapes.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        config = get_config(str(d))
        topo = load_preset(topology)
        profile = get_profile(str(d), config, topo, 1, 1024, "bf16", "analytic")
        plan = make_plan(str(d), config, topo, 1, topo.n, 1024, "bf16", profile=profile, use_cache=False, effort=4)
        assert plan.predicted_step_s > 0
        assert plan.bounds[-1][1] == cfg["num_hidden_layers"] + 2


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 3])
def test_pipeline_tied_gpt2_one_worker_matches_single(hf_dirs, stages):
    """Both copies of the tied table in one stage (1) or in different stages of one worker (3)."""
    from mobius.backends.pipeline import launch_pipeline
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches

    cfg = RunConfig.of(model=hf_dirs["gpt2"], backend="pipeline", topology="cpu", cpu_workers=1, stages=stages, steps=3,
                       micro_batch_size=2, micro_batches=2, seq_len=16, lr=1e-2, progress=False)
    config = get_config(cfg.model)
    history = launch_pipeline(resolve(cfg, backend="pipeline"), config)
    ref = ReferenceTrainer(RunConfig.from_dict({**cfg.to_dict(), "precision": "fp32"}), config,
                           make_batches(cfg, config), torch.device("cpu"))
    for m, k in zip(history, range(3)):
        r = ref.step(k).loss
        assert abs(m.loss - r) / r < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_chunked_fine_tunes_a_mixture_of_experts_like_single(hf_dirs, arch):
    """Mixtral and GPT-OSS on the chunked engine's 2 processes (their chunks traced on the meta
    device, where nothing can be routed) give the single backend's losses."""
    from topology import cpu_topology

    from mobius.backends.chunked import launch_chunked
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches, make_data

    cfg = RunConfig.of(model=hf_dirs[arch], steps=3, micro_batch_size=2, micro_batches=2, seq_len=16, lr=1e-2,
                       precision="fp32", progress=False, topology="cpu", cpu_workers=2, backend="chunked")
    config = get_config(cfg.model)
    ref = ReferenceTrainer(cfg.changed(backend="single"), config, make_batches(cfg, config), torch.device("cpu"))
    want = [ref.step(k).loss for k in range(3)]
    history = launch_chunked(resolve(cfg, cpu_topology(2), "chunked"), config, data=make_data(cfg, config))
    assert [m.loss for m in history] == pytest.approx(want, rel=1e-5)


def test_mxfp4_experts_are_read_as_transformers_dequantizes_them_and_export_in_bf16(tmp_path):
    """GPT-OSS as published: its experts' weights MXFP4 (``*_blocks`` + ``*_scales``, config.json's
    quantization_config).  Read, they are transformers' own dequantization (its
    ``convert_moe_packed_tensors``): our logits equal transformers' on a directory holding those bf16
    tensors; an export writes them under transformers' bf16 names with no quantization_config, and
    transformers loads it to the same logits."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from conftest import save_hf_model

    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=300, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8))
    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    save_hf_model(model, plain)
    save_hf_model(model, packed)
    tensors, quantized = load_file(str(plain / "model.safetensors")), {}
    g = torch.Generator().manual_seed(0)
    for name in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        e, fan_in, fan_out = tensors[name].shape
        blocks = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 124, (e, fan_out, fan_in // 32), dtype=torch.uint8, generator=g)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        tensors[name] = convert_moe_packed_tensors(blocks, scales)  # bf16, (E, in, out)
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    save_file({**{k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}, **quantized},
              str(packed / "model.safetensors"), metadata={"format": "pt"})
    settings = json.loads((packed / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(settings))

    config = get_config(str(packed))
    ours = build_model(config)
    tokens = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        want = reference_logits(str(plain), tokens)
        torch.testing.assert_close(ours.logits(tokens), want, rtol=1e-5, atol=1e-5)
    export_model(config, ours, str(tmp_path / "out"))
    exported = load_all(str(tmp_path / "out"))
    assert set(exported) == set(tensors)
    for k, v in tensors.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(reference_logits(str(tmp_path / "out"), tokens), want, rtol=1e-5, atol=1e-5)
