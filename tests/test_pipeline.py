"""The pipeline backend against the reference trainer (CPU workers over gloo, fp32).

Each case launches real worker processes through the elastic launcher, so cases are few and each
checks several things at once: per-step losses, final weights and the traffic counters."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import HANG_S, fault_env, reference

from mobius.backends import resolve
from mobius.backends.pipeline import launch_pipeline
from mobius.config import RunConfig
from mobius.models import get_config
from mobius.planning.prepare import resolve_topology

STEPS = 5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


CASES = [
    # (id, model, topology, workers, stages)
    ("1worker-3stages", "tiny", "cpu", 1, 3),
    ("2workers-4stages", "tiny", "cpu", 2, 4),
    ("4workers-2+2-8stages", "tiny8", "topo2+2", 4, 8),
]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["on", "off"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pipeline_equals_reference(case, recompute):
    _, model, topology, workers, stages = case
    # Every stage swaps here (the budget would let the planner keep some on their devices).
    cfg = RunConfig.of(model=model, topology=topology, cpu_workers=workers, stages=stages, steps=STEPS,
                       micro_batch_size=2, micro_batches=4, seq_len=32, lr=3e-3, recompute=recompute,
                       progress=False, backend="pipeline", device_optimizer="off")
    ref_losses, ref_weights = reference(cfg, precision="fp32")
    topo = resolve_topology(cfg)
    history, weights, results = launch_pipeline(resolve(cfg, topo, "pipeline"), get_config(model), return_weights=True)
    assert len(results) == workers
    losses = [m.loss for m in history]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5
    assert losses[-1] < losses[0]
    assert set(weights) == set(ref_weights)
    for name, w in weights.items():
        assert rel(w, ref_weights[name].detach()) < 1e-5, name
    # Every step moves each stage's weights in (twice, less the resident ones) and grads out.
    params = sum(w.numel() * 4 for w in weights.values())
    assert all(m.h2d_bytes > params and m.d2h_bytes >= params for m in history)
    assert all(m.peer_bytes > 0 for m in history) == (workers > 1)


@pytest.mark.slow
def test_stress_jittered_streams_across_workers_equal_the_reference(monkeypatch):
    """Many steps, one-layer stages, four workers over gloo, and random sleeps before every job of
    every copy stream (parameters in, activations and gradients out): equal to the reference."""
    monkeypatch.setenv("MOBIUS_STREAM_JITTER_MS", "2")
    cfg = RunConfig.of(model="tiny8", topology="topo2+2", cpu_workers=4, stages=10, steps=8, micro_batch_size=2,
                       micro_batches=3, seq_len=32, lr=3e-3, recompute="off", progress=False, backend="pipeline")
    ref_losses, ref_weights = reference(cfg, precision="fp32")
    history, weights, _ = launch_pipeline(resolve(cfg, backend="pipeline"), get_config("tiny8"), return_weights=True)
    for a, b in zip([m.loss for m in history], ref_losses, strict=True):
        assert abs(a - b) / abs(b) < 1e-5
    for name, w in weights.items():
        assert rel(w, ref_weights[name].detach()) < 1e-5, name


@pytest.mark.slow
def test_budget_below_all_stages_still_trains_within_budget():
    """One worker, six one-layer stages, a budget smaller than the model's weights: stages must swap."""
    budget_gb = 0.0007
    cfg = RunConfig.of(model="tiny", topology="cpu", cpu_workers=1, stages=6, steps=3, micro_batch_size=1,
                       micro_batches=2, seq_len=16, gpu_mem_gb=budget_gb, recompute="on", progress=False,
                       backend="pipeline")
    ref_losses, ref_weights = reference(cfg, precision="fp32")
    total_param_bytes = sum(w.numel() * 4 for w in ref_weights.values())
    assert total_param_bytes > budget_gb * 1e9
    history, weights, results = launch_pipeline(resolve(cfg, backend="pipeline"), get_config("tiny"),
                                                return_weights=True)
    peak = results[0].report.peak_bytes_max
    assert 0 < peak <= budget_gb * 1e9
    for a, b in zip([m.loss for m in history], ref_losses):
        assert abs(a - b) / abs(b) < 1e-5


@pytest.mark.slow
def test_killed_worker_ends_the_run_with_its_rank():
    """Worker 1 is killed in step 1 of a run of a million steps: the run ends there, naming it (a
    launcher that waited for the surviving worker would run for hours and meet the timeout)."""
    env = {**os.environ, **fault_env("1:1")}
    r = subprocess.run([sys.executable, "-m", "mobius.train", "--model", "tiny", "--topology", "cpu",
                        "--cpu-workers", "2", "--steps", "1000000", "--seq-len", "32", "--micro-batch-size", "2",
                        "--stages", "4", "--no-progress"], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert r.returncode != 0
    assert "error: worker 1 failed: Signal 9" in r.stderr
