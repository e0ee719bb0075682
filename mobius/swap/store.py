"""Host stage store: each worker keeps the stages the plan maps to it in host memory.

Per stage: fp32 master weights with their AdamW state (updated on the CPU), plus a copy in the
compute dtype (pinned on CUDA) that is what a stage swap copies to the device.  With fp32 compute
the master weights are that copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mobius.models import GPTConfig, build_layer
from mobius.optim import make_adamw


@dataclass
class HostStage:
    index: int
    layer_ids: list[int]
    master: nn.ModuleList  # fp32 layers on the host: master weights (+ .grad for the update)
    optimizer: torch.optim.Optimizer
    compute_copy: list[torch.Tensor]  # per parameter, compute dtype, in named_parameters order
    names: list[str] = field(default_factory=list)  # "layers.<i>.<param>"
    device_layers: nn.ModuleList | None = None  # the stage's device modules, weights swapped in and out

    @property
    def param_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.compute_copy)


class HostStageStore:
    def __init__(self, config: GPTConfig, bounds: list[tuple[int, int]], stages: list[int], seed: int, lr: float,
                 compute_dtype: torch.dtype, pin: bool):
        self.config = config
        self.compute_dtype = compute_dtype
        self.stages: dict[int, HostStage] = {}
        for s in stages:
            lo, hi = bounds[s]
            layers = nn.ModuleList([build_layer(config, i, seed) for i in range(lo, hi)])
            names = [f"layers.{lo + k}.{n}" for k, layer in enumerate(layers) for n, _ in layer.named_parameters()]
            params = [p for layer in layers for p in layer.parameters()]
            optimizer = make_adamw(zip(names, params), lr)
            if compute_dtype == torch.float32 and not pin:
                copy = [p.data for p in params]
            else:
                copy = [p.detach().to(compute_dtype) for p in params]
                if pin:
                    copy = [t.pin_memory() for t in copy]
            self.stages[s] = HostStage(s, list(range(lo, hi)), layers, optimizer, copy, names)

    def refresh_compute_copy(self, stage: int) -> None:
        """After the update: master weights -> compute-dtype copy (a no-op when they are the same)."""
        st = self.stages[stage]
        with torch.no_grad():
            for dst, p in zip(st.compute_copy, st.master.parameters()):
                if dst.data_ptr() != p.data_ptr():
                    dst.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for st in self.stages.values()
                for n, p in zip(st.names, st.master.parameters())}
