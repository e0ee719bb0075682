"""The single-device reference trainer (``--backend single``): plain PyTorch.

It defines "correct" for every other backend: same data order, same micro-batching (gradients
accumulated over ``--micro-batches`` micro-batches, each loss its share of the step's mean over
trained tokens, :mod:`mobius.models.layout`), same AdamW
and schedule (:mod:`mobius.runtime.optim`).

``--optimizer-lag 1`` defines the lagged update every backend reproduces: AdamW steps a master copy
of the weights, and the weights step k+1 computes with are the master weights *before* step k's
gradient is applied (W_{k+1} = AdamW(W_k, g_{k-1}); steps 0 and 1 both use the initial weights).
The master weights hold every update made so far: they are what a checkpoint stores by name and
what an export writes.

``--offload-dir`` (on the CPU): AdamW's moments wait on disk between updates (:mod:`mobius.swap.disk`,
the pipeline's tier, with the whole model as one stage): the trained master weights and their
gradients live in one flat buffer each, autograd accumulating into views of the second, and each
update streams the moments through the drives block by block.  With the lag the master is a copy:
it waits there too, and each update hands the weights it computes with next, the master's values
before the update, block by block.  The same bits as in memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from mobius.config import RunConfig
from mobius.data import BatchSource
from mobius.data.preference import PreferenceBatches
from mobius.metrics import StepMetrics, Trace
from mobius.models import GPTConfig, build_model
from mobius.models.lora import dropout_micro_batch
from mobius.models.preference import metric_sums, step_metrics
from mobius.models.precision import DTYPES
from mobius.runtime.device import peak_memory, reset_peak_memory
from mobius.runtime.optim import (
    DynamicLossScaler,
    UpdateRule,
    clip_coefficient,
    grads_overflow,
    make_adamw,
    set_lr,
    squares,
)
from mobius.swap.disk import DiskState, block_params
from mobius.swap.store import view, whole_model_stage


class ReferenceTrainer:
    def __init__(self, cfg: RunConfig, model_config: GPTConfig, batches: BatchSource, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.batches = batches
        self.model = build_model(model_config, seed=cfg.optim.seed).to(device)
        self.lag = cfg.optim.optimizer_lag
        # The weights AdamW steps: the model's own, or with a lag a copy one update ahead of them.
        self.master = {n: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) if self.lag else p
                       for n, p in self.model.named_parameters()}
        self.rule = UpdateRule.of(cfg.optim)
        self.optimizer = make_adamw(self.master.items(), self.rule)
        precision = cfg.optim.precision
        if precision is None:  # one rule decides it, for every backend (mobius.backends.resolve)
            raise ValueError("the reference trainer needs a run whose precision is decided (mobius.backends.resolve)")
        self.dtype = DTYPES[precision]
        self.scaler = DynamicLossScaler(enabled=precision == "fp16")
        self.trace = Trace(enabled=bool(cfg.outputs.trace))
        self.disk: DiskState | None = None
        if cfg.offload_dir:  # the trained master weights as one stage of the disk tier, its moments there
            # The parameters the model computes with that train, in the master's order: autograd's
            # gradients land in views of the stage's buffer; with the lag they are a copy of their own.
            self.computed = [p for p in self.model.parameters() if p.requires_grad]
            self.stage = whole_model_stage(list(self.trained().items()), self.optimizer,
                                           self.computed if self.lag else None)
            self.disk = DiskState(cfg.offload_dir, 0, trace=self.trace, block=block_params(self.stage.master.numel()),
                                  masters=[0] if self.lag else ())
            if self.lag:  # the master is a copy: it waits on disk too
                self.stage.master_on_disk = True
                self.disk.park(self.stage)
            self.disk.attach({0: self.stage})
        if isinstance(batches, PreferenceBatches):  # before any checkpoint is loaded: the initial weights
            self.compute_reference(batches)
        reset_peak_memory(device)

    def compute_reference(self, pairs: PreferenceBatches) -> None:
        """The reference model's log-probabilities of every pair of ``pairs`` (a preference run's
        training or held-out pairs): one forward-only pass with the weights as they are, no dropout
        (:mod:`mobius.models.preference`)."""
        with torch.no_grad(), self._autocast():
            pairs.compute_reference(
                lambda micro: [self.model(mb.tokens.to(self.device), mb.layout.to(self.device)) for mb in micro])

    def close(self) -> None:
        """The disk tier's files removed (they are the run's)."""
        if self.disk is not None:
            self.disk.close()

    def optimizer_state(self, restoring: bool = False) -> contextlib.AbstractContextManager:
        """AdamW's state in its ``state`` and the master weights bound while the block runs: a
        checkpoint or an export reads them, a restore (``restoring``) writes them.  On disk they
        are read from there, and restored, written back."""
        if self.disk is None:
            return contextlib.nullcontext()
        return self._restored_to_disk() if restoring else self.disk.present(0)

    @contextlib.contextmanager
    def _restored_to_disk(self) -> Iterator[None]:
        self.disk.loaded(0)
        yield
        self.disk.unload(0)

    def trained(self) -> dict[str, torch.nn.Parameter]:
        """The master weights that train (under LoRA, the adapters): what a checkpoint holds."""
        return {n: p for n, p in self.master.items() if p.requires_grad}

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def evaluate(self, held_out) -> float:
        """Loss on held-out examples (:class:`~mobius.data.packing.EvalBatches`): forward only,
        no dropout, summed over the passes (each micro-batch already divided by all their tokens)."""
        total = 0.0
        with torch.no_grad(), self._autocast():
            for k in range(held_out.passes):
                for mb in held_out.pass_batches(k):
                    total += self.model(mb.tokens.to(self.device), mb.layout.to(self.device)).item()
        return total

    def step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        micro = self.batches.step(step)
        lr = self.rule.lr_at(step)
        set_lr(self.optimizer, lr)
        self.model.zero_grad(set_to_none=True)
        if self.disk is not None:  # autograd accumulates into views of the tier's one gradient buffer
            self.stage.master_grad.zero_()
            for p, slot in zip(self.computed, self.stage.slots):
                p.grad = view(self.stage.master_grad, slot)
        total = 0.0
        for m, mb in enumerate(micro):
            t_fwd = time.perf_counter()
            tokens, layout = mb.tokens.to(self.device), mb.layout.to(self.device)
            with self._autocast(), dropout_micro_batch(self.cfg.optim.seed, step, m):
                loss = self.model(tokens, layout)  # this micro-batch's share of the step's token mean
            t_bwd = time.perf_counter()
            (loss * self.scaler.scale).backward()
            total += loss.item()
            self.trace.span(f"fwd mb{m}", "compute", t_fwd, t_bwd, step=step)
            self.trace.span(f"bwd mb{m}", "compute", t_bwd, time.perf_counter(), step=step)
        params = list(self.model.parameters())
        overflow = self.scaler.enabled and grads_overflow(params)
        parked = self.disk is not None and self.stage.master_on_disk  # the update hands the next weights
        if self.lag and not parked:  # the next step computes with the master weights as they are before this update
            with torch.no_grad():
                for p, m in zip(params, self.master.values()):
                    if m.requires_grad:
                        m.grad = p.grad
                        p.copy_(m)
            params = list(self.master.values())
        grad_norm = None
        if not overflow:
            trained = [p for p in params if p.requires_grad and p.grad is not None]
            if self.scaler.enabled:
                for p in trained:
                    p.grad.div_(self.scaler.scale)
            if self.rule.max_grad_norm:  # the global norm, as every backend clips it
                sum_of_squares = squares(p.grad for p in trained)
                grad_norm = sum_of_squares ** 0.5
                coefficient = clip_coefficient(sum_of_squares, self.rule.max_grad_norm)
                if coefficient < 1.0:
                    for p in trained:
                        p.grad.mul_(coefficient)
            t_opt = time.perf_counter()
            if self.disk is not None:  # the gradients above are the buffer's: unscaled and clipped there
                self.disk.update(0, lr, None, 1.0, self.stage.compute_buffers[0], before=True)
            else:
                self.optimizer.step()
            self.trace.span("AdamW", "optimizer", t_opt, time.perf_counter(), step=step)
        elif parked:  # skipped: the master as it is is still the next step's weights
            self.disk.update(0, lr, None, 1.0, self.stage.compute_buffers[0], apply=False, before=True)
        self.scaler.update(overflow)
        for p in params:
            p.grad = None
        tokens = self.batches.step_tokens(step)
        peak = peak_memory(self.device)
        return StepMetrics(step=step, loss=total, lr=lr, tokens=tokens,
                           step_time_s=time.perf_counter() - t0, peak_device_bytes=peak,
                           loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped_steps, grad_norm=grad_norm,
                           preference=None if micro[0].layout.pairs is None else
                           step_metrics(metric_sums(micro), micro[0].layout.pairs.step_pairs))
