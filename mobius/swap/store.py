"""Host stage store: each worker keeps the stages the plan maps to it in host memory.

Per stage, everything is flat, one buffer per kind, and parameters are views into it:

* ``frozen``: weights that never change (the base weights under LoRA), held once, in the compute
  dtype only: no master copy, gradient or optimizer state (empty in full fine-tuning);
* ``master``: fp32 master weights of the parameters that train (updated on the CPU by AdamW) and
  ``master_grad``, their gradients;
* ``compute``: the trained weights in the compute dtype (page-locked once on CUDA, by the device
  layer).  With fp32 compute it *is* ``master``.  With ``--optimizer-lag 1`` there are two
  (``compute_buffers``): step k reads buffer ``k % 2`` while the update of step k-1's gradients
  writes the other, so the next step never waits for AdamW;
* ``grad_staging``: where the device's gradients land (compute dtype, page-locked); with fp32
  compute it is ``master_grad`` itself.

A stage swap copies ``frozen`` then ``compute`` into one device slab, ``[frozen | trained]``, from
which the device parameters are views (:class:`Slot` offsets are into that slab); gradients exist
for the trained part only.  One buffer per kind means one host allocation (and one registration)
per stage instead of one per tensor, and one chunked copy per swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mobius.models import GPTConfig, build_layer, built_layers
from mobius.runtime.device import Device
from mobius.runtime.optim import UpdateRule, make_adamw


@dataclass
class Slot:
    """Where a parameter lives in its stage's flat buffers."""

    offset: int
    numel: int
    shape: tuple[int, ...]
    trained: bool = True


@dataclass
class HostStage:
    index: int
    layer_ids: list[int]
    master_layers: nn.ModuleList  # host layers: trained parameters view ``master``, frozen ones ``frozen``
    optimizer: torch.optim.Optimizer | None  # None when nothing in the stage trains (LoRA: embedding, head)
    frozen: torch.Tensor
    master: torch.Tensor
    master_grad: torch.Tensor
    compute_buffers: list[torch.Tensor]  # one, or with an optimizer lag of 1 two (by step parity)
    grad_staging: torch.Tensor
    slots: list[Slot]  # per parameter, in named_parameters order, in the device slab [frozen | trained]
    names: list[str] = field(default_factory=list)  # "layers.<i>.<param>"
    compute: torch.Tensor | None = None  # the buffer this step's loads read (HostStageStore.begin_step)
    # The master weights wait on disk between updates (mobius.swap.disk): ``master`` (and, 16-bit,
    # ``master_grad``) are empty but while the disk tier binds them.
    master_on_disk: bool = False
    # And the compute copy too: ``compute_buffers`` are empty, the loads read it from the disk tier.
    weights_on_disk: bool = False

    @property
    def param_bytes(self) -> int:
        """Bytes of the device slab: every weight of the stage in the compute dtype."""
        return (self.frozen.numel() + self.grad_staging.numel()) * self.grad_staging.element_size()

    @property
    def grad_bytes(self) -> int:
        """Bytes of the stage's device gradients (the trained weights only)."""
        return self.grad_staging.numel() * self.grad_staging.element_size()

    def grad_slots(self) -> list[Slot | None]:
        """Per parameter: its place in the gradient (and master) buffers, or None when frozen."""
        n = self.frozen.numel()
        return [Slot(sl.offset - n, sl.numel, sl.shape) if sl.trained else None for sl in self.slots]

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """Every host parameter by name (frozen ones in the compute dtype)."""
        return list(zip(self.names, self.master_layers.parameters()))

    def trained(self) -> list[tuple[str, nn.Parameter]]:
        """The fp32 master parameters that train, by name."""
        return [(n, p) for n, p in self.named_params() if p.requires_grad]

    @property
    def trains(self) -> bool:
        """Whether any weight of the stage trains (its optimizer may still be another replica's)."""
        return any(sl.trained for sl in self.slots)

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradients of the trained weights: the master's, or (master on disk, not
        bound now) as they came home, the same values."""
        if not self.master_on_disk:
            return [p.grad for p in self.master_params if p.grad is not None]
        return [view(self.grad_staging, slot) for slot in self.grad_slots() if slot is not None]

    def updated_gradients(self, as_staged: bool, leave_out: nn.Parameter | None = None) -> list[torch.Tensor | None]:
        """This step's gradients of the parameters this host's AdamW updates (with replicas, those
        it owns), in its order, but ``leave_out``: as they came home where ``as_staged`` (an update
        that converts them in its pass: the same values as in fp32), else the master's."""
        if self.optimizer is None:
            return []
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p is not leave_out]
        return [self.staged(p) for p in params] if as_staged else [p.grad for p in params]

    @property
    def master_params(self) -> list[nn.Parameter]:
        return [p for _, p in self.trained()]

    def staged(self, p: nn.Parameter) -> torch.Tensor:
        """Master parameter ``p``'s gradient as it came home (its part of ``grad_staging``, flat)."""
        at = (p.data_ptr() - self.master.data_ptr()) // p.element_size()
        return self.grad_staging[at:at + p.numel()]

    def attach_master_grads(self) -> None:
        """Point every trained master parameter's ``.grad`` at its view of ``master_grad``."""
        for (_, p), slot in zip(self.named_params(), self.grad_slots()):
            if slot is not None:
                p.grad = view(self.master_grad, slot)

    def host_bytes(self) -> int:
        """Bytes this stage holds on the host (each distinct buffer once)."""
        bufs = {t.untyped_storage().data_ptr(): t for t in (self.frozen, self.master, self.master_grad,
                                                              *self.compute_buffers, self.grad_staging)}
        states = self.optimizer.state.values() if self.optimizer else []
        state = sum(v.numel() * v.element_size() for st in states for v in st.values() if torch.is_tensor(v))
        return sum(t.numel() * t.element_size() for t in bufs.values()) + state


def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)


def whole_model_stage(named: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
                      computed: list[nn.Parameter] | None = None) -> HostStage:
    """The trained fp32 master parameters ``named`` of a model in this process (the single
    backend's, on its CPU), updated by ``optimizer``, as one host stage for the disk tier: their
    values moved into one flat master buffer, which they then view, and a flat gradient buffer
    beside it.  ``computed``: the parameters the model computes with where they are not the master
    (an optimizer lag), moved into a flat compute buffer of the same layout likewise."""
    numel = sum(p.numel() for _, p in named)
    master, master_grad = torch.empty(numel), torch.zeros(numel)
    compute = master if computed is None else torch.empty(numel)
    slots, at = [], 0
    with torch.no_grad():
        for k, (_, p) in enumerate(named):
            slots.append(Slot(at, p.numel(), tuple(p.shape)))
            for flat, q in ((master, p), (compute, None if computed is None else computed[k])):
                if q is not None:
                    view(flat, slots[-1]).copy_(q)
                    q.data = view(flat, slots[-1])
            at += p.numel()
    return HostStage(0, [], nn.ModuleList([nn.ParameterList([p for _, p in named])]), optimizer,
                     torch.empty(0), master, master_grad, [compute], master_grad, slots, [n for n, _ in named])


def _fill(meta: nn.Module, built: nn.Module, homes: list[torch.Tensor], at: int) -> int:
    """Copy the weights of ``built`` into their homes in the flat buffers (``homes[at:]``, in
    parameter order) and make ``meta``'s parameters views of them; returns the next index."""
    sources = iter(built.parameters())  # same order: the same layer, built on the CPU
    with torch.no_grad():
        for module in meta.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    homes[at].copy_(next(sources))
                    module._parameters[name] = nn.Parameter(homes[at], requires_grad=p.requires_grad)
                    at += 1
    return at


class HostStageStore:
    def __init__(self, config: GPTConfig, bounds: list[tuple[int, int]], stages: list[int], seed: int, rule: UpdateRule,
                 compute_dtype: torch.dtype, device: Device, optimizer_lag: int = 0, disk=None):
        """``disk``: the disk tier (:class:`~mobius.swap.disk.DiskState`) whose ``masters`` are the
        stages whose master weights (and of its ``weights``, compute copy) wait on disk: each is
        handed to it as soon as it is built, so the host never holds more than one of them."""
        self.config = config
        self.compute_dtype = compute_dtype
        self.stages: dict[int, HostStage] = {}
        self.lag = optimizer_lag
        self.rule = rule  # each stage's AdamW's
        n_buffers = optimizer_lag + 1
        parked = disk.masters if disk is not None else set()
        for s in stages:
            same = compute_dtype == torch.float32 and n_buffers == 1 and s not in parked
            lo, hi = bounds[s]
            # The stage's shape from meta layers; the weights are then built a few layers at a
            # time (one per core) and copied into the flat buffers, so building never holds more.
            layers = nn.ModuleList([build_layer(config, i, seed, device="meta") for i in range(lo, hi)])
            names = [f"layers.{lo + k}.{n}" for k, layer in enumerate(layers) for n, _ in layer.named_parameters()]
            params = list(layers.parameters())
            n_frozen = sum(p.numel() for p in params if not p.requires_grad)
            n_trained = sum(p.numel() for p in params if p.requires_grad)
            slots, frozen_at, trained_at = [], 0, n_frozen
            for p in params:
                if p.requires_grad:
                    slots.append(Slot(trained_at, p.numel(), tuple(p.shape)))
                    trained_at += p.numel()
                else:
                    slots.append(Slot(frozen_at, p.numel(), tuple(p.shape), trained=False))
                    frozen_at += p.numel()
            # What the device reads is page-locked by the device layer; fp32 compute without a lag
            # reads the master weights themselves.
            fp32 = compute_dtype == torch.float32
            frozen = device.host_buffer(n_frozen, compute_dtype) if n_frozen else torch.empty(0, dtype=compute_dtype)
            master = device.host_buffer(n_trained, torch.float32) if same else torch.empty(n_trained)
            master_grad = device.host_buffer(n_trained, torch.float32) if fp32 else torch.zeros(n_trained)
            homes = [view(master, Slot(sl.offset - n_frozen, sl.numel, sl.shape)) if sl.trained else view(frozen, sl)
                     for sl in slots]
            at = 0
            for layer, built in zip(layers, built_layers(config, range(lo, hi), seed)):
                at = _fill(layer, built, homes, at)
            params = list(layers.parameters())
            computes = [master] if same else [device.host_buffer(n_trained, compute_dtype) for _ in range(n_buffers)]
            grad_staging = master_grad if fp32 else device.host_buffer(n_trained, compute_dtype)
            optimizer = make_adamw(zip(names, params), rule) if n_trained else None
            stage = HostStage(s, list(range(lo, hi)), layers, optimizer, frozen, master,
                              master_grad, computes, grad_staging, slots, names)
            self.stages[s] = stage
            for b in range(n_buffers):
                self.refresh_compute_copy(s, b)
            if s in parked:
                stage.master_on_disk = True
                stage.weights_on_disk = s in disk.weights
                disk.park(stage)
        self.begin_step(0)

    def update_only(self, updates) -> None:
        """This host's AdamW updates only the parameters ``updates(name)`` says (the others are
        another data-parallel replica's, :mod:`mobius.stages.replicas`): each stage's optimizer is made
        again over them, or is None where it holds none.  Before the first step."""
        for st in self.stages.values():
            mine = [(n, p) for n, p in st.trained() if updates(n)]
            st.optimizer = make_adamw(mine, self.rule) if mine else None

    def begin_step(self, step: int) -> None:
        """Loads of step ``step`` read its compute buffer."""
        for s, st in self.stages.items():
            st.compute = self.compute_of(s, step)

    def compute_of(self, stage: int, step: int) -> torch.Tensor:
        """The compute copy of ``stage`` that step ``step`` reads."""
        buffers = self.stages[stage].compute_buffers
        return buffers[step % len(buffers)]

    def buffer_updated_by(self, step: int) -> int:
        """The compute buffer the update of step ``step``'s gradients writes: the one step
        ``step + 1 + lag`` reads."""
        return (step + 1 + self.lag) % (self.lag + 1)

    def refresh_compute_copy(self, stage: int, buffer: int = 0) -> None:
        """Master weights -> a compute-dtype copy (a no-op when they are the same, and where the
        disk tier holds the copy: it writes it)."""
        st = self.stages[stage]
        if st.weights_on_disk:
            return
        dst = st.compute_buffers[buffer]
        if dst.data_ptr() != st.master.data_ptr():
            with torch.no_grad():
                dst.copy_(st.master)

    def lagged_state(self, step: int) -> dict[str, torch.Tensor]:
        """With a lag: the trained weights step ``step`` computes with, by name (a checkpoint's
        LAGGED tensors)."""
        out = {}
        for st in self.stages.values():
            buf = st.compute_buffers[step % len(st.compute_buffers)]
            out.update({n: view(buf, slot) for n, slot in zip(st.names, st.grad_slots()) if slot is not None})
        return out

    def stage_state_dict(self, stage: int) -> dict[str, torch.Tensor]:
        """Copies of stage ``stage``'s weights by name (a master on disk must be bound: its
        disk tier's ``present``)."""
        return {n: p.detach().clone() for n, p in self.stages[stage].named_params()}

    def host_bytes(self) -> int:
        return sum(st.host_bytes() for st in self.stages.values())
