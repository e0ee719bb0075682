import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_smoke_runs_every_system_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    for system in ("mobius pipeline", "chunked_dp offload", "fsdp2", "plain pytorch (100% line)"):
        assert rows[system]["tokens_per_s"] > 0 and rows[system]["model_tflops"] > 0, system
    mobius = rows["mobius pipeline"]
    assert mobius["prefetch_h2d_gbps"] > 0 and 0 <= mobius["prefetch_not_overlapped"] <= 1
    busy = mobius["busy_s_per_step"]
    assert busy["compute"] > 0 and busy["optimizer"] > 0 and busy["prefetch"] > 0
    assert "skipped" in rows["deepspeed zero-3 offload"] or rows["deepspeed zero-3 offload"]["tokens_per_s"] > 0
    assert "% plain" in r.stdout
