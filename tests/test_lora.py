"""LoRA against a peer: the same tiny GPT-2 and Llama fine-tuned with ``transformers`` + ``peft``
(same data, same adapter initialisation, same AdamW and schedule, fp32) give our per-step losses on
the single backend and on the pipeline; our exports load in PEFT and ``transformers``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from mobius.config import RunConfig  # noqa: E402
from mobius.models import build_model  # noqa: E402
from mobius.models.adapters import adapter_tensor_count, adapter_tensors, layer_states  # noqa: E402
from mobius.reference import ReferenceTrainer  # noqa: E402
from mobius.runtime import checkpoint as ck  # noqa: E402
from mobius.runtime.inputs import check_model_input, make_batches, model_config_for  # noqa: E402
from mobius.runtime.optim import UpdateRule  # noqa: E402
from mobius.train import main  # noqa: E402

STEPS, M, MBS, SEQ, RANK = 4, 2, 2, 16, 4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from tiny_hf_models import make_dirs

    return make_dirs(tmp_path_factory.mktemp("lora-hf"))


def lora_cfg(path: str, **kw) -> RunConfig:
    return RunConfig.of(model=path, steps=STEPS, micro_batches=M, micro_batch_size=MBS, seq_len=SEQ, lr=1e-2,
                        precision="fp32", lora_rank=RANK, lora_alpha=8.0, progress=False, **kw)


def initial_adapters(cfg: RunConfig) -> dict[str, torch.Tensor]:
    config = model_config_for(cfg)
    model = build_model(config, seed=cfg.optim.seed)
    return adapter_tensors(config, layer_states(dict(model.named_parameters())))


def peft_library():
    """PEFT, imported by the tests that compare with it (seconds of imports: bitsandbytes, inductor)."""
    return pytest.importorskip("peft")


def peft_model(path: str, cfg: RunConfig, adapters: dict[str, torch.Tensor]):
    from mobius.models.adapters import adapter_config

    peft = peft_library()
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    settings = adapter_config(model_config_for(cfg))
    lora = peft.LoraConfig(r=settings["r"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
                           target_modules=settings["target_modules"], target_parameters=settings["target_parameters"],
                           fan_in_fan_out=settings["fan_in_fan_out"],
                           task_type="CAUSAL_LM", use_dora=settings["use_dora"])
    model = peft.get_peft_model(base, lora)
    result = peft.set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys
    return model


def peer_losses(path: str, cfg: RunConfig) -> list[float]:
    """``transformers`` + ``peft``, trained as our reference trains: fused AdamW (weight decay on
    matrices: every adapter, not DoRA's magnitudes), warm-up + cosine schedule, loss / M per
    micro-batch (with a mixture's load-balancing loss where its config turns it on)."""
    model = peft_model(path, cfg, initial_adapters(cfg))
    trainable = [p for p in model.parameters() if p.requires_grad]
    rule = UpdateRule.of(cfg.optim)
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": rule.weight_decay},
                             {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}],
                            lr=rule.lr, betas=rule.betas, eps=rule.eps, fused=True)
    batches = make_batches(cfg, model_config_for(cfg))
    losses = []
    for step in range(cfg.optim.steps):
        for g in opt.param_groups:
            g["lr"] = rule.lr_at(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in batches.step(step):
            out = model(mb.tokens)
            logits = out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.targets.reshape(-1))
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            (loss / M).backward()
            total += loss.item()
        opt.step()
        losses.append(total / M)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "phi3", "gemma2", "gemma3", "gemma3mm", "mixtral",
                                  "qwen3_moe", "gpt_oss"])
def test_single_and_pipeline_equal_peft(hf_dirs, arch):
    from conftest import run_in_threads

    path = hf_dirs[arch]
    # Qwen3-MoE's dense block: PEFT (0.21, on transformers 5) turns gate_proj/up_proj into the experts'
    # fused gate_up_proj and adapts no dense MLP; attention alone is compared.
    targets = {"lora_targets": ("qkv", "proj")} if arch == "qwen3_moe" else {}
    cfg = lora_cfg(path, **targets)
    want = peer_losses(path, cfg)
    trainer = ReferenceTrainer(cfg, model_config_for(cfg), make_batches(cfg, model_config_for(cfg)),
                               torch.device("cpu"))
    single = [trainer.step(k).loss for k in range(STEPS)]
    assert single == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]
    for workers in (2, 4):
        pipe = lora_cfg(path, topology="cpu", cpu_workers=workers, stages=4, recompute="on", **targets)
        losses, weights = run_in_threads(pipe)
        assert losses == pytest.approx(want, rel=1e-5), workers
        base = dict(build_model(model_config_for(pipe), seed=pipe.optim.seed).named_parameters())
        for name, p in base.items():  # the base weights never moved
            if not p.requires_grad:
                assert torch.equal(weights[name], p.detach()), name


@pytest.mark.slow
@pytest.mark.parametrize("arch,names,ours", [("llama", "q_proj,v_proj", ("qkv.0", "qkv.2")),
                                             ("gpt2", "c_proj", ("proj", "fc_out")),
                                             ("qwen3", "o_proj,gate_proj", ("proj", "fc.0"))])
def test_peft_module_names_adapt_those_modules_alone_as_peft_does(hf_dirs, arch, names, ours):
    """``--lora-targets`` in PEFT's module names (q and v alone, PEFT's classic choice; GPT-2's
    c_proj, which names attention's output and the MLP's): the same modules adapted as PEFT adapts
    them, single and pipeline equal to it, the adapter's target_modules PEFT's names."""
    from conftest import run_in_threads

    from mobius.models.adapters import adapter_config

    path = hf_dirs[arch]
    cfg = lora_cfg(path, lora_targets=tuple(names.split(",")))
    config = model_config_for(cfg)
    assert config.lora_targets == ours
    assert {t.rsplit(".", 1)[-1] for t in adapter_config(config)["target_modules"]} == set(names.split(","))
    want = peer_losses(path, cfg)
    trainer = ReferenceTrainer(cfg, config, make_batches(cfg, config), torch.device("cpu"))
    assert [trainer.step(k).loss for k in range(STEPS)] == pytest.approx(want, rel=1e-5)
    losses, _ = run_in_threads(lora_cfg(path, lora_targets=tuple(names.split(",")), topology="cpu", cpu_workers=2,
                                        stages=4, recompute="on"))
    assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("arch,dora", [("llama", False), ("mixtral", False), ("qwen3_moe", False),
                                       ("qwen3_moe", True), ("gpt_oss", False)])
def test_an_adapter_export_holds_each_adapted_part_of_each_block_that_has_it(hf_dirs, arch, dora):
    """Qwen3-MoE's dense block has an MLP to adapt, its mixtures do not: the export's count (what
    a finished export is checked against) is what the model's adapters give."""
    config = model_config_for(lora_cfg(hf_dirs[arch], use_dora=dora))
    tensors = adapter_tensors(config, layer_states(dict(build_model(config).named_parameters())))
    assert len(tensors) == adapter_tensor_count(config) > 0


def test_lora_targets_are_ours_or_the_familys_peft_names(hf_dirs):
    from mobius.boundary.errors import InputError

    assert model_config_for(lora_cfg(hf_dirs["llama"], lora_targets=("v_proj", "qkv"))).lora_targets == ("qkv",)
    assert model_config_for(lora_cfg(hf_dirs["llama"], lora_targets=("up_proj", "k_proj"))).lora_targets == \
        ("qkv.1", "fc.1")
    with pytest.raises(InputError, match="give distinct names among qkv, proj, fc, fc_out or llama's q_proj, k_proj"):
        model_config_for(lora_cfg(hf_dirs["llama"], lora_targets=("query",)))
    with pytest.raises(InputError, match="give distinct names among qkv, proj, fc, fc_out$"):
        model_config_for(RunConfig.of(model="tiny", lora_rank=4, lora_targets=("q_proj",)))
    with pytest.raises(InputError, match="give distinct names among qkv, proj, fc, fc_out or"):  # not a mixture
        model_config_for(lora_cfg(hf_dirs["llama"], lora_targets=("router",)))
    assert model_config_for(lora_cfg(hf_dirs["mixtral"], lora_targets=("experts.down_proj", "gate"))).lora_targets \
        == ("router", "experts_out")
    with pytest.raises(InputError, match="router, experts_fc, experts_out or mixtral's q_proj, .*gate, "
                                         "experts.gate_up_proj, experts.down_proj"):
        model_config_for(lora_cfg(hf_dirs["mixtral"], lora_targets=("experts",)))
    for flag in ({"lora_dropout": 0.1}, {"use_dora": True}):
        with pytest.raises(InputError, match="--lora-targets experts_fc: adapters on a mixture's router and experts "
                                             "take no --(lora-dropout|use-dora)"):
            check_model_input(lora_cfg(hf_dirs["mixtral"], lora_targets=("experts_fc",), **flag))


def test_adapters_of_some_parts_export_and_merge_as_peft(hf_dirs):
    """q and v adapted alone (trained: B not zero): the exported tensors load into PEFT, whose
    merged q_proj and v_proj are ours merged, and k_proj is the base's."""
    from mobius.models.adapters import merged_layers

    cfg = lora_cfg(hf_dirs["llama"], lora_targets=("q_proj", "v_proj"))
    config = model_config_for(cfg)
    model = build_model(config, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    assert not any(n.endswith(("qkv.lora_A.1", "qkv.lora_B.1")) for n, _ in model.named_parameters())  # no k
    states = layer_states(dict(model.named_parameters()))
    theirs = peft_model(hf_dirs["llama"], cfg, adapter_tensors(config, states)).merge_and_unload().state_dict()
    ours = merged_layers(config, states)[1]["qkv.weight"]
    q, k, v = ours.split([config.attention_width, config.kv_width, config.kv_width])
    for name, want in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        torch.testing.assert_close(theirs[f"model.layers.0.self_attn.{name}.weight"], want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(q, states[1]["qkv.weight"][:config.attention_width])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dora_on_single_and_pipeline_equals_peft(hf_dirs, arch):
    """DoRA (``--use-dora``, PEFT's ``use_dora``): the magnitudes train apart from the directions,
    whose norms are constants in backward; our single and pipeline runs give PEFT's losses, from
    the same adapters and magnitudes (the base rows' norms), on GPT-2's fused and Llama's split
    projections."""
    from conftest import run_in_threads

    path = hf_dirs[arch]
    cfg = lora_cfg(path, use_dora=True)
    start = initial_adapters(cfg)
    assert any(k.endswith("lora_magnitude_vector") for k in start)
    want = peer_losses(path, cfg)
    assert want != pytest.approx(peer_losses(path, lora_cfg(path)), rel=1e-4)  # DoRA trains otherwise
    trainer = ReferenceTrainer(cfg, model_config_for(cfg), make_batches(cfg, model_config_for(cfg)),
                               torch.device("cpu"))
    assert [trainer.step(k).loss for k in range(STEPS)] == pytest.approx(want, rel=1e-5)
    losses, _ = run_in_threads(lora_cfg(path, use_dora=True, topology="cpu", cpu_workers=2, stages=4, recompute="on"))
    assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_a_dora_export_loads_in_peft_and_merges(hf_dirs, tmp_path):
    path = hf_dirs["llama"]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    main(["--model", path, "--backend", "single", "--steps", "3", "--micro-batches", "2", "--micro-batch-size", "2",
          "--seq-len", "16", "--lr", "1e-2", "--lora-rank", "4", "--use-dora", "--no-progress",
          "--export", str(adapter), "--export-merged", str(merged)])
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with_adapter = peft_library().PeftModel.from_pretrained(base, str(adapter)).eval()
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(tokens).logits, merged_model(tokens).logits, rtol=1e-5, atol=1e-5)


def routed_targets(arch: str) -> tuple[str, ...]:
    """A mixture's router (by its module's name), both expert stacks and q, by PEFT's names."""
    return ("router" if arch == "gpt_oss" else "gate", "experts.gate_up_proj", "experts.down_proj", "q_proj")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_router_and_expert_adapters_export_and_merge_as_peft(hf_dirs, tmp_path, arch):
    """Adapters on the router, both expert stacks and q, B drawn (as after training): PEFT, given
    our exported tensors (its target_parameters), computes our logits; our merged export, loaded by
    transformers, computes them too; GPT-OSS's interleaved gate | up included."""
    from mobius.models.adapters import finish_export, write_export_shard
    from mobius.models.hf import start_export

    cfg = lora_cfg(hf_dirs[arch], lora_targets=routed_targets(arch))
    config = model_config_for(cfg)
    assert config.lora_targets == ("qkv.0", "router", "experts_fc", "experts_out")
    model = build_model(config, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    states = layer_states(dict(model.named_parameters()))
    tensors = adapter_tensors(config, states)
    assert len(tensors) == adapter_tensor_count(config) == 8 * sum(config.is_moe(j) for j in range(config.n_layer)) \
        + 2 * sum(not config.is_moe(j) for j in range(config.n_layer))
    tokens = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        ours = model.logits(tokens)
        theirs = peft_model(hf_dirs[arch], cfg, tensors).eval()(tokens).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[arch], dtype=torch.float32)(tokens).logits
        assert not torch.allclose(base, ours, atol=1e-3)  # the adapters changed it
    out = tmp_path / "merged"
    staging = start_export(str(out))
    write_export_shard(config, staging, "all", states, merged=True)
    finish_export(config, staging, str(out), merged=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_router_and_expert_adapters_train_as_peft_on_single_and_pipeline(hf_dirs, arch):
    """The same targets trained: the reference and a 2-worker pipeline give PEFT's losses."""
    from conftest import run_in_threads

    path = hf_dirs[arch]
    cfg = lora_cfg(path, lora_targets=routed_targets(arch))
    want = peer_losses(path, cfg)
    trainer = ReferenceTrainer(cfg, model_config_for(cfg), make_batches(cfg, model_config_for(cfg)),
                               torch.device("cpu"))
    assert [trainer.step(k).loss for k in range(STEPS)] == pytest.approx(want, rel=1e-5)
    losses, _ = run_in_threads(lora_cfg(path, lora_targets=routed_targets(arch), topology="cpu", cpu_workers=2,
                                        stages=4, recompute="on"))
    assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe", "gpt_oss"])
def test_exports_load_in_peft_and_transformers(hf_dirs, tmp_path, arch):
    """A pipeline run (2 workers) exports the adapter and the merged model; PEFT's model with our
    adapter, the merged model and ours give the same logits; untouched tensors are the input's
    (a mixture of experts' too: its router and experts are not adapted by default)."""
    from safetensors.torch import load_file

    path = hf_dirs[arch]
    adapter, merged, save = tmp_path / "adapter", tmp_path / "merged", tmp_path / "ck"
    # Qwen3-MoE's dense block: PEFT (0.21, on transformers 5) puts gate_proj/up_proj adapters on the
    # experts' fused gate_up_proj, so attention alone is adapted (as in the training comparison).
    targets = ["--lora-targets", "qkv,proj"] if arch == "qwen3_moe" else []
    main([*targets, "--model", path, "--topology", "cpu", "--cpu-workers", "2", "--steps", "3", "--micro-batches", "2",
          "--micro-batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8", "--no-progress",
          "--export", str(adapter), "--export-merged", str(merged), "--save", str(save)])
    assert {f.name for f in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                   "tokenizer.json", "generation_config.json"}
    assert {f.name for f in merged.iterdir()} >= {"config.json", "tokenizer.json", "generation_config.json"}
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with_adapter = peft_library().PeftModel.from_pretrained(base, str(adapter)).eval()
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        a, b = with_adapter(tokens).logits, merged_model(tokens).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Ours, rebuilt from the checkpoint (adapters only) on the base weights.
    ckpt = ck.load_checkpoint(save)
    assert all(".lora_" in n for n in ckpt.names() if "/" not in n)
    ours = build_model(model_config_for(lora_cfg(path, **({"lora_targets": ("qkv", "proj")} if targets else {}))))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(ckpt.get(name))
        torch.testing.assert_close(ours.logits(tokens), a, rtol=1e-5, atol=1e-5)
    before, after = load_file(os.path.join(path, "model.safetensors")), {}
    for shard in merged.glob("*.safetensors"):  # one file per pipeline stage
        after.update(load_file(str(shard)))
    assert before.keys() == after.keys()
    untouched = [k for k in before if not k.endswith(("_proj.weight",))]
    assert untouched and all(torch.equal(before[k], after[k]) for k in untouched)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("q_proj.weight"))


def test_a_resume_notices_changed_base_weights_and_data(hf_dirs, tmp_path, capsys):
    """The checkpoint records the SHA-256 of the base weights and of the data: a resume on other
    bytes under the same paths is refused in one line, or goes on under --resume-with-changes."""
    import shutil

    from conftest import one_line_exit_2
    from safetensors.torch import load_file, save_file

    model, data, saved = tmp_path / "model", tmp_path / "data.txt", tmp_path / "ck"
    shutil.copytree(hf_dirs["gpt2"], model)
    data.write_text("the user's text. " * 300)
    args = ["--model", str(model), "--data", str(data), "--backend", "single", "--steps", "4", "--micro-batches", "2",
            "--micro-batch-size", "2", "--seq-len", "16", "--lora-rank", "4", "--no-progress"]
    main(args + ["--stop-after", "2", "--save", str(saved)])
    weights = load_file(str(model / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, str(model / "model.safetensors"))
    capsys.readouterr()
    assert one_line_exit_2(main, args + ["--resume", str(saved)], capsys) == (
        f"error: --resume {saved}: the base weights changed since the checkpoint was written (SHA-256 differs); "
        "pass --resume-with-changes to train on them as they are now")
    data.write_text("other text. " * 300)
    assert "the data and base weights changed" in one_line_exit_2(main, args + ["--resume", str(saved)], capsys)
    main(args + ["--resume", str(saved), "--save", str(saved), "--resume-with-changes"])
    assert "note: resuming with changed data and base weights (--resume-with-changes)" in capsys.readouterr().out
    assert ck.load_checkpoint(saved).step == 4


@pytest.mark.slow
def test_qlora_equals_peft_on_bitsandbytes_4bit_base(hf_dirs):
    """``--load-in-4bit``: our NF4 base gives the losses of PEFT on ``transformers``' 4-bit model
    (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, fp32 compute), trained as a
    Trainer trains it (train mode: bitsandbytes' CPU inference kernel computes in bf16), and not those of
    LoRA on the full-precision base; with DoRA too.  The base never moves."""
    pytest.importorskip("bitsandbytes")
    path = hf_dirs["llama64"]  # widths of whole blocks: bitsandbytes' CPU kernels want them
    quantized = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.float32)
    load = transformers.AutoModelForCausalLM.from_pretrained
    for dora in (False, True):
        cfg = lora_cfg(path, load_in_4bit=True, use_dora=dora)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                       lambda p, **kw: load(p, quantization_config=quantized, device_map="cpu", **kw).train())
            want = peer_losses(path, cfg)
        assert want != pytest.approx(peer_losses(path, lora_cfg(path, use_dora=dora)), rel=1e-4)
        config = model_config_for(cfg)
        trainer = ReferenceTrainer(cfg, config, make_batches(cfg, config), torch.device("cpu"))
        base = {n: b.clone() for n, b in trainer.model.named_buffers()}
        assert [trainer.step(k).loss for k in range(STEPS)] == pytest.approx(want, rel=1e-5), dora
        assert len(base) == 2 * 4 * 2 and all(torch.equal(b, base[n]) for n, b in trainer.model.named_buffers())


@pytest.mark.slow
@pytest.mark.parametrize("base", ["full", "4bit"])
def test_lora_checkpoint_resumes_exactly(hf_dirs, tmp_path, base):
    path, a, b = hf_dirs["gpt2"], tmp_path / "a", tmp_path / "b"
    args = ["--model", path, "--backend", "single", "--steps", "6", "--micro-batches", "2", "--micro-batch-size", "2",
            "--seq-len", "16", "--lora-rank", "4", "--no-progress"] + (["--load-in-4bit"] if base == "4bit" else [])
    main(args + ["--stop-after", "3", "--save", str(a), "--metrics", str(tmp_path / "a.jsonl")])
    main(args + ["--resume", str(a), "--save", str(a), "--metrics", str(tmp_path / "a.jsonl")])
    main(args + ["--save", str(b), "--metrics", str(tmp_path / "b.jsonl")])
    read = lambda f: [line for line in open(f)]  # noqa: E731
    import json

    la = [json.loads(x)["loss"] for x in read(tmp_path / "a.jsonl")]
    lb = [json.loads(x)["loss"] for x in read(tmp_path / "b.jsonl")]
    assert la == lb
    ca, cb = ck.load_checkpoint(a), ck.load_checkpoint(b)
    weights = [n for n in cb.names() if "/" not in n]
    assert weights and all(".lora_" in n for n in weights)
    assert all(torch.equal(ca.get(n), cb.get(n)) for n in weights)
