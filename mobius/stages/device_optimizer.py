"""AdamW on the device, for the stages the plan keeps resident there.

Mobius updates every stage on the host; Elixir and PatrickStar keep on the GPU the optimizer state
that fits there.  Here a stage the planner marks resident (it fits beside the swapped stages'
schedule, and the cost model says the step is faster for it) is loaded once and never evicted
(:mod:`mobius.stages.ops`).  Its gradients accumulate in one persistent device buffer; after its
backward, on the compute stream, they become the fp32 master gradients (with 16-bit compute; with
fp32 the device weights are the master), fused AdamW updates the device master and the
compute-dtype weights are refreshed from it in place.  No gradient leaves the device, no weight
comes back, and the host's optimizer thread is spared the stage.

The device master weights and AdamW state start from the host stage store's (a fresh run's, or a
resumed checkpoint's) at the stage's first update, and go back to it (:meth:`sync_to_host`) before
a checkpoint, an export or the final weights are read: those are the same files, whichever stages
were resident.  The optimizer is :func:`mobius.runtime.optim.make_adamw`'s, as on the host, so CPU workers
give the host path's numbers to the bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mobius.metrics import Trace
from mobius.runtime.device import Device
from mobius.runtime.optim import make_adamw, set_lr, squares
from mobius.swap.memory import DeviceMemory
from mobius.swap.store import HostStageStore, view


@dataclass
class _Resident:
    """One resident stage's optimizer on the device."""

    weights: torch.Tensor  # the stage's device slab [frozen | trained], compute dtype
    params: list[nn.Parameter]  # what AdamW steps: the device weights (fp32), or views of ``master``
    host_params: list[nn.Parameter]  # the host master parameters, in the same order
    master: torch.Tensor | None  # fp32 master of the trained weights (16-bit compute), else None
    master_grad: torch.Tensor | None  # its gradients (16-bit compute), else None
    optimizer: torch.optim.Optimizer


class DeviceOptimizer:
    def __init__(self, store: HostStageStore, device: Device, memory: DeviceMemory, trace: Trace,
                 adam_params_per_s: float = float("inf")):
        self.store, self.device, self.memory, self.trace = store, device, memory, trace
        self.adam_params_per_s = adam_params_per_s  # on emulated GPUs, the update takes this long
        self.compute = device.compute
        self._grads: dict[int, torch.Tensor] = {}
        self._stages: dict[int, _Resident] = {}
        # Clipping needs the whole step's gradient norm before any update: the updates wait for
        # finish_step (mobius.stages.host_optimizer.ResidentUpdates); the gradients stay on the device.
        self.held_back = bool(store.rule.max_grad_norm)
        self._pending: list[tuple[int, nn.ModuleList, torch.Tensor, float]] = []

    def gradients_for(self, s: int, layers: nn.ModuleList) -> torch.Tensor:
        """Stage ``s``'s persistent device gradient buffer, zeroed; autograd accumulates into views of it."""
        host = self.store.stages[s]
        if s not in self._grads:
            self.memory.allocate(host.grad_bytes, f"gradients of resident stage {s}", for_good=True)
            self._grads[s] = self.device.empty(host.compute.numel(), host.compute.dtype,
                                               name=f"gradients of resident stage {s}")
        grads = self._grads[s]
        grads.zero_()
        for p, slot in zip(layers.parameters(), host.grad_slots()):
            if slot is not None:
                p.grad = view(grads, slot)
        return grads

    def update(self, s: int, layers: nn.ModuleList, weights: torch.Tensor, lr: float) -> None:
        """Stage ``s``'s backward of this step is done: AdamW on the device, on the compute stream
        (held back until :meth:`apply` where the step's gradients are clipped)."""
        if self.held_back:
            self._pending.append((s, layers, weights, lr))
        else:
            self._update(s, layers, weights, lr, 1.0)

    def squares(self) -> float:
        """The sum of squares of the held-back stages' gradients."""
        return squares(self._grads[s] for s, *_ in self._pending)

    def apply(self, clip: float) -> None:
        """The held-back updates, their gradients scaled by ``clip``."""
        for s, layers, weights, lr in self._pending:
            self._update(s, layers, weights, lr, clip)
        self._pending.clear()

    def _update(self, s: int, layers: nn.ModuleList, weights: torch.Tensor, lr: float, clip: float) -> None:
        t0 = time.perf_counter()
        resident = self._stages.get(s) or self._start(s, layers, weights)
        host = self.store.stages[s]
        if resident.master_grad is not None:
            resident.master_grad.copy_(self._grads[s])
        if clip < 1.0:  # in fp32 where there is a master (as the host's master gradients are)
            for p in resident.params:
                p.grad.mul_(clip)
        set_lr(resident.optimizer, lr)
        with self.device.compute_span(host.compute.numel() / self.adam_params_per_s):
            resident.optimizer.step()
        if resident.master is not None:  # the weights the next step computes with
            weights[host.frozen.numel():].copy_(resident.master)
        self.compute.writes(weights, name=f"weights of resident stage {s}")
        self.trace.span(f"AdamW {s} on the device", "compute", t0, time.perf_counter())

    def _start(self, s: int, layers: nn.ModuleList, weights: torch.Tensor) -> _Resident:
        """The stage's optimizer on the device, from the host's master weights and AdamW state."""
        host = self.store.stages[s]
        trained = [(n, p) for n, p in zip(host.names, layers.parameters()) if p.requires_grad]
        host_params = host.master_params
        n = host.compute.numel()
        if host.compute.dtype == torch.float32:  # the device weights are the master
            master = master_grad = None
            params = [p for _, p in trained]
        else:
            self.memory.allocate(8 * n, f"fp32 master weights and gradients of resident stage {s}", for_good=True)
            master = self.device.empty(n, torch.float32, name=f"master weights of resident stage {s}")
            master_grad = self.device.empty(n, torch.float32, name=f"master gradients of resident stage {s}")
            self.compute.copy(master, host.master)
            params = []
            for slot in host.grad_slots():
                if slot is not None:
                    p = nn.Parameter(view(master, slot))
                    p.grad = view(master_grad, slot)
                    params.append(p)
        self.memory.allocate(8 * n, f"AdamW moments of resident stage {s}", for_good=True)
        optimizer = make_adamw(zip([name for name, _ in trained], params), self.store.rule)
        for hp, dp in zip(host_params, params):  # a resumed run's moments (a fresh one has none yet)
            state = host.optimizer.state.get(hp)
            if state:
                optimizer.state[dp] = {k: v.detach().to(dp.device).clone() for k, v in state.items()}
        self._stages[s] = _Resident(weights, params, host_params, master, master_grad, optimizer)
        return self._stages[s]

    def sync_to_host(self) -> None:
        """The resident stages' master weights and AdamW state into the host stage store (before a
        checkpoint, an export or the final weights are read)."""
        for s, resident in self._stages.items():
            host = self.store.stages[s]
            source = resident.master if resident.master is not None else resident.weights[host.frozen.numel():]
            self.compute.copy(host.master, source, name=f"host master of resident stage {s}", direction="d2h")
            self.compute.writes(host.compute, name=f"host weights of resident stage {s}")
            self.compute.record().synchronize()
            self.store.refresh_compute_copy(s)
            for hp, dp in zip(resident.host_params, resident.params):
                state = resident.optimizer.state.get(dp)
                if state:
                    host.optimizer.state[hp] = {k: v.detach().to("cpu").clone() for k, v in state.items()}

