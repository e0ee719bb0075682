import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_system_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["system"]: row for row in json.loads(out.read_text())["runs"][0]["rows"]}
    for system in ("mobius pipeline", "chunked_dp offload", "fsdp2", "plain pytorch (100% line)"):
        assert rows[system]["tokens_per_s"] > 0 and rows[system]["model_tflops"] > 0, system
    mobius = rows["mobius pipeline"]
    assert mobius["prefetch_h2d_gbps"] > 0 and 0 <= mobius["prefetch_not_overlapped"] <= 1
    busy = mobius["busy_s_per_step"]
    assert busy["compute"] > 0 and busy["optimizer"] > 0 and busy["prefetch"] > 0
    assert "skipped" in rows["deepspeed zero-3 offload"] or rows["deepspeed zero-3 offload"]["tokens_per_s"] > 0
    assert "% plain" in r.stdout
    chunked = rows["chunked_dp offload"]  # its lanes measured, its prediction beside them
    assert chunked["busy_s_per_step"]["compute"] > 0 and chunked["busy_s_per_step"]["optimizer"] > 0
    assert chunked["predicted_step_s"] > 0 and "host AdamW" in chunked["predicted_lane_floor_s"]


@pytest.mark.slow
def test_bench_gpu_sweeps_tokens_per_step(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--smoke", "--sweep", "--systems",
                        "plain,mobius", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["tokens_per_step"] for run in runs] == [128, 256]
    assert [run["micro_batches"] for run in runs] == [2, 4]  # micro-batches of 2 x 32 tokens
    line = next(x for x in r.stdout.splitlines() if x.split()[:2] == ["32", "256"])
    assert float(line.split()[3]) > 0  # mobius over plain, a measured ratio
