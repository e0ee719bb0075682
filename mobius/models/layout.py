"""How the tokens of a micro-batch are laid out: what every layer needs besides the hidden states.

A sequence may hold several examples packed end to end.  Each example's positions restart at 0
and its tokens attend only to earlier tokens *of the same example* (a block-diagonal causal mask),
so a packed sequence computes exactly what each example would compute alone.  Targets equal to
:data:`IGNORE` (prompts, padding, the last token of an example) carry no loss.

The loss of a micro-batch is the *sum* of its trained tokens' cross-entropies divided by
``loss_tokens``, the number of trained tokens in the whole optimizer step: the micro-batches'
losses then add up to the step's token mean, whatever the split into micro-batches, and their
gradients to the gradient of that mean.

Workers derive the layout of micro-batch ``m`` of step ``k`` from the data themselves (batches are
a pure function of ``(seed, step)``), so it never travels between pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE = -100  # a target that carries no loss (the value PyTorch and Hugging Face use)


@dataclass
class TokenLayout:
    targets: torch.Tensor | None = None  # (B, T) next-token ids, IGNORE where nothing is trained
    positions: torch.Tensor | None = None  # (B, T); None: 0..T-1 in every row
    segments: torch.Tensor | None = None  # (B, T) example ids; None: one example per row
    loss_tokens: int | None = None  # the step's trained tokens; None: this micro-batch's own
    every_target_trained: bool = False  # known to hold no IGNORE (text windows): no selection needed
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def to(self, device: torch.device) -> "TokenLayout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenLayout(move(self.targets), move(self.positions), move(self.segments), self.loss_tokens,
                           self.every_target_trained)

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, T, T) booleans: query i may attend key j when both belong to one example and
        j <= i.  Built once per micro-batch and device, shared by every block of a stage."""
        if self._mask is None:
            seg = self.segments
            t = seg.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=seg.device).tril_()
            self._mask = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        return self._mask


def as_layout(layout: "TokenLayout | torch.Tensor | None") -> TokenLayout:
    """A bare targets tensor stands for a plain micro-batch: one example per row, every token trained."""
    if layout is None:
        return TokenLayout()
    return layout if isinstance(layout, TokenLayout) else TokenLayout(targets=layout, every_target_trained=True)
