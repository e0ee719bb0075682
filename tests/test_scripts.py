"""Every script under scripts/ runs in its smoke mode (seconds, a tiny model or plan) and writes
what it reports: a refactor that breaks one fails here, not in front of the person who runs it.
Scripts run in this process (their ``main(argv)``), so each costs its own work and no
interpreter start; those that train start their workers as a user's run would.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(name: str, argv: list[str]):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Each script writes into its own directory, and leaves torch's thread count as it found it."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


def read(path) -> dict | list:
    return json.loads(Path(path).read_text())


def test_every_script_has_a_smoke_test():
    tested = {p.stem for p in SCRIPTS.glob("*.py")} - {"published_models"}  # a module the plan scripts import
    here = Path(__file__).read_text()
    untested = sorted(name for name in tested if f'run_script("{name}"' not in here
                      and name != "bench_gpu")  # its smoke mode: tests/test_bench_gpu.py
    assert untested == []


def test_make_tiny_chat_model(tmp_path):
    run_script("make_tiny_chat_model", ["chat"])
    assert read(tmp_path / "chat" / "config.json")["model_type"] == "llama"
    assert (tmp_path / "chat" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_reproduce_paper(tmp_path, capsys):
    run_script("reproduce_paper", ["--smoke", "--out", "repro", "--mip-effort", "4"])
    fig5 = (tmp_path / "repro" / "fig5_fig6_fig8.csv").read_text().splitlines()
    assert fig5[0].startswith("topology,model,stages,mobius_s,deepspeed_s") and len(fig5) == 2
    summary = read(tmp_path / "repro" / "summary.json")
    assert summary["speedup_range"][0] > 1  # the simulated Mobius beats the simulated ZeRO-3 offload
    assert len((tmp_path / "repro" / "fig14_scaling.csv").read_text().splitlines()) == 3  # 2 and 4 GPUs
    assert "fig10_mapping" in capsys.readouterr().out


# The scripts that plan, a few to a test: the suite's test processes share them out.
@pytest.mark.slow
def test_partition_and_longest_sequence_scripts():
    run_script("bench_partition", ["--smoke", "--json", "partition.json"])
    (row,) = read("partition.json")
    assert row["mip_le_best_baseline"] and row["mip_stages"] >= 2
    run_script("longest_sequence", ["--smoke", "--json", "longest.json"])
    (row,) = read("longest.json")
    assert 1024 <= row["longest_seq_len"] <= 8192 and row["stages"] >= 4


@pytest.mark.slow
def test_lora_and_replica_plan_scripts():
    run_script("plan_lora", ["--smoke", "--json", "lora.json"])
    full, lora = read("lora.json")
    assert lora["trained_params"] < full["trained_params"] / 100 and lora["plan"]["predicted_step_s"] > 0
    run_script("plan_replicas", ["--smoke", "--json", "replicas.json"])
    one, two = read("replicas.json")["rows"]
    # A MIP of 4 limit checks finds what it finds: the rows are checked, not the speed-up.
    assert (one["boxes"], two["boxes"]) == (1, 2) and two["network_s"] > 0 and two["speedup"] > 0


@pytest.mark.slow
def test_dispatched_plan_scripts():
    run_script("plan_dispatched", ["--smoke", "--json", "dispatched.json"])
    one, two = read("dispatched.json")
    assert (one["gpus"], two["gpus"]) == (1, 2)
    assert all(r["bound_simulated_s"] > 0 and r["dispatched_simulated_s"] > 0 for r in (one, two))
    assert two["dispatched_stages"][1] >= two["dispatched_stages"][0]  # backward stages are the smaller
    # A deeper head's stage is kept only where it is faster.
    assert all(r["dispatched_simulated_s"] <= r["one_layer_head_s"] for r in (one, two))
    assert all((r["dispatched_simulated_s"] < r["one_layer_head_s"]) == (r["dispatched_head_layers"] > 1)
               for r in (one, two))
    run_script("compare_roundpipe", ["--smoke", "--fraction", "0.5", "--json", "roundpipe.json"])
    found = read("roundpipe.json")
    assert found["fraction"] == 0.5 and [(r["lag"], r["gpus"]) for r in found["rows"]] == [(1, 1), (1, 2), (0, 1), (0, 2)]
    assert all(r["step_s"] >= 0.9 * r["bound_floor_s"] and r["tokens_per_s"] > 0 for r in found["rows"])
    # A dispatched step is never shorter than what its busiest GPU computes, the floor it prints.
    assert all(r["step_s"] >= r["floor_s"] * (1 - 1e-12) for r in found["rows"] if r["schedule"] == "dispatched")
    assert found["rows"][0]["roundpipe_tokens_per_s"] == 3142.0


@pytest.mark.slow
def test_disk_plan_script():
    run_script("plan_disk", ["--smoke", "--json", "disk.json"])
    (row,) = read("disk.json")
    assert row["moments_on_disk"] > 0 and row["mobius_step_s"] > 0 and row["zero_infinity_step_s"] > 0


def test_bench_optimizer():
    run_script("bench_optimizer", ["--smoke", "--json", "adam.json"])
    rows = {r["implementation"]: r for r in read("adam.json")}
    assert "DeepSpeedCPUAdam" not in rows and rows["mobius (make_adamw)"]["params_per_s"] > 0


def test_bench_host_update():
    run_script("bench_host_update", ["--smoke", "--json", "update.json"])
    rows = {r["update"]: r for r in read("update.json")["rows"]}
    assert rows.keys() == {"unfused", "one pass"} and rows["one pass"]["M_params_per_s"] > 0
    assert (rows["unfused"]["bytes_per_param"], rows["one pass"]["bytes_per_param"]) == (40, 28)


@pytest.mark.slow
def test_training_benches():
    """The benches that train: the pipeline, the chunked engine, the simulator's calibration."""
    run_script("bench_pipeline", ["--smoke", "--json", "pipeline.json"])
    single, pipeline = read("pipeline.json")["rows"]
    assert single["step_s"] > 0 and pipeline["config"].startswith("pipeline 2w") and pipeline["h2d_bytes"] > 0
    run_script("bench_chunked", ["--smoke", "--json", "chunked.json"])
    out = read("chunked.json")
    assert [r["topology"] for r in out["search"]] == ["dgx-a100", "1xA100-40GB"]
    assert out["timing"][1]["config"].endswith("offload on") and out["timing"][1]["step_s"] > 0
    run_script("calibrate_sim", ["--smoke", "--json", "calibrate.json"])
    out = read("calibrate.json")
    assert out["measured_step_s"] > 0 and out["simulated_step_s"] > 0


# The benches that run ``python -m mobius.train`` as a user would, emulated or not.
@pytest.mark.slow
def test_interleaved_and_emulated_benches():
    run_script("bench_interleaved", ["--smoke", "--json", "interleaved.json"])
    out = read("interleaved.json")
    assert set(out["median_step_s"]) == {"lag 0", "lag 1"} and all(len(t) == 1 for t in out["step_times"].values())
    run_script("bench_emulated", ["--smoke", "--json", "emulated.json"])
    (row,) = read("emulated.json")["rows"].values()
    assert row["predicted_s"] > 0 and row["measured_s"] > 0 and row["factor"] > 1


@pytest.mark.slow
def test_replica_and_host_memory_benches():
    run_script("bench_replicas", ["--smoke", "--json", "replicas.json"])
    (row,) = read("replicas.json")["rows"]
    assert row["replicas"] == 2 and all(p > 0 for p in row["adam_params_per_step"])
    run_script("measure_host_memory", ["--smoke", "--json", "memory.json"])
    out = read("memory.json")
    assert out["rss_peak_bytes"] > 0 and out["device_peak_bytes_per_worker"] > 0


@pytest.mark.slow
def test_compare_trl():
    """Mobius and TRL on the same tiny Llama, records and update rule, judged by one evaluator."""
    pytest.importorskip("trl")
    run_script("compare_trl", ["--smoke", "--json", "trl.json"])
    (row,) = read("trl.json")["rows"]
    for who in ("mobius", "trl"):
        assert 0 < row[who]["answer_loss"] < 10 and 0 <= row[who]["exact_match"] <= 1


def test_bench_offload():
    run_script("bench_offload", ["--smoke", "--json", "offload.json"])
    row = read("offload.json")
    assert all(row["median"][k] > 0 for k in ("read_s", "write_s", "adam_s", "step_s"))
    assert row["step_over_read_plus_write"] > 0
    run_script("bench_offload", ["--smoke", "--masters", "--json", "masters.json"])
    assert all(read("masters.json")["median"][k] > 0 for k in ("read_s", "write_s", "adam_s", "step_s"))
    run_script("bench_offload", ["--smoke", "--compare-io", "--json", "io.json"])
    rows = read("io.json")["median"]
    kinds = [(io, k) for io in ("buffered", "O_DIRECT") for k in (1, 4, 8)]
    assert [(r["io"], r["in_flight"]) for r in rows] in (kinds, kinds[:3])  # O_DIRECT where the file system has it
    assert all(r["read_gbps"] > 0 and r["write_gbps"] > 0 for r in rows)
