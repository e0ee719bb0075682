"""Bad input, table-driven: every case is one line on stderr naming the problem, exit status 2, no
traceback, and nothing of the user's changed (sha256 of their files before and after)."""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SINGLE, TINY, one_line_exit_2

from mobius.boundary import ownership
from mobius.plan import main as plan_main
from mobius.runtime import checkpoint as ck
from mobius.train import main as train_main
from topology.__main__ import main as topology_main

pytestmark = pytest.mark.adversarial  # the reliability rounds' cases, kept as one set


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (the user's world, for before/after comparisons)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---- options -------------------------------------------------------------------------------------

TRAIN_OPTIONS = [
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--topology", "nope"], "unknown topology preset 'nope'"),
    (["--steps", "0"], "--steps must be positive"),
    (["--micro-batch-size", "-1"], "--micro-batch-size must be positive"),
    (["--seq-len", "4096"], "exceeds tiny's context of 128"),
    (["--lr", "0"], "--lr must be a positive finite number"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--gpu-mem-gb", "inf"], "--gpu-mem-gb must be a positive finite number"),
    (["--gpu-mem-gb", "-2"], "--gpu-mem-gb must be a positive finite number"),
    (["--gpu-mem-gb", "1e300"], "--gpu-mem-gb 1e+300 is more than any device has (at most 4096 GB)"),
    (["--seed", "-1"], "--seed must be between 0 and 2**63-1"),
    (["--steps", "two"], "invalid int value: 'two'"),
    (["--save-every", "2"], "--save-every needs --save"),
    (["--resume-with-changes"], "--resume-with-changes needs --resume"),
    (["--data", "/nonexistent/corpus"], "no such file or directory"),
    (["--resume", "/nonexistent/ckpt"], "no such checkpoint directory"),
    (["--model", "mobius-51b"], "can be planned"),
    (["--model", "mobius-8b"], "GB of host memory"),
    (["--export", "/tmp/x-export"], "--export needs --model to be a Hugging Face directory"),
    (["--backend", "pipeline", "--stages", "99", "--topology", "cpu"], "exceeds the model's 6 layers"),
    (["--backend", "pipeline", "--topology", "cpu", "--cpu-workers", "8"], "fewer than the 8 CPU workers"),
    (["--backend", "pipeline", "--topology", "cpu", "--cpu-workers", "3", "--stages", "2"],
     "--stages 2 is fewer than the 3 CPU workers"),
    (["--backend", "chunked", "--topology", "cpu", "--cpu-workers", "3"], "not divisible by the 3 data-parallel"),
    (["--backend", "pipeline", "--topology", "cpu", "--cpu-workers", "1", "--recompute", "off", "--gpu-mem-gb", "0.003"],
     "--recompute off: worker 0 would hold 7 MiB (its stages' saved activations for all 4 micro-batches"),
    (["--lora-rank", "-1"], "--lora-rank must be zero or positive, got -1"),
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R"),
    (["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha must be a positive finite number, got nan"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be at least 0 and below 1, got 1.0"),
    (["--lora-rank", "4", "--lora-targets", "qkv,mlp"], "--lora-targets 'qkv,mlp': give distinct names among"),
    (["--lora-rank", "4", "--lora-targets", "qkv,qkv"], "--lora-targets 'qkv,qkv': give distinct names among"),
    (["--export-merged", "/tmp/x-merged"], "--export-merged needs --lora-rank R"),
    (["--lora-rank", "4", "--export-merged", "/tmp/x-merged"], "--export-merged needs --model to be a Hugging Face"),
    (["--optimizer-lag", "2"], "invalid choice: 2"),
    (["--backend", "chunked", "--topology", "cpu", "--lora-rank", "4"], "--lora-rank is built for --backend pipeline"),
    (["--backend", "chunked", "--topology", "cpu", "--optimizer-lag", "1"],
     "--optimizer-lag is built for --backend pipeline"),
    (["--backend", "chunked", "--topology", "cpu", "--precision", "fp16"], "fp16 loss scaling is not built there"),
    (["--emulate"], "--topology auto is this machine"),
    (["--emulate", "--topology", "cpu"], "--emulate rehearses a GPU topology (a preset or file); --topology cpu has"),
    (["--backend", "single", "--stages", "3", "--no-prefetch"],
     "--stages, --no-prefetch apply to --backend pipeline, and this run uses --backend single"),
    (["--backend", "pipeline", "--topology", "cpu", "--chunk-size", "1000"],
     "--chunk-size applies to --backend chunked, and this run uses --backend pipeline"),
    (["--backend", "chunked", "--topology", "cpu", "--mapping", "sequential"],
     "--mapping applies to --backend pipeline, and this run uses --backend chunked"),
    (["--lora-rank", "100000"], "--lora-rank 100000 exceeds the 64 of tiny's smallest 'qkv' projection"),
    (["--emulate", "--topology", "topo2+2", "--backend", "single"], "--emulate is built for --backend pipeline"),
    (["--mapping", "diagonal"], "invalid choice: 'diagonal'"),
    (["--micro-batch-size", str(10**9)], "tokens in one micro-batch: more than any device's memory holds"),
    (["--micro-batches", str(2**62)], "tokens a step; at most 17,179,869,184"),
    (["--dilation", "10"], "--dilation F needs --emulate"),
    (["--data-parallel", "3"], "--micro-batches 4 is not divisible by --data-parallel 3"),
    (["--data-parallel", "0"], "--data-parallel must be positive"),
    (["--data-parallel", "2"], "--data-parallel applies to --backend pipeline, and this run uses --backend single"),
    (["--backend", "chunked", "--topology", "cpu", "--data-parallel", "2"],
     "--data-parallel applies to --backend pipeline, and this run uses --backend chunked"),
    (["--backend", "pipeline", "--emulate", "--topology", "topo2+2", "--dilation", "0.5"], "--dilation must be a finite number of at least 1"),
    (["--backend", "chunked", "--topology", "cpu", "--chunk-size", str(10**11)],
     "--chunk-size 100000000000 is more than twice tiny's 238,144 parameters"),
    (["--backend", "chunked", "--topology", "cpu", "--chunk-size", "200000", "--rcache-blocks", "100000",
      "--gpu-mem-gb", "0.001"], "needs 0.0016 GB of rCache on each device, more than its 0.001 GB"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number at least 0"),
    (["--use-dora"], "--use-dora needs --lora-rank R"),
    (["--load-in-4bit"], "--load-in-4bit needs --lora-rank R"),
    (["--lora-rank", "2", "--load-in-4bit", "--export-merged", "m"], "--export-merged with --load-in-4bit"),
    (["--lora-rank", "2", "--load-in-4bit", "--backend", "pipeline", "--topology", "cpu"],
     "--load-in-4bit is built for --backend single"),
    (["--lr-scheduler", "exponential"], "invalid choice: 'exponential'"),
    (["--lr", "1e39"], "--lr 1e+39 is beyond what fp32 holds"),
    (["--adam-eps", "1e-46"], "--adam-eps 1e-46 is below fp32's smallest normal number"),
    (["--warmup-steps", "2"], "a warm-up of 2 steps covers the run's 2"),
    (["--warmup-ratio", "0.6"], "a warm-up of 2 steps covers the run's 2"),
    (["--lr-scheduler", "constant", "--warmup-steps", "1"], "--lr-scheduler constant has no warm-up"),
    (["--precision", "fp16", "--fp16-accumulation"], "--fp16-accumulation is a CUDA GPU's tensor-core mode"),
    (["--backend", "pipeline", "--topology", "cpu", "--schedule", "dispatched", "--replan", "auto"],
     "--schedule dispatched does not run --replan auto yet"),
]


# Refused only once a profile is measured and a plan made (seconds): with the slow tests.
PLANNED_FIRST = {"--backend pipeline --stages 99 --topology cpu",
                 "--backend pipeline --topology cpu --cpu-workers 1 --recompute off --gpu-mem-gb 0.003"}


@pytest.mark.parametrize("args,message", [
    pytest.param(a, m, id=" ".join(a), marks=[pytest.mark.slow] if " ".join(a) in PLANNED_FIRST else [])
    for a, m in TRAIN_OPTIONS])
def test_train_options(args, message, capsys):
    assert message in one_line_exit_2(train_main, SINGLE + args, capsys)


PLAN_OPTIONS = [
    (["--seq-len", "0"], "--seq-len must be positive"),
    (["--gpu-mem-gb", "inf"], "--gpu-mem-gb must be a positive finite number"),
    (["--stages", "0"], "--stages must be positive"),
    (["--cpu-workers", "-1"], "--cpu-workers must be positive"),
    (["--time-limit", "nan"], "--time-limit must be a positive finite number"),
    (["--mip-effort", "0"], "--mip-effort must be at least 1, got 0"),
    (["--topology", "topo2+2", "--emulate", "--profile", "measure"],
     "--profile measure with --emulate: an emulated box is planned from"),
    (["--model", "tiny", "--seq-len", "9999"], "exceeds tiny's context of 128"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--schedule", "dispatched", "--offload-dir", "never-made"], "--schedule dispatched does not run --offload-dir"),
]


@pytest.mark.parametrize("args,message", PLAN_OPTIONS, ids=[" ".join(a) for a, _ in PLAN_OPTIONS])
def test_plan_options(args, message, capsys):
    assert message in one_line_exit_2(plan_main, ["--model", "tiny"] + args, capsys)


def test_topology_command(tmp_path, capsys):
    (tmp_path / "bin.json").write_bytes(b"\x00\x01\xff\xfe")
    (tmp_path / "notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    for args, message in [(["--cpu-workers", "0"], "--cpu-workers must be positive"),
                          (["--bogus"], "unrecognized arguments"),
                          (["--topology", str(tmp_path / "bin.json")], "not UTF-8 text"),
                          (["--write", str(tmp_path)], "is a directory"),
                          (["--write", str(tmp_path / "notes.txt")], "not a topology file; refusing to overwrite")]:
        assert message in one_line_exit_2(topology_main, args, capsys)
    assert snapshot(tmp_path) == before


# ---- topology files --------------------------------------------------------------------------------

def _topology(tmp_path, change) -> str:
    d = json.loads((Path(__file__).parents[1] / "topology" / "presets" / "topo2+2.json").read_text())
    change(d)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    return str(path)


TOPOLOGY_FILES = [
    (lambda d: d["gpus"][0].update(memory_gb=float("nan")), "gpus[0].memory_gb must be a finite number"),
    (lambda d: d["gpus"][1].update(tflops=float("inf")), "gpus[1].tflops must be a finite number"),
    (lambda d: d["gpus"][0].update(memory_gb=0), "must be positive"),
    (lambda d: d["host"].update(memory_gb=-1), "host.memory_gb must be positive"),
    (lambda d: d["root_complexes"][0].update(host_bandwidth_gbps=0), "host_bandwidth_gbps must be positive"),
    (lambda d: d["gpus"][0].update(root_complex=7), "unknown root complex 7"),
    (lambda d: d["gpus"][0].pop("name"), "missing required key gpus[0].name"),
    (lambda d: d.update(gpus=[]), "key gpus is empty"),
]


@pytest.mark.parametrize("change,message", TOPOLOGY_FILES, ids=[m for _, m in TOPOLOGY_FILES])
def test_topology_files(change, message, tmp_path, capsys):
    assert message in one_line_exit_2(train_main, TINY + ["--topology", _topology(tmp_path, change)], capsys)


def test_unreadable_topology_files(tmp_path, capsys):
    (tmp_path / "bin.json").write_bytes(b"\x00\x01\xff\xfe")
    (tmp_path / "cut.json").write_text('{"name": "x"')
    assert "not UTF-8 text" in one_line_exit_2(train_main, TINY + ["--topology", str(tmp_path / "bin.json")], capsys)
    assert "not valid JSON" in one_line_exit_2(train_main, TINY + ["--topology", str(tmp_path / "cut.json")], capsys)


# ---- data --------------------------------------------------------------------------------------------

def test_bad_data(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "number.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "short.txt").write_text("abc")
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a lone \\ud800 here"}\n')
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n{"text": 5}\n')
    os.mkfifo(tmp_path / "fifo")
    newline = tmp_path / "two\nerror: forged.txt"
    newline.write_text("")
    for name, message in [("empty.txt", "empty"), ("number.jsonl", "number.jsonl line 2: 'text' must be a string, got int"),
                          ("notext.jsonl", "notext.jsonl line 1: a record with fields ['body'] is of no known shape"),
                          ("short.txt", "fewer than --seq-len 32 + 2"),
                          ("surrogate.jsonl", "line 1: 'text' holds '\\ud800', a lone surrogate, which is not"),
                          ("bom.jsonl", "bom.jsonl line 2: 'text' must be a string"),  # the BOM is not part of line 1
                          ("fifo", "fifo: not a regular file or directory"),
                          ("/dev/zero", "--data /dev/zero: not a regular file or directory"),
                          (newline.name, "two\\nerror: forged.txt: no text found (empty)")]:
        assert message in one_line_exit_2(train_main, SINGLE + ["--data", str(tmp_path / name)], capsys)


# ---- Hugging Face directories --------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from tiny_hf_models import make_dirs

    return make_dirs(tmp_path_factory.mktemp("hf-bad"))


def _copy(hf, arch, tmp_path) -> Path:
    d = tmp_path / f"{arch}-copy"
    shutil.copytree(hf[arch], d)
    return d


def _config(**changes):
    def change(d: Path):
        c = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                c.pop(k)
            else:
                c[k] = v
        (d / "config.json").write_text(json.dumps(c))
    return change


def _retype(dtype):
    def change(d: Path):
        from safetensors.torch import load_file, save_file

        t = load_file(d / "model.safetensors")
        key = next(k for k in t if k.endswith("wte.weight"))
        t[key] = t[key].to(dtype)
        save_file(t, d / "model.safetensors")
    return change


def _add_tensor(d: Path):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    t["transformer.h.9.attn.c_attn.weight"] = torch.zeros(2)
    save_file(t, d / "model.safetensors")


def _mxfp4_blocks_alone(d: Path):
    """An MXFP4 tensor's packed values without its scales."""
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    t["transformer.h.0.mlp.experts.down_proj_blocks"] = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    save_file(t, d / "model.safetensors")


HF_CASES = [
    ("gpt2", _config(n_layer="2"), "'n_layer' must be an integer, got '2'"),
    ("gpt2", _config(n_layer=[2]), "'n_layer' must be an integer, got [2]"),
    ("gpt2", _config(n_layer=0), "'n_layer' must be at least 1, got 0"),
    ("gpt2", _config(n_layer=10**7), "config.json n_layer = 10000000 is beyond any model that can be built (at most 16,384)"),
    ("llama", _config(vocab_size=10**12), "config.json vocab_size = 1000000000000 is beyond any model"),
    ("gpt2", _config(n_head=0), "'n_head' must be at least 1"),
    ("gpt2", _config(n_head=5), "hidden size 32 is not divisible by 5 attention heads"),
    ("gpt2", _config(n_embd=-32), "'n_embd' must be at least 1"),
    ("gpt2", _config(n_positions=None), "config.json lacks 'n_positions'"),
    ("gpt2", _config(layer_norm_epsilon="x"), "'layer_norm_epsilon' must be a finite number"),
    ("gpt2", _config(tie_word_embeddings="no"), "'tie_word_embeddings' must be true or false"),
    ("gpt2", _config(model_type="bert"), "model_type 'bert' is not supported"),
    ("opt", _config(hidden_size=None), "config.json lacks 'hidden_size'"),
    ("opt", _config(ffn_dim=None), "config.json lacks 'ffn_dim'"),
    ("llama", _config(num_key_value_heads=3), "4 attention heads are not divisible by 3 key-value heads"),
    ("llama", _config(intermediate_size=None), "config.json lacks 'intermediate_size'"),
    ("llama", _config(rope_scaling={"rope_type": "llama3"}), "rope_scaling lacks 'factor'"),
    ("llama", _config(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     "rope_scaling lacks 'original_max_position_embeddings'"),
    ("llama", _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope scaling 'dynamic' is not supported for llama (llama3, linear, yarn)"),
    ("llama", _config(model_type="gemma3", text_config=5), "config.json: 'text_config' must be"),
    ("llama", _config(model_type="phi3", partial_rotary_factor=0.1), "gives 0 rotated dims, not an even number in 2..8"),
    ("llama", _config(model_type="phi3", original_max_position_embeddings=16,
                      rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 4}),
     "rope_scaling short_factor must be 4 positive numbers"),
    ("llama", _config(model_type="gemma2", hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention"]),
     "layer_types must name 'sliding_attention' or 'full_attention' for each of the 3 layers"),
    ("llama", _config(model_type="gemma2", hidden_activation="relu"), "hidden_act 'relu' for gemma2 is not supported"),
    ("llama", _config(model_type="qwen2", use_sliding_window=True), "sliding-window attention (use_sliding_window)"),
    ("llama", _config(rope_theta="big"), "'rope_theta' must be a finite number"),
    ("llama", _config(model_type="deepseek_v3"), "model_type 'deepseek_v3' is not supported (supported: gpt2, opt, "
                                                 "llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, mixtral, "
                                                 "qwen3_moe, gpt_oss, gemma3)"),
    ("llama", _config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                      router_aux_loss_coef=-0.01), "'router_aux_loss_coef' must be"),
    ("llama", _config(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, output_router_logits="yes"),
     "'output_router_logits' must be"),
    ("llama", _config(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3),
     "num_experts_per_tok 3 is more than the 2 experts"),
    ("llama", _config(model_type="qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=8),
     "config.json lacks 'num_local_experts'"),
    ("llama", _config(vocab_size=2.5), "'vocab_size' must be an integer, got 2.5"),
    ("gpt2", lambda d: (d / "config.json").write_bytes(b"\xff\xfe{"), "config.json: is not UTF-8 text"),
    ("gpt2", lambda d: (d / "config.json").write_text("[1, 2]"), "config.json: must be a JSON object, got list"),
    ("gpt2", lambda d: (d / "config.json").write_text("{"), "config.json: not valid JSON"),
    ("gpt2", lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "not a readable safetensors file"),
    ("gpt2", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "not a readable safetensors file"),
    ("gpt2", lambda d: shutil.copy(d / "model.safetensors", d / "model-2.safetensors"), "is in both"),
    ("gpt2", _retype(torch.int16), "has dtype I16, which Mobius does not load"),
    ("gpt2", _retype(torch.float8_e4m3fn), "has dtype F8_E4M3, which Mobius does not load"),
    ("gpt2", _retype(torch.int32), "1 tensors not floating point (transformer.wte.weight)"),
    ("gpt2", _add_tensor, "1 tensors not used by this model (transformer.h.9.attn.c_attn.weight)"),
    ("gpt2", _mxfp4_blocks_alone, "transformer.h.0.mlp.experts.down_proj_blocks and "
                                  "transformer.h.0.mlp.experts.down_proj_scales are not an MXFP4 pair"),
    ("gpt2", lambda d: (d / "tokenizer.json").write_text("{not json"), "not a readable tokenizer.json"),
    ("gpt2", lambda d: [f.unlink() for f in d.glob("*.safetensors")], "no *.safetensors weights"),
]


@pytest.mark.parametrize("arch,change,message", HF_CASES, ids=[m[:40] for _, _, m in HF_CASES])
def test_hugging_face_directories(hf, arch, change, message, tmp_path, capsys):
    d = _copy(hf, arch, tmp_path)
    change(d)
    before = snapshot(d)
    assert message in one_line_exit_2(train_main, ["--model", str(d), "--seq-len", "16", "--steps", "1",
                                                   "--backend", "single", "--no-progress"], capsys)
    assert snapshot(d) == before


def test_an_export_the_chunked_backend_does_not_build_is_refused(hf, tmp_path, capsys):
    model, export = _copy(hf, "gpt2", tmp_path), tmp_path / "tuned"
    assert "--export is not built for --backend chunked" in one_line_exit_2(
        train_main, ["--model", str(model), "--backend", "chunked", "--topology", "cpu", "--export", str(export),
                     "--seq-len", "16", "--steps", "1", "--no-progress"], capsys)
    assert not export.exists()


# ---- the user's files are never replaced ------------------------------------------------------------------

@pytest.mark.slow
def test_outputs_never_replace_the_users_files(hf, tmp_path, capsys):
    """Each class of output collision is refused before training, and every file is unchanged."""
    model = _copy(hf, "gpt2", tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("some training text " * 400)
    export = tmp_path / "tuned"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "eval-results.txt").write_text("accuracy 0.91")
    notes = tmp_path / "notes.txt"
    notes.write_text("thesis draft")
    for sibling in ("run.tmp", "run.old", "tuned.tmp-export"):  # the names earlier versions deleted
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "keep.txt").write_text("mine")
    theirs = tmp_path / "theirs"
    train_main(SINGLE + ["--save", str(theirs)])
    capsys.readouterr()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thing.bin").write_bytes(b"\x00" * 10)
    partial = ownership.sibling(tmp_path / "run2", "partial")
    partial.mkdir()
    (partial / "mine.txt").write_text("not Mobius'")
    before = snapshot(tmp_path)

    hf_run = ["--model", str(model), "--seq-len", "16", "--steps", "1", "--backend", "single", "--no-progress"]
    cases = [
        (hf_run + ["--export", str(export)], "was not written by Mobius"),
        (hf_run + ["--export", str(model)], "overlaps --model"),
        (hf_run + ["--export", str(model / "sub")], "overlaps --model"),
        (hf_run + ["--metrics", str(model / "config.json")], "overlaps --model"),
        (hf_run + ["--data", str(data), "--metrics", str(data)], "overlaps --data"),
        (hf_run + ["--data", str(tmp_path), "--metrics", str(tmp_path / "m.jsonl")], "overlaps --data"),
        (hf_run + ["--save", str(tmp_path / "x"), "--export", str(tmp_path / "x")], "overlap"),
        (SINGLE + ["--save", str(tmp_path / "x"), "--metrics", str(tmp_path / "x" / "m.jsonl")], "overlap"),
        (SINGLE + ["--metrics", str(tmp_path / "x.json"), "--trace", str(tmp_path / "x.json")], "overlap"),
        (SINGLE + ["--metrics", str(notes)], "is not a file Mobius wrote"),
        (SINGLE + ["--trace", str(notes)], "is not a file Mobius wrote"),
        (SINGLE + ["--metrics", str(tmp_path)], "is a directory"),
        (SINGLE + ["--save", str(notes)], "exists and is not a directory"),
        (SINGLE + ["--save", str(tmp_path / "foreign")], "was not written by Mobius"),
        (SINGLE + ["--save", str(theirs)], "holds the checkpoint of another run; continue it with --resume"),
        (SINGLE + ["--save", str(tmp_path / "run2")], "was not written by Mobius"),
        (SINGLE + ["--resume", str(theirs), "--metrics", str(theirs / "m.jsonl")], "overlaps --resume"),
    ]
    for argv, message in cases:
        assert message in one_line_exit_2(train_main, argv, capsys), argv
    assert snapshot(tmp_path) == before

    # What earlier versions deleted (run.tmp, run.old, tuned.tmp-export) now survives real runs.
    train_main(SINGLE + ["--save", str(tmp_path / "run")])
    train_main(hf_run + ["--export", str(tmp_path / "tuned2"), "--metrics", str(tmp_path / "m.jsonl")])
    after = snapshot(tmp_path)
    assert all(after[k] == v for k, v in before.items())
    # Our own outputs are replaced when asked: a second export over ours, metrics over ours.
    train_main(hf_run + ["--export", str(tmp_path / "tuned2"), "--metrics", str(tmp_path / "m.jsonl")])


@pytest.mark.slow
def test_ownership_is_by_content(hf, tmp_path, capsys):
    """Files that only look like ours, and ours once the user changed them, are the user's."""
    model = _copy(hf, "gpt2", tmp_path / "m")
    hf_run = ["--model", str(model), "--seq-len", "16", "--steps", "1", "--backend", "single", "--no-progress"]
    other_trace = tmp_path / "profile.json"  # another tool's Chrome trace
    other_trace.write_text('{"traceEvents": [{"name": "kernel", "ph": "X", "ts": 0, "dur": 5}]}')
    their_log = tmp_path / "log.jsonl"  # a log of theirs with our keys
    their_log.write_text('{"step": 0, "loss": 2.5, "lr": 0.1, "tokens": 64}\n')
    train_main(hf_run + ["--export", str(tmp_path / "tuned"), "--metrics", str(tmp_path / "ours.jsonl"),
                         "--trace", str(tmp_path / "ours.json")])
    capsys.readouterr()
    (tmp_path / "tuned" / "config.json").write_text('{"saved": "by the user over our export"}')
    with open(tmp_path / "ours.jsonl", "a") as f:
        f.write('{"note": "the user added a line"}\n')
    before = snapshot(tmp_path)
    cases = [
        (SINGLE + ["--trace", str(other_trace)], "is not a file Mobius wrote"),
        (SINGLE + ["--metrics", str(their_log)], "is not a file Mobius wrote"),
        (hf_run + ["--export", str(tmp_path / "tuned")], "holds files Mobius did not write or that changed since "
                                                          "(config.json)"),
        (SINGLE + ["--metrics", str(tmp_path / "ours.jsonl")], "is not a file Mobius wrote (or it changed since)"),
    ]
    for argv, message in cases:
        assert message in one_line_exit_2(train_main, argv, capsys), argv
    assert snapshot(tmp_path) == before
    train_main(SINGLE + ["--trace", str(tmp_path / "ours.json")])  # ours, unchanged: replaced when asked


# ---- checkpoints ----------------------------------------------------------------------------------------

@pytest.fixture()
def saved(tmp_path):
    d = tmp_path / "ck"
    train_main(SINGLE + ["--save", str(d)])
    return d


def _edit_manifest(d: Path, **changes) -> None:
    m = json.loads((d / ck.MANIFEST).read_text())
    m.update(changes)
    (d / ck.MANIFEST).write_text(json.dumps(m))


def test_a_checkpoint_of_the_earlier_schedules_resumes_only_when_asked(saved):
    """Before the schedules were transformers', "cosine" decayed to 10% after a warm-up from above
    0: a checkpoint without the mark does not silently continue on another schedule."""
    from mobius.config import parse_train_args
    from mobius.models import get_config

    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest.pop("lr_schedules") == "transformers"
    manifest["digest"] = ck.manifest_digest(manifest)
    (saved / "manifest.json").write_text(json.dumps(manifest))
    old, run = ck.load_checkpoint(saved, verify=False), SINGLE + ["--resume", str(saved), "--precision", "fp32"]
    with pytest.raises(ck.CheckpointError, match="earlier learning-rate schedules"):
        ck.check_compatible(old, get_config("tiny").to_dict(), parse_train_args(run), set())
    ck.check_compatible(old, get_config("tiny").to_dict(), parse_train_args(run + ["--resume-with-changes"]), set())


def test_a_checkpoint_written_before_a_model_field_existed_resumes(saved, tmp_path):
    """A model field added since (a Qwen3 head size) has its default in an older checkpoint."""
    manifest = json.loads((saved / "manifest.json").read_text())
    for key in ("head_size", "qk_norm"):
        del manifest["model_config"][key]
    manifest["digest"] = ck.manifest_digest(manifest)
    (saved / "manifest.json").write_text(json.dumps(manifest))
    from mobius.config import parse_train_args
    from mobius.models import get_config

    old = ck.load_checkpoint(saved, verify=False)
    ck.check_compatible(old, get_config("tiny").to_dict(), parse_train_args(SINGLE + ["--resume", str(saved), "--precision", "fp32"]),
                        set())  # no CheckpointError: the same model


def test_edited_manifest_is_refused(saved, capsys):
    _edit_manifest(saved, step=1)
    message = one_line_exit_2(train_main, SINGLE + ["--resume", str(saved)], capsys)
    assert "manifest.json was modified after it was written" in message


def test_removed_optimizer_file_and_entry_is_refused(saved, capsys):
    (saved / "optimizer.safetensors").unlink()
    m = json.loads((saved / ck.MANIFEST).read_text())
    del m["files"]["optimizer.safetensors"]
    m["digest"] = ck.manifest_digest(m)  # even with a recomputed digest: the tensors are required
    (saved / ck.MANIFEST).write_text(json.dumps(m))
    message = one_line_exit_2(train_main, SINGLE + ["--resume", str(saved)], capsys)
    assert "incomplete checkpoint" in message and "exp_avg/" in message


@pytest.mark.parametrize("change,listed", [(["--lr", "2e-3"], "--lr 0.001 -> 0.002"),
                                           (["--steps", "3"], "--steps 2 -> 3"),
                                           (["--precision", "bf16"], "--precision 'fp32' -> 'bf16'"),
                                           (["--micro-batches", "2"], "--micro-batches 4 -> 2"),
                                           (["--seq-len", "16"], "--seq-len 32 -> 16")])
def test_resume_with_changed_settings_is_refused_listing_them(saved, change, listed, capsys):
    message = one_line_exit_2(train_main, SINGLE + ["--resume", str(saved)] + change, capsys)
    assert "changes settings of the checkpoint's run" in message and listed in message


def test_resume_with_changes_applies_them(saved, tmp_path, capsys):
    """With the override, a switch to fp16 starts a fresh loss scale instead of fp32's 1.0."""
    train_main(SINGLE + ["--resume", str(saved), "--save", str(saved), "--steps", "3", "--precision", "fp16",
                         "--resume-with-changes", "--metrics", str(tmp_path / "m.jsonl")])
    scales = [json.loads(line)["loss_scale"] for line in open(tmp_path / "m.jsonl")]
    assert scales == [2.0**16]
    assert ck.load_checkpoint(saved).manifest["precision"] == "fp16"


def test_full_disk_during_save_is_one_line_and_keeps_the_checkpoint(saved, monkeypatch, capsys):
    import safetensors.torch

    before = snapshot(saved)

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(SystemExit) as info:
        train_main(SINGLE + ["--resume", str(saved), "--save", str(saved), "--steps", "3", "--resume-with-changes"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(err) == 1
    assert "No space left on device" in err[0] and "previous checkpoint is intact" in err[0]
    assert snapshot(saved) == before and ck.load_checkpoint(saved).step == 2


def test_confinement_of_manifest_names_and_model_files(hf, saved, tmp_path, capsys):
    """A manifest may name only files of its checkpoint (even with its digest recomputed); an export
    copies only regular files inside the model directory, checked before training."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    for name in ("../id_rsa", str(secret)):
        m = json.loads((saved / ck.MANIFEST).read_text())
        m["files"][name] = hashlib.sha256(secret.read_bytes()).hexdigest()
        m["digest"] = ck.manifest_digest(m)
        (saved / ck.MANIFEST).write_text(json.dumps(m))
        message = one_line_exit_2(train_main, SINGLE + ["--resume", str(saved)], capsys)
        assert f"names {name!r}, not a file of the checkpoint" in message
        del m["files"][name]
        m["digest"] = ck.manifest_digest(m)
        (saved / ck.MANIFEST).write_text(json.dumps(m))
    model = _copy(hf, "gpt2", tmp_path / "m")
    (model / "merges.txt").symlink_to(secret)
    run = ["--model", str(model), "--seq-len", "16", "--steps", "1", "--backend", "single", "--no-progress"]
    message = one_line_exit_2(train_main, run + ["--export", str(tmp_path / "out")], capsys)
    assert "merges.txt is not a regular file inside the model directory" in message
    assert not (tmp_path / "out").exists()


def test_limits_of_the_environment_are_one_line(tmp_path, monkeypatch, capsys):
    """A file-size limit below what the run writes is refused before training; memory running out
    below what the pre-flight could see is one line and exit 1; an output under /proc is refused."""
    import resource

    from mobius import train

    monkeypatch.setattr(train.resource, "getrlimit", lambda kind: (4096, resource.RLIM_INFINITY))
    message = one_line_exit_2(train_main, SINGLE + ["--save", str(tmp_path / "ck")], capsys)
    assert message.startswith("error: the file-size limit (ulimit -f) is 4096 bytes, but this run writes files of up")
    assert not (tmp_path / "ck").exists()
    monkeypatch.undo()
    assert "cannot create its lock /proc/.x.mobius-lock" in one_line_exit_2(train_main, SINGLE + ["--save", "/proc/x"],
                                                                             capsys)

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(train, "make_data", no_memory)
    with pytest.raises(SystemExit) as info:
        train_main(SINGLE)
    assert info.value.code == 1 and capsys.readouterr().err.strip().splitlines() == [
        "error: out of host memory (MemoryError): free memory, raise the limit or use a smaller model, data or batch"]


def test_deeply_nested_json_is_one_line(hf, tmp_path, capsys):
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert "JSON nested too deeply" in one_line_exit_2(train_main, SINGLE + ["--topology", str(tmp_path / "deep.json")],
                                                       capsys)
    model = _copy(hf, "gpt2", tmp_path / "m")
    (model / "config.json").write_text("[" * 100_000)
    assert "config.json: JSON nested too deeply" in one_line_exit_2(train_main, SINGLE + ["--model", str(model)], capsys)


def test_cpu_workers_that_would_hold_more_than_the_machine_has_are_refused_before_they_start():
    """On CPU workers a device's memory is the machine's: the host's share, every worker process and
    what each holds of its budget as planned must fit what is available, or the run is one line
    (checked on the plan, before any worker starts)."""
    from mobius.boundary.errors import InputError
    from mobius.config import RunConfig
    from mobius.models import get_config
    from mobius.partition.profile import analytic_profile
    from mobius.planning.pipeline import CPU_WORKER_PROCESS_BYTES, check_cpu_workers_fit, planned_device_bytes
    from mobius.planning.planner import make_plan
    from topology import cpu_topology

    cfg = RunConfig.of(model="tiny", backend="pipeline", topology="cpu", gpu_mem_gb=64.0, seq_len=32)
    config, topo = get_config("tiny"), cpu_topology(2, memory_gb=64.0)
    profile = analytic_profile("tiny", config, 4, 32, 0.05, "fp32")
    plan = make_plan("tiny", config, topo, 4, 4, 32, "fp32", profile=profile, use_cache=False, effort=4)
    held = [planned_device_bytes(plan, k) for k in range(2)]
    assert all(0 < h < 64e9 for h in held)  # what the plan uses, not the budget
    need = sum(held) + 2 * CPU_WORKER_PROCESS_BYTES
    check_cpu_workers_fit(cfg, config, plan, (64 * 10**9,) * 2, int(need * 1.5))
    with pytest.raises(InputError, match=r"model tiny on 2 CPU workers needs 0.\d GB of this machine's memory "
                                         r"\(0.0 GB on the host, 0.\d GB in the workers as planned\), but 0.5 GB are "
                                         "available: use fewer --cpu-workers"):
        check_cpu_workers_fit(cfg, config, plan, (64 * 10**9,) * 2, 500 * 2**20)
    check_cpu_workers_fit(cfg, config, plan, (64 * 10**9,) * 2, None)  # unknown: not checked


@pytest.mark.parametrize("env,message", [
    ({"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID is set but RANK is not"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "abc"}, "torchrun's WORLD_SIZE='abc' is not"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"},
     "do not describe nodes of equal size"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 / LOCAL_RANK=0 is outside"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "is not a port"),
])
def test_torchruns_variables_are_checked_first(env, message, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert message in one_line_exit_2(train_main, SINGLE, capsys)
