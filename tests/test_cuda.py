"""The CUDA path against the reference trainer on the same GPU. Skipped without CUDA.

The CPU device layer is where the copy/compute ordering is tested on every machine
(tests/test_device.py, tests/test_pipeline.py); these cases run the same runtime on real CUDA
streams, page-locked host buffers and ``non_blocking`` copies, with the device budget cut below
the model's weights so that stages must swap while the next one is prefetched."""

import pytest
import torch

from mobius.backends import resolve
from mobius.backends.chunked import launch_chunked
from mobius.backends.pipeline import launch_pipeline
from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.models import get_config
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.prepare import resolve_topology
from mobius.reference import ReferenceTrainer
from mobius.runtime.device import CUDA_ALLOCATOR_SLACK_BYTES, CUDA_RESERVE_BYTES
from mobius.runtime.inputs import check_model_input

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 5


def reference(cfg: RunConfig):
    """Losses and final weights of the single-device trainer on this GPU, in ``cfg``'s precision
    (its state in memory: the disk tier is the pipeline's on a GPU)."""
    cfg = cfg.changed(offload_dir=(), host_mem_gb=None)
    batches = BatchSource(load_corpus(None), cfg.batch.seq_len, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.optim.seed)
    trainer = ReferenceTrainer(cfg, get_config(cfg.model), batches, torch.device("cuda"))
    losses = [trainer.step(k).loss for k in range(cfg.optim.steps)]
    return losses, {n: p.detach().cpu() for n, p in trainer.master.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def without_key_bias(name: str, w: torch.Tensor, hidden: int) -> torch.Tensor:
    """The key bias gets no gradient in exact arithmetic (softmax ignores a constant added to a
    row of scores), so AdamW turns its rounding noise (~1e-10, which differs between any two
    kernel choices on a GPU) into full learning-rate steps: on every backend those entries are
    noise.  Compared are the query and value biases beside it."""
    if not name.endswith("qkv.bias"):
        return w
    kv = (w.numel() - hidden) // 2
    return torch.cat([w[:hidden], w[hidden + kv:]])


def assert_equal_to_reference(cfg: RunConfig, history, weights, tol: float) -> None:
    """Per-step losses within ``tol`` (relative) and, in fp32, the final weights within ``tol``."""
    ref_losses, ref_weights = reference(cfg)
    losses = [m.loss for m in history]
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) / abs(b) < tol, (k, a, b)
    assert losses[-1] < losses[0]
    # The pipeline names a tied head weight under both of its layers; the reference once.
    assert set(ref_weights) <= set(weights)
    assert all(n.endswith("lm_head.weight") for n in set(weights) - set(ref_weights))
    if cfg.optim.precision != "fp32":  # in bf16 AdamW's steps on near-zero gradients differ by whole lr steps
        return
    hidden = get_config(cfg.model).hidden
    for name, w in ref_weights.items():
        assert rel(without_key_bias(name, weights[name], hidden), without_key_bias(name, w, hidden)) < tol, name


def config(**kw) -> RunConfig:
    base = dict(model="gpt2-medium", topology="auto", steps=STEPS, micro_batch_size=2, micro_batches=4, seq_len=64,
                lr=1e-4, precision="fp32", progress=False, backend="pipeline")
    return RunConfig.of(**{**base, **kw})


@pytest.mark.parametrize("recompute,lag,cap_gb", [("on", 0, 1.3), ("off", 1, None)])
def test_cuda_pipeline_with_swapping_stages_equals_the_reference(recompute, lag, cap_gb):
    """One GPU, one stage per layer; with recomputation under a cap below the model's weights, so
    every stage is loaded on a copy stream while the previous one computes, and evicted again."""
    # A fresh GPT-2 medium on 8 sequences a step spikes at 1e-4 with a stale gradient (the reference
    # too, on CPU as on the GPU: 10.69 -> 13.32 in 5 steps); 3e-5 trains.
    cfg = config(stages=26, gpu_mem_gb=cap_gb, recompute=recompute, optimizer_lag=lag, lr=3e-5 if lag else 1e-4,
                 device_optimizer="off")
    topo = resolve_topology(cfg)
    history, weights, results = launch_pipeline(resolve(cfg, topo, "pipeline"), get_config(cfg.model),
                                                return_weights=True)
    assert_equal_to_reference(cfg, history, weights, 1e-5)
    params = sum(w.numel() * 4 for w in weights.values())
    if cap_gb is not None:  # below the weights: no stage stays resident, each is loaded every step
        budget = results[0].report.budget_bytes
        assert abs(budget - (cap_gb * 1e9 - CUDA_RESERVE_BYTES)) <= 1 and params > budget
        assert all(m.h2d_bytes > params and m.d2h_bytes >= params for m in history)
        assert 0 < results[0].report.peak_bytes_max <= budget + CUDA_ALLOCATOR_SLACK_BYTES


def test_cuda_resident_stages_updated_on_the_gpu_equal_the_reference():
    """A cap that holds part of the model beside its AdamW state, on a host whose AdamW is slow (as
    a run on it measured: a cached rate of 1M parameters/s), so keeping stages on the GPU pays by
    construction: those stages stay there and are updated there (fused AdamW on CUDA tensors), the
    others swap; fp32 equals the reference."""
    from conftest import host_rate_cached

    cfg = config(stages=26, gpu_mem_gb=4.0, recompute="on")
    with host_rate_cached(1e6, workers=resolve_topology(cfg).n):
        _, plan = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
        assert plan.resident and plan.host_costs["adam_params_per_s"] == 1e6
        history, weights, _ = launch_pipeline(resolve(cfg, backend="pipeline"), get_config(cfg.model),
                                              return_weights=True)
    assert_equal_to_reference(cfg, history, weights, 1e-5)


def test_cuda_dispatched_schedule_equals_the_reference():
    """``--schedule dispatched`` on the GPU(s) from one process, a thread each: every task's pieces
    loaded on a copy stream (the next task's while this one computes) and evicted, gradients home
    on their own stream, the host's AdamW a piece at a time; with the lag, steps overlapping."""
    cfg = config(model="small", schedule="dispatched", optimizer_lag=1, lr=3e-5)
    topo = resolve_topology(cfg)
    spec, _ = prepare_pipeline(resolve(cfg, topo, "pipeline"), check_model_input(cfg))
    assert spec.setup.dispatched is not None
    history, weights, results = launch_pipeline(resolve(cfg, topo, "pipeline"), get_config(cfg.model),
                                                return_weights=True)
    assert len(results) == 1
    assert_equal_to_reference(cfg, history, weights, 1e-5)


def test_cuda_pipeline_bf16_follows_the_bf16_reference():
    cfg = config(stages=4, precision="bf16", recompute="on")
    history, weights, _ = launch_pipeline(resolve(cfg, backend="pipeline"), get_config(cfg.model), return_weights=True)
    assert_equal_to_reference(cfg, history, weights, 2e-2)


def test_cuda_chunked_with_offload_equals_the_reference():
    cfg = config(backend="chunked", offload="on", gpu_mem_gb=2.0, chunk_size=20_000_000)
    history, weights, _ = launch_chunked(resolve(cfg, backend="chunked"), get_config(cfg.model), return_weights=True)
    assert_equal_to_reference(cfg, history, weights, 1e-5)


def test_cuda_pipeline_with_every_state_and_the_stage_weights_on_disk(tmp_path):
    """bf16 under a cap below the weights, with every stage's moments, master and weights on disk
    (``--host-mem-gb 0``): each load reads a stage's weights into the page-locked staging buffer,
    then copies them to the GPU while the previous stage computes; the run follows the bf16
    reference and leaves no file behind."""
    (tmp_path / "nvme").mkdir()
    cfg = config(stages=26, gpu_mem_gb=1.3, precision="bf16", recompute="on", device_optimizer="off",
                 offload_dir=str(tmp_path / "nvme"), host_mem_gb=0)
    _, plan = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    assert plan.disk_weights and set(plan.disk_weights) <= set(plan.disk_masters)
    history, weights, results = launch_pipeline(resolve(cfg, backend="pipeline"), get_config(cfg.model),
                                                return_weights=True)
    assert_equal_to_reference(cfg, history, weights, 2e-2)
    assert all(r.report.disk_bytes[0] > 0 and r.report.disk_bytes[1] > 0 for r in results.values())
    assert list((tmp_path / "nvme").iterdir()) == []
