"""The sharded chunk engine: data parallelism over chunks with an rCache (Elixir, PatrickStar).

Each worker keeps, per chunk, only its shard: fp32 master pieces with their AdamW state, and the
compute-dtype copy that an all-gather needs.  Offloaded chunks keep them in host memory and
update on the CPU.  Device-resident chunks keep them on the device and update there.  The model's
parameters are views into rCache blocks:

* before a layer runs (forward or backward), each chunk it uses is all-gathered into a block
  (Belady replacement over the order recorded in the warm-up step, LRU during it).  An evicted
  chunk needs no write-back: the master copy is elsewhere;
* a chunk's gradient is reduce-scattered once the last layer using it has run backward.  Its
  gradients are copied into its block, so the parameter memory is reused for them.  Each worker
  adds its shard of the sum to the fp32 master gradients;
* after the step's micro-batches, AdamW updates each worker's shards, and the rCache is
  invalidated (its contents are stale).

Tensor states per chunk (PatrickStar): FREE (not in a block), COMPUTE (its layer is running, pinned),
HOLD (gathered, evictable), HOLD_AFTER_BWD (some of its layers have run backward) and
READY_FOR_REDUCE (all of them have).

One step consumes M micro-batches split evenly across workers; each micro-batch's loss is its
share of the step's token mean (:mod:`mobius.models.layout`), so the summed gradient is the
reference trainer's.  Layers are recomputed in backward (activation
checkpointing per layer): an autograd graph kept from forward would hold views of rCache blocks
that other chunks have since overwritten.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chunked_dp.cache import RCachePolicy
from chunked_dp.chunks import Chunk, chunks_of_layers, pack, trace_first_use
from mobius.data import BatchSource
from mobius.metrics import StepMetrics, Trace
from mobius.models import GPTConfig, LayerList, build_layer, build_model
from mobius.optim import WEIGHT_DECAY, adamw, lr_at, set_lr
from mobius.runtime.device import Device

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ChunkState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


@dataclass
class Piece:
    """The part of parameter ``name`` that falls in this worker's shard of a chunk."""

    name: str
    param_start: int  # first element within the parameter
    shard_start: int  # first element within the shard
    length: int
    decay: bool
    master: nn.Parameter  # fp32, host (offloaded chunk) or device


@dataclass
class Counters:
    gather_bytes: int = 0  # full chunks materialised by all-gathers (compute dtype)
    reduce_bytes: int = 0  # full gradient chunks reduce-scattered
    h2d: int = 0
    d2h: int = 0
    peer: int = 0  # bytes this worker sent in collectives
    prefetched: int = 0  # gathers started ahead of their use

    def reset(self) -> None:
        self.gather_bytes = self.reduce_bytes = self.h2d = self.d2h = self.peer = self.prefetched = 0


class ChunkedEngine:
    def __init__(self, config: GPTConfig, rank: int, world: int, device: Device, chunk_size: int,
                 n_block: int, offload: bool, device_chunks: int, compute_dtype: torch.dtype, seed: int,
                 lr: float, total_steps: int, trace: Trace | None = None, prefetch: bool = True):
        self.config, self.rank, self.world = config, rank, world
        self.dev, self.device = device, device.torch_device  # the device layer, and its torch device
        self.dtype, self.lr, self.total_steps = compute_dtype, lr, total_steps
        self.trace = trace or Trace(False)
        self.counters = Counters()
        use = trace_first_use(config)
        self.chunks: list[Chunk] = pack(use, chunk_size, world)
        self.layer_chunks = chunks_of_layers(self.chunks, use)
        self.n_block = max(1, min(n_block, len(self.chunks)))
        if self.n_block < max(len(cs) for cs in self.layer_chunks):
            raise ValueError(f"the rCache needs at least {max(len(cs) for cs in self.layer_chunks)} blocks "
                             f"(one layer's chunks), got {self.n_block}")
        # Offload: chunks beyond the first ``device_chunks`` live (master, AdamW) in host memory.
        self.on_device = [not offload or c.index < device_chunks for c in self.chunks]
        self.shard = self.chunks[0].size // world
        self._build_shards(seed)
        self.model = self._skeleton()
        self.params = dict(self.model.named_parameters())
        self.blocks = [torch.empty(self.chunks[0].size, dtype=compute_dtype, device=self.device) for _ in range(self.n_block)]
        self.cache = RCachePolicy(self.n_block, "belady")
        self.recorded: list[int] = []
        self.state = [ChunkState.FREE] * len(self.chunks)
        self.prefetch = prefetch
        self.inflight: dict[int, tuple] = {}  # chunk -> (async all-gather work, its source shard)

    # ---- construction -----------------------------------------------------------------------
    def _build_shards(self, seed: int) -> None:
        """fp32 master pieces of this worker's shard of every chunk, and their AdamW."""
        host_model = build_model(self.config, seed=seed)  # full fp32 weights, as every worker would load them
        named = dict(host_model.named_parameters())
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        self.pieces: list[list[Piece]] = []
        decay, no_decay = [], []
        for c in self.chunks:
            target = self.device if self.on_device[c.index] else torch.device("cpu")
            mine = []
            for slot in c.params:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a >= b:
                    continue
                flat = named[slot.name].detach().reshape(-1)[a - slot.offset: b - slot.offset]
                master = nn.Parameter(flat.clone().to(target))
                piece = Piece(slot.name, a - slot.offset, a - lo, b - a, len(slot.shape) >= 2, master)
                mine.append(piece)
                (decay if piece.decay else no_decay).append(master)
            self.pieces.append(mine)
        groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
        # AdamW is elementwise: updating pieces of parameters gives the reference's numbers.
        self.optimizer = adamw(groups, self.lr)
        self.compute_shards = [self._compute_shard(k) for k in range(len(self.chunks))]

    def _compute_shard(self, k: int) -> torch.Tensor:
        """This worker's shard of chunk ``k`` in the compute dtype (padding is zero)."""
        if self.on_device[k]:
            out = torch.zeros(self.shard, dtype=self.dtype, device=self.device)
        else:  # offloaded: a host buffer the device copies from asynchronously
            out = self.dev.host_buffer(self.shard, self.dtype).zero_()
        for piece in self.pieces[k]:
            out[piece.shard_start: piece.shard_start + piece.length] = piece.master.detach()
        return out

    def _skeleton(self) -> LayerList:
        """The model on the meta device, with every parameter an empty device tensor until gathered."""
        layers = [build_layer(self.config, i, seed=0, device="meta") for i in range(len(self.layer_chunks))]
        model = LayerList(self.config, layers)
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.device.type == "meta":
                    module._parameters[name] = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device))
        if self.config.tie_embeddings:
            model.layers[-1].lm_head.weight = model.layers[0].wte.weight
        return model

    # ---- the rCache -------------------------------------------------------------------------
    def _access(self, k: int) -> None:
        """Make chunk ``k`` resident and pin it (COMPUTE)."""
        self.recorded.append(k)
        hit, victim = self.cache.access(k)
        if victim is not None:
            self._release_views(victim)
        if k in self.inflight:  # prefetched: wait for its all-gather, then point the parameters at it
            work, _ = self.inflight.pop(k)
            work.wait()
            self._set_views(k)
        elif not hit:
            self._gather(k)
        self.cache.pinned.add(k)
        if self.state[k] in (ChunkState.FREE, ChunkState.HOLD):
            self.state[k] = ChunkState.COMPUTE

    def _start_gather(self, k: int, async_op: bool):
        """All-gather chunk ``k``'s shards into its block (its shard first comes from host memory
        when the chunk is offloaded)."""
        block = self.blocks[self.cache.block_of(k)]
        shard = self.compute_shards[k]
        if not self.on_device[k]:
            self.counters.h2d += shard.numel() * shard.element_size()
            on_device = self.dev.empty(shard.numel(), shard.dtype, name=f"shard of chunk {k}")
            self.dev.compute.copy(on_device, shard)  # the gather below runs on the compute stream
            shard = on_device
        self.counters.gather_bytes += block.numel() * block.element_size()
        self.counters.peer += shard.numel() * shard.element_size() * (self.world - 1)
        return _all_gather(block, shard, async_op=async_op), shard

    def _set_views(self, k: int) -> None:
        block = self.blocks[self.cache.block_of(k)]
        for slot in self.chunks[k].params:
            self.params[slot.name].data = block[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def _gather(self, k: int) -> None:
        t0 = time.perf_counter()
        self._start_gather(k, async_op=False)
        self._set_views(k)
        self.trace.span(f"gather chunk {k}", "comm", t0, time.perf_counter())

    def _prefetch(self, layer: int) -> None:
        """Start gathering ``layer``'s chunks while the current layer computes (NCCL runs it on its
        own stream, gloo on its own thread).  Every worker decides identically, so collectives stay
        in the same order everywhere."""
        if not self.prefetch or not 0 <= layer < len(self.layer_chunks):
            return
        for k in self.layer_chunks[layer]:
            if k in self.inflight or k in self.cache.resident:
                continue
            placed, victim = self.cache.reserve(k)
            if not placed:
                return
            if victim is not None:
                self._release_views(victim)
            self.inflight[k] = self._start_gather(k, async_op=True)
            self.counters.prefetched += 1

    def _release_views(self, k: int) -> None:
        """Eviction: no write-back (the master copy is elsewhere); gradients stay in ``.grad``."""
        for slot in self.chunks[k].params:
            p = self.params[slot.name]
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.state[k] != ChunkState.HOLD_AFTER_BWD:
            self.state[k] = ChunkState.FREE

    def _unpin(self, k: int, after_backward: bool) -> None:
        self.cache.pinned.discard(k)
        if after_backward:
            self.state[k] = ChunkState.HOLD_AFTER_BWD
        elif self.state[k] == ChunkState.COMPUTE:
            self.state[k] = ChunkState.HOLD

    def _reduce(self, k: int, scale: float) -> None:
        """All of chunk ``k``'s users have run backward: its gradients (in its block when resident,
        reusing the parameter memory) are reduce-scattered and added to the fp32 master grads."""
        t0 = time.perf_counter()
        self.state[k] = ChunkState.READY_FOR_REDUCE
        c = self.chunks[k]
        if k in self.cache.resident:
            flat = self.blocks[self.cache.block_of(k)]
            self._release_views(k)
            self.cache.resident.pop(k)
        else:
            flat = torch.empty(c.size, dtype=self.dtype, device=self.device)
        flat.zero_()
        for slot in c.params:
            p = self.params[slot.name]
            if p.grad is not None:
                flat[slot.offset: slot.offset + slot.numel] = p.grad.reshape(-1)
                p.grad = None
        mine = torch.empty(self.shard, dtype=self.dtype, device=self.device)
        _reduce_scatter(mine, flat)
        self.counters.reduce_bytes += flat.numel() * flat.element_size()
        self.counters.peer += mine.numel() * mine.element_size() * (self.world - 1)
        if not self.on_device[k]:
            self.counters.d2h += mine.numel() * mine.element_size()
        for piece in self.pieces[k]:
            g = mine[piece.shard_start: piece.shard_start + piece.length].to(piece.master.device, torch.float32)
            g = g * scale if scale != 1.0 else g
            piece.master.grad = g if piece.master.grad is None else piece.master.grad + g
        self.state[k] = ChunkState.FREE
        self.trace.span(f"reduce chunk {k}", "comm", t0, time.perf_counter())

    # ---- one step -----------------------------------------------------------------------------
    def step(self, step: int, batches: BatchSource) -> StepMetrics:
        t0 = time.perf_counter()
        self.counters.reset()
        micro = batches.step(step)
        M = len(micro)
        mine = micro[self.rank * M // self.world: (self.rank + 1) * M // self.world]
        lr = lr_at(step, self.total_steps, self.lr)
        set_lr(self.optimizer, lr)
        self.cache.new_step()
        self.recorded = []
        layers = self.model.layers
        loss_sum = 0.0
        for mb in mine:
            tokens, layout = mb.tokens.to(self.device), mb.layout.to(self.device)
            inputs = []
            x = tokens
            # Forward without autograd: a graph would hold views of rCache blocks that get reused.
            with torch.no_grad():
                for i, layer in enumerate(layers):
                    for k in self.layer_chunks[i]:
                        self._access(k)
                    self._prefetch(i + 1)
                    inputs.append(x)
                    x = layer(x, layout)
                    for k in self.layer_chunks[i]:
                        self._unpin(k, after_backward=False)
            loss_sum += x.item()
            pending = {c.index: len(c.layers) for c in self.chunks}
            grad = None
            # Backward layer by layer, recomputing each layer's forward (activation checkpointing).
            for i in range(len(layers) - 1, -1, -1):
                layer = layers[i]
                for k in self.layer_chunks[i]:
                    self._access(k)
                self._prefetch(i - 1)
                x_in = inputs.pop().detach()
                x_in.requires_grad_(x_in.is_floating_point())
                y = layer(x_in, layout)
                if grad is None:
                    y.backward()  # the loss is already this micro-batch's share of the step's mean
                else:
                    y.backward(grad)
                grad = x_in.grad
                for k in self.layer_chunks[i]:
                    self._unpin(k, after_backward=True)
                    pending[k] -= 1
                    if pending[k] == 0:
                        self._reduce(k, 1.0)
        # The order just recorded is every later step's future: Belady from now on.
        if not self.cache.future_known:
            self.cache.set_future(self.recorded)
        for work, _ in self.inflight.values():
            work.wait()
        self.inflight.clear()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.compute_shards = [self._compute_shard(k) for k in range(len(self.chunks))]
        for k in list(self.cache.resident):
            self._release_views(k)
        self.cache.drop_all()
        stats = torch.tensor([loss_sum, self.counters.h2d, self.counters.d2h, self.counters.peer], dtype=torch.float64)
        dist.all_reduce(stats)
        tokens = M * micro[0].tokens.numel()
        block_bytes = self.n_block * self.chunks[0].size * torch.empty((), dtype=self.dtype).element_size()
        return StepMetrics(step=step, loss=stats[0].item(), lr=lr, tokens=tokens,
                           step_time_s=time.perf_counter() - t0, h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]),
                           peer_bytes=int(stats[3]), peak_device_bytes=block_bytes)

    def evaluate(self, held_out) -> float:
        """Loss on held-out examples: each worker runs its share of every pass's micro-batches
        forward (no autograd), gathering chunks as in training; the sum over workers."""
        total, layers = 0.0, self.model.layers
        for k in range(held_out.passes):
            micro = held_out.pass_batches(k)
            M = len(micro)
            self.cache.new_step()
            for mb in micro[self.rank * M // self.world: (self.rank + 1) * M // self.world]:
                x, layout = mb.tokens.to(self.device), mb.layout.to(self.device)
                with torch.no_grad():
                    for i, layer in enumerate(layers):
                        for c in self.layer_chunks[i]:
                            self._access(c)
                        self._prefetch(i + 1)
                        x = layer(x, layout)
                        for c in self.layer_chunks[i]:
                            self._unpin(c, after_backward=False)
                total += x.item()
        for work, _ in self.inflight.values():
            work.wait()
        self.inflight.clear()
        for c in list(self.cache.resident):
            self._release_views(c)
        self.cache.drop_all()
        stats = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(stats)
        return stats.item()

    def _gather_full(self, k: int, value) -> dict[str, torch.Tensor]:
        """All-gather an fp32 per-piece quantity of chunk ``k`` into full tensors by name."""
        shard = torch.zeros(self.shard, dtype=torch.float32, device=self.device)
        for piece in self.pieces[k]:
            shard[piece.shard_start: piece.shard_start + piece.length] = value(piece).to(self.device)
        full = torch.empty(self.chunks[k].size, dtype=torch.float32, device=self.device)
        _all_gather(full, shard)
        return {slot.name: full[slot.offset: slot.offset + slot.numel].view(slot.shape).cpu().clone()
                for slot in self.chunks[k].params}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights by name (all-gathered; for tests and checkpoints)."""
        out = {}
        for k in range(len(self.chunks)):
            out.update(self._gather_full(k, lambda piece: piece.master.detach()))
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW state by parameter name, in the checkpoint's layout (``exp_avg/<name>``, ...)."""
        out: dict[str, torch.Tensor] = {}
        step = None
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if "step" in self.optimizer.state.get(p, {}):
                    step = self.optimizer.state[p]["step"]
        if step is None:
            return out
        zeros = lambda piece: torch.zeros(piece.length)  # noqa: E731
        for k in range(len(self.chunks)):
            for key in ("exp_avg", "exp_avg_sq"):
                state = lambda piece, key=key: self.optimizer.state[piece.master][key] if piece.master in \
                    self.optimizer.state else zeros(piece)  # noqa: E731
                for name, t in self._gather_full(k, state).items():
                    out[f"{key}/{name}"] = t
            for slot in self.chunks[k].params:
                out[f"step/{slot.name}"] = step.detach().cpu().clone()
        return out

    def load(self, ckpt) -> None:
        """This worker's pieces of every parameter, and their AdamW state, from a checkpoint by name."""
        names = ckpt.names()
        with torch.no_grad():
            for pieces in self.pieces:
                for piece in pieces:
                    full = ckpt.get(piece.name).reshape(-1)
                    piece.master.copy_(full[piece.param_start: piece.param_start + piece.length])
                    if f"exp_avg/{piece.name}" in names:
                        sl = slice(piece.param_start, piece.param_start + piece.length)
                        self.optimizer.state[piece.master] = {
                            "step": ckpt.get(f"step/{piece.name}").clone(),
                            "exp_avg": ckpt.get(f"exp_avg/{piece.name}").reshape(-1)[sl].clone().to(piece.master.device),
                            "exp_avg_sq": ckpt.get(f"exp_avg_sq/{piece.name}").reshape(-1)[sl].clone().to(
                                piece.master.device)}
        self.compute_shards = [self._compute_shard(k) for k in range(len(self.chunks))]
