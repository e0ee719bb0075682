"""This worker's shard of every chunk: the fp32 master and its gradient (the model's parameters
as pieces of them), AdamW's state, and the compute-dtype copy a gather reads; their update, and
their form in a checkpoint (full tensors by name, gathered from every worker's shards).

Offloaded chunks keep their shards in host memory (the compute copy page-locked) and are updated
on the CPU; device-resident chunks keep them on the device and are updated there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chunked_dp.chunks import Chunk
from mobius.metrics import Trace
from mobius.models import GPTConfig, build_model
from mobius.runtime.device import Device
from mobius.runtime.optim import UpdateRule, adamw, set_lr
from mobius.runtime.spec import Timing

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Piece:
    """The part of parameter ``name`` that falls in this worker's shard of a chunk."""

    name: str
    param_start: int  # first element within the parameter
    shard_start: int  # first element within the shard
    length: int
    decay: bool
    master: nn.Parameter  # fp32, a view of the chunk's master shard (host or device)


class Shards:
    """Per chunk ``k``: ``master[k]``, ``master_grad[k]`` (fp32), ``optimizers[k]`` (AdamW over
    its pieces, or None where the shard holds no parameter) and ``compute[k]`` (what gathers read)."""

    def __init__(self, config: GPTConfig, chunks: list[Chunk], rank: int, world: int, device: Device,
                 on_device: list[bool], dtype: torch.dtype, rule: UpdateRule, seed: int, trace: Trace,
                 timing: Timing | None):
        self.chunks, self.dev, self.on_device, self.dtype = chunks, device, on_device, dtype
        self.rule, self.trace, self.timing = rule, trace, timing
        self.size = chunks[0].size // world
        host_model = build_model(config, seed=seed)  # full fp32 weights, as every worker would load them
        named = dict(host_model.named_parameters())
        lo, hi = rank * self.size, (rank + 1) * self.size
        self.pieces: list[list[Piece]] = []
        self.master: list[torch.Tensor] = []
        self.master_grad: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer | None] = []
        for c in chunks:
            master = self._zeros(c.index, torch.float32, "master")
            grad = self._zeros(c.index, torch.float32, "gradient")
            mine, decay, no_decay = [], [], []
            with torch.no_grad():
                for slot in c.params:
                    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if a >= b:
                        continue
                    s = a - lo
                    master[s: s + b - a] = named[slot.name].detach().reshape(-1)[a - slot.offset: b - slot.offset]
                    p = nn.Parameter(master[s: s + b - a])  # shares the master shard's memory
                    p.grad = grad[s: s + b - a]  # so does its gradient: one in-place add per chunk
                    piece = Piece(slot.name, a - slot.offset, s, b - a, len(slot.shape) >= 2, p)
                    mine.append(piece)
                    (decay if piece.decay else no_decay).append(p)
            self.pieces.append(mine)
            self.master.append(master)
            self.master_grad.append(grad)
            # AdamW is elementwise: updating pieces of parameters, chunk by chunk, gives the reference's numbers.
            self.optimizers.append(adamw([{"params": decay, "weight_decay": rule.weight_decay},
                                          {"params": no_decay, "weight_decay": 0.0}], rule) if mine else None)
        self.compute = []
        for k in range(len(chunks)):
            out = (device.empty(self.size, dtype, name=f"compute shard of chunk {k}") if on_device[k]
                   else device.host_buffer(self.size, dtype))
            out.copy_(self.master[k])
            self.compute.append(out)

    def _zeros(self, k: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        if self.on_device[k]:
            return self.dev.empty(self.size, dtype, name=f"{what} shard of chunk {k}").zero_()
        return torch.zeros(self.size, dtype=dtype)

    def update(self, k: int, lr: float, stream, lane: str) -> None:
        """AdamW on chunk ``k``'s shard at ``lr`` (on ``stream``: the compute stream for a device
        chunk, the optimizer thread's for an offloaded one; traced on ``lane``), then the compute
        copy the next gather reads."""
        t0 = time.perf_counter()
        optimizer = self.optimizers[k]
        if optimizer is not None:
            set_lr(optimizer, lr)
            if self.on_device[k]:
                rate = 0.0 if self.timing is None else self.timing.device_adam_params_per_s
                span = self.dev.compute_span(self.size / rate if rate else 0.0)
            else:  # an emulated host takes its own rate's time, whatever the plan assumed
                span = self.dev.host_update_span(self.size)
            with span:
                optimizer.step()
            self.master_grad[k].zero_()
        stream.writes(self.compute[k], name=f"compute shard of chunk {k}")
        self.compute[k].copy_(self.master[k])
        self.trace.span(f"AdamW chunk {k}", lane, t0, time.perf_counter())

    # ---- checkpoints --------------------------------------------------------------------------
    def gather_full(self, k: int, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """All-gather an fp32 shard of chunk ``k`` into full tensors by name (host copies)."""
        mine = self.dev.empty(self.size, torch.float32, name=f"fp32 shard of chunk {k}")
        mine.copy_(shard)
        full = self.dev.empty(self.chunks[k].size, torch.float32, name=f"fp32 chunk {k}")
        all_gather(full, mine)
        return {slot.name: full[slot.offset: slot.offset + slot.numel].view(slot.shape).cpu().clone()
                for slot in self.chunks[k].params}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights by name (all-gathered; for tests and checkpoints)."""
        out = {}
        for k in range(len(self.chunks)):
            out.update(self.gather_full(k, self.master[k]))
        return out

    def _adam_shard(self, k: int, key: str) -> torch.Tensor:
        """AdamW's ``key`` state of chunk ``k``'s shard as one flat tensor (zeros where none)."""
        out = torch.zeros(self.size, dtype=torch.float32, device=self.master[k].device)
        optimizer = self.optimizers[k]
        for piece in self.pieces[k]:
            state = optimizer.state.get(piece.master, {}) if optimizer is not None else {}
            if key in state:
                out[piece.shard_start: piece.shard_start + piece.length] = state[key]
        return out

    def _adam_step(self) -> torch.Tensor | None:
        for optimizer in self.optimizers:
            for state in (optimizer.state.values() if optimizer is not None else ()):
                if "step" in state:
                    return state["step"]
        return None

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW state by parameter name, in the checkpoint's layout (``exp_avg/<name>``, ...)."""
        step = self._adam_step()
        # Every worker takes part in the gathers below: whether to is decided by the step count,
        # which is the same on every worker.
        if step is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for k in range(len(self.chunks)):
            for key in ("exp_avg", "exp_avg_sq"):
                for name, t in self.gather_full(k, self._adam_shard(k, key)).items():
                    out[f"{key}/{name}"] = t
            for slot in self.chunks[k].params:
                out[f"step/{slot.name}"] = step.detach().cpu().clone()
        return out

    def load(self, ckpt) -> None:
        """This worker's pieces of every parameter, and their AdamW state, from a checkpoint by name."""
        names = ckpt.names()
        with torch.no_grad():
            for k, pieces in enumerate(self.pieces):
                for piece in pieces:
                    sl = slice(piece.param_start, piece.param_start + piece.length)
                    piece.master.copy_(ckpt.get(piece.name).reshape(-1)[sl])
                    if f"exp_avg/{piece.name}" in names:
                        device = piece.master.device
                        self.optimizers[k].state[piece.master] = {
                            "step": ckpt.get(f"step/{piece.name}").clone(),
                            "exp_avg": ckpt.get(f"exp_avg/{piece.name}").reshape(-1)[sl].clone().to(device),
                            "exp_avg_sq": ckpt.get(f"exp_avg_sq/{piece.name}").reshape(-1)[sl].clone().to(device)}
                self.compute[k].copy_(self.master[k])
