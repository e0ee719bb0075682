"""Optimizer pieces every backend shares, so they update weights identically.

AdamW with decoupled weight decay on matrices only, linear warm-up then cosine decay to 10% of
the peak rate, and a dynamic loss scaler for fp16.  The pipeline runs one AdamW per stage on the
CPU master weights; AdamW is elementwise, so grouping parameters per stage changes no number.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)


def lr_at(step: int, total_steps: int, peak_lr: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based) in a run of ``total_steps``."""
    warmup = max(1, total_steps // 10)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (``p.dim() >= 2``) only, over the parameters that train
    (frozen ones, e.g. base weights under LoRA, have no optimizer state)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return adamw([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], lr)


def adamw(groups: list[dict], lr: float) -> torch.optim.AdamW:
    """The one AdamW every backend steps.  ``fused``: one vectorised, multi-threaded kernel per
    tensor (on the CPU as on CUDA), elementwise, so grouping or slicing parameters (per stage,
    per chunk) changes no bit; it is 2-3x torch's per-tensor loop on the CPU."""
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=BETAS, eps=1e-8, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class DynamicLossScaler:
    """fp16 loss scaling: halve the scale and skip the step on overflow, double it after a run
    of ``growth_interval`` clean steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale /= 2.0
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2.0


def grads_overflow(params: Iterable[torch.nn.Parameter]) -> bool:
    return any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)
