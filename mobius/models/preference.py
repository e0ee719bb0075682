"""Preference objectives: DPO (``sigmoid``) and IPO (``ipo``), as TRL's ``DPOTrainer`` computes them.

A micro-batch holds whole pairs: each pair's chosen and rejected answers (each after its prompt)
are two examples of one packed row (:class:`PairLayout`), so the head that computes the loss has
both sides of every pair it sees, on every backend and schedule.  The head sums each side's
trained tokens' log-probabilities (:class:`SideLogProbs`, in token chunks as the cross-entropy
is), sets them against the reference model's (computed before training, in one forward-only pass
with the initial weights: under LoRA, the base model with its adapters at zero), and returns the
micro-batch's pairs' summed loss divided by the step's pairs: the micro-batches' losses add up to
the step's mean over pairs, as TRL's mean over a batch of pairs.

``sigmoid``: ``-log σ(β Δ)``, Δ the chosen answer's log-ratio to the reference less the rejected
one's; with ``label_smoothing`` ε, ``-(1-ε) log σ(β Δ) - ε log σ(-β Δ)`` (conservative DPO; ε = 0
is TRL 1.16's ``sigmoid``).  ``ipo``: ``(Δ' - 1/(2β))²``, Δ' the log-ratios divided by each
answer's trained tokens (TRL's normalisation).  The step's metrics are TRL's, under its names
(:data:`METRICS`): the rewards β x log-ratio of each side, how often the chosen one's is higher,
their margin, and each side's log-probability, averaged over the step's pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceObjective:
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"

    def describe(self) -> str:
        name = "IPO" if self.loss_type == "ipo" else "DPO"
        smoothing = f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else ""
        return f"{name} loss (--loss-type {self.loss_type}, beta {self.beta:g}{smoothing})"


@dataclass
class PairLayout:
    """The pairs of one micro-batch: which side of which pair each token belongs to."""

    sides: torch.Tensor  # (B, T): 2 x pair + 0 (chosen) or 1 (rejected); -1 for padding
    pairs: int  # pairs in this micro-batch
    step_pairs: int  # pairs in the whole step (or evaluation): the loss's divisor
    objective: PreferenceObjective
    reference: torch.Tensor | None = None  # (pairs, 2) the reference's log-probs; None: computing them
    # What the head found, for whoever holds the micro-batch (the dict is shared by every copy
    # ``to`` makes, so the batch a worker built sees what its head computed on the device):
    # "logps", each side's log-prob (pairs, 2); "sums", the metrics' sums over the pairs, in
    # METRICS' order (not in the reference pass).
    found: dict = field(default_factory=dict)

    def to(self, device: torch.device) -> "PairLayout":
        return PairLayout(self.sides.to(device), self.pairs, self.step_pairs, self.objective,
                          None if self.reference is None else self.reference.to(device), self.found)


class SideLogProbs(torch.autograd.Function):
    """Each side's summed log-probability of its targets under ``h @ weight.T`` (soft-capped where
    ``softcap``), over chunks of tokens so that only one chunk's logits exist at a time; backward
    recomputes each chunk's logits (one matmul more than keeping them, never the whole logits)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, sides: torch.Tensor,
                n_sides: int, chunk: int, softcap: float | None) -> torch.Tensor:
        out = torch.zeros(n_sides, dtype=_accumulated(h), device=h.device)
        for a in range(0, h.shape[0], chunk):
            logits = _logits(h[a:a + chunk], weight, softcap)[0]
            tc = targets[a:a + chunk]
            token = logits.gather(1, tc[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            out.index_add_(0, sides[a:a + chunk], token)
        ctx.save_for_backward(h, weight, targets, sides)
        ctx.chunk, ctx.softcap = chunk, softcap
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, targets, sides = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        per_token = grad.float()[sides]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_accumulated(h), device=h.device) if need_w else None
        for a in range(0, h.shape[0], ctx.chunk):
            hc, tc, g = h[a:a + ctx.chunk], targets[a:a + ctx.chunk], per_token[a:a + ctx.chunk]
            logits, capped = _logits(hc, weight, ctx.softcap)
            d = torch.softmax(logits, dim=-1).mul_(-g[:, None])  # d log p(t) / d logits = one-hot - softmax
            d[torch.arange(hc.shape[0], device=h.device), tc] += g
            if capped is not None:
                d.mul_(1.0 - capped.square_())
            d = d.to(h.dtype)
            if need_h:
                grad_h[a:a + ctx.chunk] = d @ weight
            if need_w:
                grad_w.add_((d.t() @ hc).to(grad_w.dtype))
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _accumulated(h: torch.Tensor) -> torch.dtype:
    """What the log-probabilities and the weight's gradient are computed in: fp32, or fp64 for fp64."""
    return torch.promote_types(h.dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, softcap: float | None):
    """A chunk's logits in :func:`_accumulated`'s type, and the tanh a soft cap applied (None
    without one), for its gradient."""
    logits = (h @ weight.t()).to(_accumulated(h))
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def pair_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, sides: torch.Tensor,
              pairs: PairLayout, chunk: int, softcap: float | None) -> torch.Tensor:
    """The micro-batch's share of the step's preference loss (``h``, ``targets``, ``sides``: its
    trained tokens' rows); the reference pass (``pairs.reference`` None) only records the
    log-probs, and returns zero."""
    n = pairs.pairs
    logps = SideLogProbs.apply(h, weight, targets, sides, 2 * n, chunk, softcap).view(n, 2)
    pairs.found["logps"] = logps.detach()
    if pairs.reference is None:
        return logps.sum().detach() * 0.0
    tokens = torch.bincount(sides, minlength=2 * n).view(n, 2).float()
    losses, pairs.found["sums"] = preference_losses(logps, pairs.reference.float(), tokens, pairs.objective)
    return losses.sum() / pairs.step_pairs


def preference_losses(logps: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor,
                      objective: PreferenceObjective) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss, and the sums of :data:`METRICS` over the pairs (``logps``, ``reference``,
    ``tokens``: (pairs, 2), chosen then rejected)."""
    beta, eps = objective.beta, objective.label_smoothing
    ratios = logps - reference
    if objective.loss_type == "ipo":
        delta = (ratios / tokens.clamp(min=1.0)) @ torch.tensor([1.0, -1.0], device=logps.device)
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
    else:
        delta = ratios[:, 0] - ratios[:, 1]
        losses = -(1.0 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    rewards = beta * ratios.detach()
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    sums = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                        logps[:, 0].detach().sum(), logps[:, 1].detach().sum()])
    return losses, sums


def metric_sums(micro: list) -> torch.Tensor:
    """The sums of :data:`METRICS` over the micro-batches (:class:`~mobius.data.corpus.Batch` es)
    whose heads ran here (zeros where none did: this process computed no head)."""
    total = torch.zeros(len(METRICS), dtype=torch.float64)
    for mb in micro:
        if (sums := mb.layout.pairs.found.get("sums")) is not None:
            total += sums.detach().double().cpu()
    return total


def step_metrics(sums: torch.Tensor | list[float], pairs: int) -> dict[str, float]:
    """The step's metrics under TRL's names, from the sums over its micro-batches."""
    return {name: float(s) / max(1, pairs) for name, s in zip(METRICS, sums)}
