"""How the tokens of a micro-batch are laid out: what every layer needs besides the hidden states.

A sequence may hold several examples packed end to end.  Each example's positions restart at 0
and its tokens attend only to earlier tokens *of the same example* (a block-diagonal causal mask),
so a packed sequence computes exactly what each example would compute alone.  Targets equal to
:data:`IGNORE` (prompts, padding, the last token of an example) carry no loss.

The loss of a micro-batch is the *sum* of its trained tokens' cross-entropies divided by
``loss_tokens``, the number of trained tokens in the whole optimizer step: the micro-batches'
losses then add up to the step's token mean, whatever the split into micro-batches, and their
gradients to the gradient of that mean.

A mixture of experts' load-balancing loss is a mean over the step's micro-batches, each over its
tokens but padding (``real``): ``balance_share`` is the micro-batch's share of that mean.

A micro-batch of preference pairs (DPO) carries :class:`~mobius.models.preference.PairLayout`
instead: its loss is over pairs of examples, not tokens.

Workers derive the layout of micro-batch ``m`` of step ``k`` from the data themselves (batches are
a pure function of ``(seed, step)``), so it never travels between pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mobius.models.preference import PairLayout

IGNORE = -100  # a target that carries no loss (the value PyTorch and Hugging Face use)


@dataclass
class TokenLayout:
    targets: torch.Tensor | None = None  # (B, T) next-token ids, IGNORE where nothing is trained
    positions: torch.Tensor | None = None  # (B, T); None: 0..T-1 in every row
    segments: torch.Tensor | None = None  # (B, T) example ids; None: one example per row
    loss_tokens: int | None = None  # the step's trained tokens; None: this micro-batch's own
    every_target_trained: bool = False  # known to hold no IGNORE (text windows): no selection needed
    pairs: PairLayout | None = None  # preference pairs: the loss is theirs (mobius.models.preference)
    real: torch.Tensor | None = None  # (B, T) False at padding; None: no padding
    balance_share: float = 1.0  # of the step's mean load-balancing loss (mobius.models.router_balance)
    _masks: dict = field(default_factory=dict, repr=False)  # attention masks by sliding window

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def to(self, device: torch.device) -> "TokenLayout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenLayout(move(self.targets), move(self.positions), move(self.segments), self.loss_tokens,
                           self.every_target_trained, None if self.pairs is None else self.pairs.to(device),
                           move(self.real), self.balance_share)

    def for_blocks(self, padding: bool) -> "TokenLayout | None":
        """What the layers before the head need: packed examples' positions and segments, and
        with ``padding`` (a load-balancing loss counts real tokens only) where the padding is;
        None where that is nothing."""
        real = self.real if padding else None
        if not self.packed and real is None:
            return None
        return TokenLayout(positions=self.positions, segments=self.segments, real=real)

    def attention_mask(self, window: int | None = None) -> torch.Tensor:
        """(B, 1, T, T) booleans: query i may attend key j when both belong to one example and
        j <= i (and i - j < ``window``).  Built once per micro-batch, device and window, shared by
        every block of a stage."""
        if window not in self._masks:
            seg = self.segments
            same_example = seg[:, :, None] == seg[:, None, :]
            self._masks[window] = (same_example & causal_mask(seg.shape[1], window, seg.device))[:, None]
        return self._masks[window]


def causal_mask(t: int, window: int | None, device) -> torch.Tensor:
    """(T, T) booleans: query i sees key j when j <= i, and with a sliding ``window`` when i - j <
    window (the query itself and the window - 1 tokens before it, as Hugging Face's mask)."""
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril_()
    return mask if window is None else mask.triu_(-(window - 1))


def as_layout(layout: "TokenLayout | torch.Tensor | None") -> TokenLayout:
    """A bare targets tensor stands for a plain micro-batch: one example per row, every token trained."""
    if layout is None:
        return TokenLayout()
    return layout if isinstance(layout, TokenLayout) else TokenLayout(targets=layout, every_target_trained=True)
