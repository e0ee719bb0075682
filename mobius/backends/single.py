"""The single backend: the reference trainer (plain PyTorch, :mod:`mobius.reference`) in the
command's own process, with the checkpoints, exports and signals every backend has."""

from __future__ import annotations

import torch

from mobius.boundary.errors import InputError, shown
from mobius.config import RunConfig
from mobius.data.preference import (
    PreferenceBatches,
    evaluation_of,
    held_out_sums,
    reference_files,
    use_kept_references,
)
from mobius.metrics import StepMetrics, write_trace
from mobius.models import GPTConfig
from mobius.models.adapters import finish_export, layer_states, write_export_shard
from mobius.models.hf import start_export
from mobius.planning.prepare import Decided
from mobius.reference import ReferenceTrainer
from mobius.runtime import checkpoint as ck
from mobius.runtime.loop import run_steps
from mobius.signals import StopRequest
from mobius.swap.disk import check_offload_dir


def check_single_options(decided: Decided, model_config: GPTConfig) -> None:
    """What the reference trainer does not build, refused before the data is read: the disk tier
    on a GPU (its updates run on the host), and the flags that plan the pipeline's tier."""
    cfg = decided.cfg
    if not cfg.offload_dir:
        return
    if decided.gpus:
        raise InputError("--offload-dir with --backend single is built for training on the CPU; on GPUs "
                         "--backend pipeline keeps the optimizer's state on disk")
    if cfg.host_mem_gb is not None or cfg.drive_gbps:
        raise InputError("--host-mem-gb and --drive-gbps plan the pipeline's disk tier; --backend single keeps "
                         "every AdamW moment on disk, and with --optimizer-lag the master weights")
    check_offload_dir(cfg, model_config, None)


def train_single(decided: Decided, model_config: GPTConfig, data: tuple,
                 inputs: dict[str, str] | None = None) -> list[StepMetrics]:
    """The reference trainer (plain PyTorch) in this process, on this machine's device, on the
    run's ``data`` (training batches, held-out examples or None), as the command decided it
    (:func:`mobius.backends.resolve`)."""
    cfg, (batches, held_out) = decided.cfg, data
    device = torch.device("cuda" if decided.gpus else "cpu")  # the reference runs on this machine's device
    use_kept_references(batches, held_out, ck.resumed_checkpoint(cfg))  # a preference run's: not computed again
    trainer = ReferenceTrainer(cfg, model_config, batches, device)
    if isinstance(held_out, PreferenceBatches):  # with the initial weights, as the training pairs' (the trainer's)
        trainer.compute_reference(held_out)

    def restore(ckpt: ck.Checkpoint) -> None:
        with trainer.optimizer_state(restoring=True):
            ck.restore(ckpt, trainer.trained(), trainer.optimizer)
        if trainer.lag:
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    if p.requires_grad:
                        p.copy_(ck.lagged_weights(ckpt, name, trainer.lag))

    def save(done: int, trackers: dict[str, str]) -> None:
        with trainer.optimizer_state():  # bound (from disk) until saved
            trained = trainer.trained()
            files = {"weights.safetensors": trained,
                     "optimizer.safetensors": ck.optimizer_tensors(trained, trainer.optimizer)}
            if trainer.lag:
                files["lagged-weights.safetensors"] = {ck.LAGGED + n: p for n, p in trainer.model.named_parameters()
                                                       if p.requires_grad}
            files.update(reference_files(batches, held_out))
            ck.save(cfg.checkpoint.save, files, ck.run_meta(cfg, model_config.to_dict(), done, trainer.scaler,
                                                            inputs, trackers))

    try:
        history = _train(cfg, model_config, trainer, device, held_out, restore, save)
    finally:
        trainer.close()
    return history


def _train(cfg: RunConfig, model_config: GPTConfig, trainer: ReferenceTrainer, device: torch.device, held_out,
           restore, save) -> list[StepMetrics]:
    """The run's steps on ``trainer`` (resumed by ``restore``, saved by ``save``), its trace and exports."""
    start, tracker_runs = 0, {}
    if cfg.checkpoint.resume:
        resumed = ck.open_for_resume(cfg, model_config)
        start = ck.resume(resumed, restore, trainer.scaler, cfg.optim.precision)
        tracker_runs = resumed.tracker_runs
    n = trainer.model.num_parameters()
    on_disk = ("" if trainer.disk is None else
               f"\n  on disk: AdamW's moments{' and the master weights' if trainer.lag else ''} "
               f"({trainer.disk.numel(0) * trainer.disk.fields(0) * 4 / 1e9:.2f} GB) in "
               f"{', '.join(map(shown, cfg.offload_dir))}, streamed in blocks")
    header = (f"mobius: backend single on {device}, model {cfg.model} ({n / 1e6:.1f}M parameters), "
              f"{cfg.batch.describe()}, {cfg.optim.precision}" + (", 4-bit NF4 base" if model_config.lora_4bit else "")
              + (f", resuming at step {start}" if start else "") + f"\n  update: {trainer.rule.describe()}" + on_disk)
    evaluate = (lambda done: evaluation_of([trainer.evaluate(held_out), *held_out_sums(held_out)], held_out)) \
        if held_out is not None else None
    with StopRequest() as stop:
        history = run_steps(cfg, trainer.step, header, start_step=start, save_fn=save, stop=stop, eval_fn=evaluate,
                            tracker_runs=tracker_runs)
    if cfg.outputs.trace:
        write_trace(cfg.outputs.trace, trainer.trace.collect())
    for _, out, merged in cfg.outputs.exports():
        staging = start_export(out, cfg.data.chat_template)
        with trainer.optimizer_state():
            write_export_shard(model_config, staging, "all", layer_states(trainer.master), merged)
        finish_export(model_config, staging, out, merged)
        print(f"exported to {shown(out)}", flush=True)
    return history
