"""The chunked backend (Elixir / PatrickStar, :mod:`chunked_dp`): its chunk sizes searched, the
header that describes them, one worker per device launched."""

from __future__ import annotations

from chunked_dp import worker as chunked_worker
from chunked_dp.prepare import prepare_chunked
from mobius.boundary.errors import InputError
from mobius.launcher import devices_text, launch_workers
from mobius.metrics import seconds_text
from mobius.models import GPTConfig, build_model
from mobius.planning.prepare import Decided
from mobius.runtime.optim import UpdateRule
from mobius.runtime.worker import WorkerPayload


def launch_chunked(decided: Decided, model_config: GPTConfig, return_weights: bool = False,
                   inputs: dict[str, str] | None = None, data: tuple | None = None):
    """Data parallelism over chunks (chunked_dp), one worker per device, through the same launcher
    (``inputs`` and ``data`` as for :func:`mobius.backends.pipeline.launch_pipeline`)."""
    cfg, topo = decided.cfg, decided.topology
    spec = prepare_chunked(decided, model_config)
    setup = spec.setup
    n_params = build_model(model_config, device="meta").num_parameters()
    step_s = setup.predicted["step"]
    emulating = f", {spec.emulation.header(step_s, cfg.optim.steps)}" if spec.emulation else ""
    lanes = ", ".join(f"{lane} {seconds_text(s)}" for lane, s in setup.predicted.items() if lane != "step")
    header = (f"mobius: backend chunked on {topo.n} {devices_text(spec)}{emulating} ({topo.name}), "
              f"model {cfg.model} ({n_params / 1e6:.1f}M parameters), chunk {setup.chunk_size} elements, "
              f"rCache {setup.n_block} blocks, {setup.chunks_on_device} of {setup.n_chunks} chunks on the device, "
              f"{cfg.batch.micro_batches}x{cfg.batch.micro_batch_size} sequences of {cfg.batch.seq_len} per step "
              f"({setup.group} per pass), {spec.precision}"
              # the prediction is the GPUs' (analytic profile): shown where GPUs compute or are emulated
              + (f", predicted {seconds_text(step_s)}/step ({lanes})" if spec.cuda or spec.emulation else "")
              + f"\n  why: {setup.reasons}\n  update: {UpdateRule.of(cfg.optim).describe()}")
    payload = WorkerPayload(cfg, spec, header, inputs, return_weights=return_weights)
    results = launch_workers(topo.n, chunked_worker.worker_main, payload, data)
    history = results[0].history
    return (history, results[0].weights, results) if return_weights else history


def check_chunked_options(decided: Decided, model_config: GPTConfig) -> None:
    """What the chunked engine does not build, refused before the data is read; the topology's
    devices are its data-parallel workers."""
    cfg, workers = decided.cfg, decided.topology.n
    if cfg.outputs.export:
        raise InputError("--export is not built for --backend chunked yet; use --backend pipeline or single")
    if cfg.lora.rank:
        raise InputError("--lora-rank is built for --backend pipeline and single, not chunked")
    if cfg.offload_dir:
        raise InputError("--offload-dir is built for --backend pipeline and single, not chunked")
    if cfg.optim.optimizer_lag:
        raise InputError("--optimizer-lag is built for --backend pipeline and single, not chunked")
    if cfg.optim.precision == "fp16":
        raise InputError("--backend chunked supports fp32 and bf16 (fp16 loss scaling is not built there)")
    if cfg.batch.micro_batches % workers:
        raise InputError(f"--micro-batches {cfg.batch.micro_batches} is not divisible by the {workers} "
                         "data-parallel workers")
