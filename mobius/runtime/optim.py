"""Optimizer pieces every backend shares, so they update weights identically.

:class:`UpdateRule` is the update every backend applies: AdamW with decoupled weight decay on
matrices only (not on biases and norms), its betas and epsilon, the learning-rate schedule (Hugging
Face's, as ``transformers.get_scheduler`` gives it by name, warm-up counted as its Trainer counts
it), and clipping of the gradients' *global* norm.
The pipeline runs one AdamW per stage on the CPU master weights; AdamW is elementwise, so grouping
parameters per stage changes no number.  Clipping is not elementwise: every backend sums the squares
of all of a step's gradients (every stage, worker and chunk) before it applies any update
(:func:`clip_coefficient`).  A dynamic loss scaler serves fp16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

import torch

from mobius.config import warmup_steps_of

# torch.nn.utils.clip_grad_norm_'s: the coefficient is max_norm / (norm + 1e-6), at most 1
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class UpdateRule:
    """The optimizer step of a run (``mobius.config.OptimConfig``'s settings, resolved)."""

    lr: float  # the peak learning rate
    steps: int = 1  # of the whole run: the schedule's length
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # on matrices only
    scheduler: str = "linear"  # a transformers.get_scheduler name (SCHEDULERS)
    warmup_ratio: float = 0.0  # of the steps, rounded up
    warmup_steps: int | None = None  # instead of the ratio
    min_lr_ratio: float = 0.1  # where cosine_with_min_lr ends, as a fraction of the peak (its min_lr_rate)
    max_grad_norm: float = 0.0  # clip the global gradient norm to this (0: no clipping)

    @classmethod
    def of(cls, optim) -> "UpdateRule":
        """From a run's ``OptimConfig``."""
        return cls(lr=optim.lr, steps=optim.steps, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                   weight_decay=optim.weight_decay, scheduler=optim.lr_scheduler, warmup_ratio=optim.warmup_ratio,
                   warmup_steps=optim.warmup_steps, min_lr_ratio=optim.min_lr_ratio,
                   max_grad_norm=optim.max_grad_norm or 0.0)

    def describe(self) -> str:
        """The rule in one line (a run's header)."""
        decay = {"cosine": "cosine to 0", "linear": "linear to 0", "cosine_with_min_lr":
                 f"cosine to {self.min_lr_ratio:g}x", "constant": "constant", "constant_with_warmup": "constant"}
        warm = f" after {self.warmup} warm-up step{'s' if self.warmup != 1 else ''}" if self.warmup else ""
        clip = (f"; gradients clipped at a global norm of {self.max_grad_norm:g} (without a lag, replicas or the "
                "disk tier the host's updates start before the norm is known, and a step that clips is redone)"
                if self.max_grad_norm else "; no gradient clipping")
        return (f"AdamW at lr {self.lr:g} (betas {self.betas[0]:g}/{self.betas[1]:g}, eps {self.eps:g}, weight "
                f"decay {self.weight_decay:g} on matrices), {decay[self.scheduler]}{warm} (transformers' "
                f"{self.scheduler!r} schedule){clip}")

    @property
    def warmup(self) -> int:
        return warmup_steps_of(self.steps, self.warmup_ratio, self.warmup_steps, self.scheduler)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): the peak times the factor
        ``transformers.get_scheduler(self.scheduler, ...)`` gives at that step (its warm-up starts at
        0: the first step of a warm-up does not move the weights)."""
        warmup, n = self.warmup, self.steps
        if step < warmup:
            return self.lr * step / max(1, warmup)
        if self.scheduler in ("constant", "constant_with_warmup"):
            return self.lr
        if self.scheduler == "linear":
            return self.lr * max(0.0, (n - step) / max(1, n - warmup))
        progress = (step - warmup) / max(1, n - warmup)
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.scheduler == "cosine_with_min_lr":
            factor = factor * (1 - self.min_lr_ratio) + self.min_lr_ratio
        return self.lr * max(0.0, factor)


def make_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], rule: UpdateRule) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (``p.dim() >= 2``) only, over the parameters that train
    (frozen ones, e.g. base weights under LoRA, have no optimizer state)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return adamw([{"params": decay, "weight_decay": rule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                 rule)


def adamw(groups: list[dict], rule: UpdateRule) -> torch.optim.AdamW:
    """The one AdamW every backend steps (``groups`` carry their weight decay).  ``fused``: one
    vectorised, multi-threaded kernel per tensor (on the CPU as on CUDA), elementwise, so grouping
    or slicing parameters (per stage, per chunk) changes no bit; it is 2-3x torch's per-tensor loop
    on the CPU."""
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=rule.lr, betas=rule.betas, eps=rule.eps,
                             fused=True)


# The chunk a host update's pass (:func:`host_update`) works in: its fp32 gradient and weights
# (8 MB) stay in a server's last-level cache from the gradient's conversion, through AdamW, to the
# compute copy's refresh.  A multiple of the 2**14 elements torch's fused CPU AdamW hands each
# thread (vectorised, the unit's last elements one by one): every element is computed by the same
# code as in one step over the whole tensor, so chunking changes no bit (a test checks the bits).
HOST_UPDATE_CHUNK = 2**20


@dataclass(frozen=True)
class HostUpdatePath:
    """What a host update does in its own pass beside AdamW (:func:`host_update`), and what reads
    its gradients before it."""

    converts: bool  # the 16-bit gradients made fp32 from their staging, chunk by chunk, in the pass
    refreshes: bool  # the 16-bit compute copy written from each chunk's new weights in the pass
    checks: int = 0  # whole reads of the gradients before the update (the step's norm, fp16's vote)

    def bytes_per_param(self, element_bytes: int) -> int:
        """Bytes the update moves through host memory per parameter: AdamW reads the fp32 weight
        and both moments and writes them back (24); the gradient is read as it came home (2 in 16
        bits) where the pass converts it, else converted ahead (2 read, 4 written) and read again
        (4); the compute copy is written from the chunk in cache (2), else refreshed after (4 read,
        2 written); each check reads the gradients as the update will.  In fp32 the gradient is
        fp32 as it comes home and the master is the compute copy: 28 and the checks."""
        if element_bytes == 4:
            return 28 + 4 * self.checks
        grad = element_bytes if self.converts else element_bytes + 8
        compute = element_bytes if self.refreshes else element_bytes + 4
        return 24 + grad + compute + self.checks * (element_bytes if self.converts else 4)

    def split_bytes_per_param(self, element_bytes: int, parts: int) -> int:
        """Bytes the update of a piece whose gradients come home in ``parts`` parts (the
        dispatched head's task, split over GPUs) moves per parameter.  The pass sums 16-bit parts
        as it reads them (one more read each) only where nothing reads the gradients before it
        (``checks``: the norm or the vote reads the parts' sum, the master's); else each part is
        added into the fp32 gradient ahead (its read, the sum's read and write), and the update
        reads that as a converted-ahead one does."""
        if parts <= 1:
            return self.bytes_per_param(element_bytes)
        first, each = self.split_bytes(element_bytes)
        return first + (parts - 1) * each

    def split_bytes(self, element_bytes: int) -> tuple[int, int]:
        """(bytes a parameter of a piece of several parts moves with its first part, and with each
        part more): :meth:`split_bytes_per_param`'s two terms."""
        in_pass = self.converts and not self.checks and element_bytes != 4
        first = (self if in_pass else replace(self, converts=False)).bytes_per_param(element_bytes)
        return first, element_bytes if in_pass else element_bytes + 8


def host_update_path(max_grad_norm: float, optimizer_lag: int, fp16: bool, replicated: bool) -> HostUpdatePath:
    """The path of a run's updates in its steady state (what its plan charges).  The pass converts
    a stage's gradients unless the update needs them in fp32 before it: made before the step's
    decision (:func:`updates_speculate`: their squares taken first, fp16's unscaled in place
    before, and kept to take the update back) or summed over replicas; a tied table's two
    copies, summed first, are converted ahead in every run (the plan charges them as the others).
    The runtime's rule too (a run whose updates may start before their decision converts ahead in
    its steps that wait for it as well).  The pass refreshes the compute copy unless something
    comes between (replicas broadcast the owners' weights first)."""
    speculates = updates_speculate(max_grad_norm, optimizer_lag, fp16, replicated)
    checks = 1 + 2 * fp16 if speculates else bool(max_grad_norm) + fp16
    return HostUpdatePath(converts=not replicated and not speculates, refreshes=not replicated, checks=checks)


@torch.no_grad()
def host_update(optimizer: torch.optim.AdamW, master: torch.Tensor, compute: torch.Tensor | None = None,
                staging: tuple[torch.Tensor, ...] = (), unscale: float | None = None, clip: float = 1.0,
                chunk: int | None = None, params: list[torch.nn.Parameter] | None = None) -> None:
    """``optimizer.step()`` (an :func:`adamw` over parameters that view the flat fp32 ``master``)
    as one pass, chunk by chunk, with what a 16-bit host update does beside it, so that the chunk's
    gradient and weights are still in the cache when the next part reads them: each chunk's
    gradient made fp32 from ``staging`` (the 16-bit buffers its parts came home in, in master's
    layout, summed in order; empty: the parameters' own ``.grad``), divided by ``unscale`` and
    multiplied by ``clip``, then AdamW on the chunk, then its weights written into ``compute`` (the
    compute-dtype copy, in master's layout; None: not here).  Every element sees the operations of
    the unfused path in its order (:data:`HOST_UPDATE_CHUNK`): no bit changes.  The optimizer's
    state stays torch's own (its checkpoints, :func:`undo_adamw_step`); a 16-bit update moves 28
    bytes a parameter where the unfused path moved 40 (:meth:`HostUpdatePath.bytes_per_param`).
    ``params``: only these of the optimizer's parameters (the others untouched; a slice of an
    update split over threads, :func:`update_slices`)."""
    chunk = chunk or HOST_UPDATE_CHUNK
    only = None if params is None else {id(p) for p in params}
    chunk_param = torch.nn.Parameter(torch.empty(0))
    inner = adamw([{"params": [chunk_param], "weight_decay": 0.0}], UpdateRule(lr=0.0))
    scratch = torch.empty(min(chunk, master.numel())) if staging else None
    for group in optimizer.param_groups:
        inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            if only is not None and id(p) not in only:
                continue
            at = (p.data_ptr() - master.data_ptr()) // p.element_size()
            weights = p.view(-1)
            if p.grad is None and not staging:  # not updated: its compute copy as it is
                if compute is not None:
                    compute[at:at + p.numel()].copy_(weights)
                continue
            state = optimizer.state[p]
            if not state:  # as torch's fused AdamW makes it on a parameter's first step
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            moments = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
            for a in range(0, p.numel(), chunk):
                b = min(p.numel(), a + chunk)
                if staging:
                    grad = scratch[:b - a]
                    grad.copy_(staging[0][at + a:at + b])
                    for part in staging[1:]:
                        grad.add_(part[at + a:at + b])
                else:
                    grad = p.grad.view(-1)[a:b]
                if unscale is not None:
                    grad.div_(unscale)
                if clip != 1.0:
                    grad.mul_(clip)
                chunk_param.data, chunk_param.grad = weights[a:b], grad
                inner.state[chunk_param] = {"step": state["step"].clone(), "exp_avg": moments[0][a:b],
                                            "exp_avg_sq": moments[1][a:b]}
                inner.step()
                if compute is not None:
                    compute[at + a:at + b].copy_(weights[a:b])
            state["step"] += 1
    inner.state.clear()


def update_slices(optimizer: torch.optim.Optimizer, slices: int) -> list[list[torch.nn.Parameter]]:
    """The optimizer's parameters in at most ``slices`` runs of consecutive ones, of about as many
    elements each (a parameter goes to the run its middle element falls in): the parts of one
    update that threads run side by side."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = sum(p.numel() for p in params)
    runs: list[list[torch.nn.Parameter]] = [[] for _ in range(max(1, slices))]
    before = 0
    for p in params:
        runs[min(len(runs) - 1, (2 * before + p.numel()) * len(runs) // (2 * max(1, total)))].append(p)
        before += p.numel()
    return [run for run in runs if run] or [params]


def squares(grads: Iterable[torch.Tensor | None]) -> float:
    """The sum of the squares of ``grads``' elements, accumulated in float64: each backend sums
    its pieces of the step's gradients so, and adds the pieces up, so the global norm it clips with
    equals the reference's to the last bits float64 keeps."""
    total = 0.0
    for g in grads:
        if g is not None:
            total += float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    return total


def updates_speculate(max_grad_norm: float, optimizer_lag: int, fp16: bool, replicated: bool) -> bool:
    """Whether a step's host updates, which clipping's global norm or fp16's overflow vote hold
    back, start before them instead, each taken back in a step that clips (and redone clipped) or
    that the vote skips (:func:`undo_adamw_step`): the runtime's rule and the plan's.  Not with a
    lag (the updates run during the next step anyway) or replicas (the norm is of the replicas'
    sums, made in the updates' order): those wait."""
    return (bool(max_grad_norm) or fp16) and not optimizer_lag and not replicated


def clip_coefficient(squares_sum: float, max_norm: float) -> float:
    """What every gradient is multiplied by so that their global norm is at most ``max_norm``
    (1 when it is already, or when clipping is off): torch's ``clip_grad_norm_`` rule.  A
    non-finite norm (fp16 overflow is voted on before) leaves the gradients as they are."""
    if not max_norm or not math.isfinite(squares_sum):
        return 1.0
    return min(1.0, max_norm / (math.sqrt(squares_sum) + CLIP_EPS))


# What taking an AdamW step back costs (:func:`undo_adamw_step`: elementwise operations, not one fused
# kernel), in fused AdamW passes over the same parameters: measured once on a 2-core VM beside other
# work (docs/benchmarks.md, "Clipping: updates before the norm").  The plan charges it, and an
# emulated host takes that long.
ROLLBACK_PASSES = 4.8


def rollback_params(optimizer: torch.optim.AdamW) -> int:
    """How many parameters a fused AdamW pass would update in the time :func:`undo_adamw_step` takes
    back ``optimizer``'s last step (:data:`ROLLBACK_PASSES` times those it takes back)."""
    taken = sum(p.numel() for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None and p in optimizer.state)
    return round(ROLLBACK_PASSES * taken)


@torch.no_grad()
def undo_adamw_step(optimizer: torch.optim.AdamW) -> None:
    """Take back the last ``step()`` of :func:`adamw`, from what it left and the gradients it took
    (still attached, unchanged) at the learning rate it ran with: the weights, moments and step
    count before it, to rounding (a few units in the last place).  What lets a host update start
    before the step's global norm is known and be redone in the rare step that clips
    (SuperOffload's speculation and rollback); AdamW's arithmetic run backwards:
    ``p' = p (1 - lr wd) - lr / bc1 * m' / (sqrt(v') / sqrt(bc2) + eps)``,
    ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``."""
    for group in optimizer.param_groups:
        lr, (b1, b2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None or p not in optimizer.state:
                continue
            state = optimizer.state[p]
            t = float(state["step"])
            m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
            denom = v.sqrt().div_(math.sqrt(1 - b2 ** t)).add_(eps)
            p.addcdiv_(m, denom, value=lr / (1 - b1 ** t))
            if decay:
                p.div_(1 - lr * decay)
            m.sub_(g, alpha=1 - b1).div_(b1)
            v.addcmul_(g, g, value=-(1 - b2)).div_(b2).clamp_min_(0)
            state["step"] -= 1


def unscaled_squares(optimizer: torch.optim.Optimizer, unscale: float | None) -> float | None:
    """The gradients ``optimizer`` steps with divided in place by ``unscale`` (fp16's loss scale;
    None: as they are), and the sum of their squares; None where one is not finite (the step's
    vote will skip it).  What an update made before the step's decision takes first."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    if unscale is not None:
        for g in grads:
            g.div_(unscale)
    # one read of the gradients: a non-finite one makes the sum so (the float64 squares of finite
    # fp32 values cannot overflow)
    found = squares(grads)
    return found if math.isfinite(found) else None


def steps_clipped(norms: Iterable[float | None], max_norm: float) -> int:
    """How many of the steps whose global norms are ``norms`` (None: not taken) clipped."""
    return sum(1 for norm in norms if norm is not None and clip_coefficient(norm ** 2, max_norm) < 1)


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


def not_finite(grads: Iterable[torch.Tensor | None]) -> bool:
    """Whether an element of ``grads`` is not finite (fp16's overflow, the vote's one question)."""
    return any(g is not None and not torch.isfinite(g).all() for g in grads)


def grads_overflow(params: Iterable[torch.nn.Parameter]) -> bool:
    return not_finite(p.grad for p in params)
