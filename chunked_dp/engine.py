"""The sharded chunk engine: data parallelism over chunks with an rCache (Elixir, PatrickStar).

Each worker keeps, per chunk, only its shard: an fp32 master shard with its gradient and AdamW
state, and the compute-dtype copy that a gather reads.  Offloaded chunks keep them in host memory
(the compute copy page-locked) and update on the CPU; device-resident chunks keep them on the
device and update there.  The model's parameters are views into rCache blocks:

* before a layer runs (forward or backward), each chunk it uses is gathered into a block (Belady
  replacement over the order recorded in the warm-up step, LRU during it).  An offloaded chunk's
  shard crosses PCIe on a copy stream of its own, started a layer ahead (prefetch) so it overlaps
  the current layer's compute; the all-gather between workers (NVLink's part) runs when the chunk
  is needed.  An evicted chunk needs no write-back: the master copy is elsewhere;
* a chunk's gradient is reduce-scattered once the last layer using it has run backward, in its
  block (the parameter memory is reused for it).  Offloaded chunks' shards leave on a device->host
  stream into page-locked staging; the optimizer thread adds them to the fp32 master gradient
  and, once the step's last gradient of the chunk is in, runs AdamW on the chunk and refreshes its
  compute copy, while the device goes on with backward (the pipeline's overlap, per chunk);
* a worker's micro-batches run layer by layer as one *pass* (every micro-batch's forward through
  a layer, then the next layer; backward likewise): a chunk is gathered for a layer once per pass,
  not once per micro-batch, and reduced once per pass.  Passes hold every layer's input of their
  micro-batches; ``group`` micro-batches per pass bounds that memory (the launcher picks it).

One step consumes M micro-batches split evenly across workers; each micro-batch's loss is its
share of the step's token mean (:mod:`mobius.models.layout`), so the summed gradient is the
reference trainer's.  Layers are recomputed in backward (activation checkpointing per layer): an
autograd graph kept from forward would hold views of rCache blocks that other chunks have since
overwritten.

Every allocation, copy and event goes through the device layer (:mod:`mobius.runtime.device`), so
on CPU workers the stream-order checker sees the chunked engine as it sees the pipeline, and
``--emulate`` times its copies on the emulated links and its compute at the emulated GPU's speed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from chunked_dp.cache import RCachePolicy
from chunked_dp.chunks import Chunk, chunks_of_layers, pack, trace_first_use
from mobius.data import BatchSource
from mobius.metrics import StepMetrics, Trace
from mobius.models import GPTConfig, LayerList, build_layer, build_model
from mobius.runtime.device import WITHIN_DEVICE, Device, Event
from mobius.runtime.optim import UpdateRule, adamw, clip_coefficient, set_lr, squares
from mobius.runtime.spec import Timing

# torch >= 2.13 renames the flat collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Piece:
    """The part of parameter ``name`` that falls in this worker's shard of a chunk."""

    name: str
    param_start: int  # first element within the parameter
    shard_start: int  # first element within the shard
    length: int
    decay: bool
    master: nn.Parameter  # fp32, a view of the chunk's master shard (host or device)


@dataclass
class Counters:
    gather_bytes: int = 0  # full chunks materialised by gathers (compute dtype)
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
                 rule: UpdateRule, trace: Trace | None = None, prefetch: bool = True,
                 group: int | None = None, timing: Timing | None = None):
        self.config, self.rank, self.world = config, rank, world
        self.dev, self.device = device, device.torch_device  # the device layer, and its torch device
        self.dtype, self.rule = compute_dtype, rule
        self.trace = trace or Trace(False)
        self.group, self.timing = group, timing
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
        self.nothing = device.nothing(compute_dtype)  # what an evicted parameter points at
        self.h2d = device.new_stream("h2d-chunks", "h2d")  # offloaded shards on their way to the device
        self.grads_out = device.new_stream("d2h-gradients", "d2h")
        self.host = device.host_stream("optimizer")  # what the optimizer thread does to host buffers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mobius-chunk-optimizer")
        self._build_shards(seed)
        self.model = self._skeleton()
        self.params = dict(self.model.named_parameters())
        self.blocks = [device.empty(self.chunks[0].size, compute_dtype, name=f"rCache block {b}")
                       for b in range(self.n_block)]
        self.cache = RCachePolicy(self.n_block, "belady")
        self.recorded: list[int] = []
        self.prefetch = prefetch
        # chunk -> its gather under way: ("copy", event, device shard) or ("gather", work, device shard)
        self.inflight: dict[int, tuple] = {}
        # Gradients on their way to the host: two page-locked staging buffers, used in turn; each
        # remembers when the optimizer thread last finished reading it (before that chunk's AdamW).
        offloaded = not all(self.on_device)
        self.staging = [device.host_buffer(self.shard, compute_dtype) for _ in range(2 if offloaded else 0)]
        self._staging_free: list[Future | None] = [None] * len(self.staging)
        self._next_staging = 0
        self._host_jobs: list[Future] = []  # this step's optimizer-thread jobs
        self._block_read_out: dict[int, Event] = {}  # block -> the copy of the gradient it holds to the host
        self._lr = rule.lr

    # ---- construction -----------------------------------------------------------------------
    def _build_shards(self, seed: int) -> None:
        """Per chunk: this worker's fp32 master shard and gradient (pieces of parameters as views
        of them), its AdamW, and the compute-dtype copy a gather reads."""
        host_model = build_model(self.config, seed=seed)  # full fp32 weights, as every worker would load them
        named = dict(host_model.named_parameters())
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        self.pieces: list[list[Piece]] = []
        self.master: list[torch.Tensor] = []
        self.master_grad: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer | None] = []
        for c in self.chunks:
            master, grad = self._zeros(c.index, torch.float32, "master"), self._zeros(c.index, torch.float32, "gradient")
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
            self.optimizers.append(adamw([{"params": decay, "weight_decay": self.rule.weight_decay},
                                          {"params": no_decay, "weight_decay": 0.0}], self.rule) if mine else None)
        self.compute_shards = []
        for k in range(len(self.chunks)):
            out = (self.dev.empty(self.shard, self.dtype, name=f"compute shard of chunk {k}") if self.on_device[k]
                   else self.dev.host_buffer(self.shard, self.dtype))
            out.copy_(self.master[k])
            self.compute_shards.append(out)

    def _zeros(self, k: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        if self.on_device[k]:
            return self.dev.empty(self.shard, dtype, name=f"{what} shard of chunk {k}").zero_()
        return torch.zeros(self.shard, dtype=dtype)

    def _skeleton(self) -> LayerList:
        """The model on the meta device, every parameter pointing at nothing until gathered."""
        layers = [build_layer(self.config, i, seed=0, device="meta") for i in range(len(self.layer_chunks))]
        model = LayerList(self.config, layers)
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.device.type == "meta":
                    module._parameters[name] = nn.Parameter(self.nothing)
        if self.config.tie_embeddings:
            model.layers[-1].lm_head.weight = model.layers[0].wte.weight
        return model

    # ---- the rCache -------------------------------------------------------------------------
    def _access(self, k: int) -> None:
        """Make chunk ``k`` resident and pin it."""
        self.recorded.append(k)
        hit, victim = self.cache.access(k)
        if victim is not None:
            self._release_views(victim)
        if k in self.inflight:  # prefetched: finish its gather
            self._finish_gather(k)
        elif not hit:
            self._start_gather(k)
            self._finish_gather(k)
        self.cache.pinned.add(k)

    def _start_gather(self, k: int, ahead: bool = False) -> None:
        """Begin gathering chunk ``k`` into its block.  An offloaded shard first crosses PCIe on
        the h2d stream (straight into the block when there is one worker); a device shard is
        all-gathered, asynchronously when ``ahead``."""
        b = self.cache.block_of(k)
        block = self.blocks[b]
        if b in self._block_read_out:  # its last gradient may still be leaving for the host
            (self.dev.compute if self.on_device[k] else self.h2d).wait(self._block_read_out.pop(b))
        self.counters.gather_bytes += block.numel() * block.element_size()
        self.counters.peer += self.shard * block.element_size() * (self.world - 1)
        if self.on_device[k] and self.world == 1:
            self.dev.compute.copy(block, self.compute_shards[k], name=f"rCache block of chunk {k}",
                                  direction=WITHIN_DEVICE)
            self.inflight[k] = ("copied", None, None)
        elif self.on_device[k]:
            work = _all_gather(block, self.compute_shards[k], async_op=ahead)
            self.inflight[k] = ("gather", work, None)
        else:
            self.counters.h2d += self.shard * block.element_size()
            target = block if self.world == 1 else self.dev.empty(self.shard, self.dtype, stream=self.h2d,
                                                                    name=f"shard of chunk {k}")
            self.h2d.wait(self.dev.compute.record())  # the block's previous chunk is done with
            begin = self.h2d.record() if self.trace.enabled else None
            self.h2d.copy(target, self.compute_shards[k], name=f"gathered shard of chunk {k}")
            arrived = self.h2d.record()
            if begin is not None:
                self.trace.device_span(f"chunk {k} to device", "h2d", begin, arrived, self.dev.time_of,
                                       bytes=self.shard * block.element_size())
            self.inflight[k] = ("copy", arrived, target)

    def _finish_gather(self, k: int) -> None:
        kind, handle, shard = self.inflight.pop(k)
        t0 = time.perf_counter()
        block = self.blocks[self.cache.block_of(k)]
        if kind == "gather":
            if handle is not None:
                handle.wait()
        elif kind == "copy":
            self.dev.compute.wait(handle)
            if self.world > 1:
                _all_gather(block, shard)
        self.dev.compute.reads(block)
        self._set_views(k)
        if self.world > 1:
            self.trace.span(f"gather chunk {k}", "gather", t0, time.perf_counter())

    def _set_views(self, k: int) -> None:
        block = self.blocks[self.cache.block_of(k)]
        for slot in self.chunks[k].params:
            self.params[slot.name].data = block[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def _prefetch(self, layer: int) -> None:
        """Start gathering ``layer``'s chunks while the current layer computes.  Every worker decides
        identically, so collectives stay in the same order everywhere."""
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
            self._start_gather(k, ahead=True)
            self.counters.prefetched += 1

    def _release_views(self, k: int) -> None:
        """Eviction: no write-back (the master copy is elsewhere); gradients stay in ``.grad``."""
        for slot in self.chunks[k].params:
            self.params[slot.name].data = self.nothing

    # ---- gradients and updates ----------------------------------------------------------------
    def _reduce(self, k: int, last: bool) -> None:
        """All of chunk ``k``'s users have run backward in this pass: its gradients (in its block,
        reusing the parameter memory) are reduce-scattered and added to the fp32 master gradient;
        after the step's ``last`` pass, AdamW updates the chunk."""
        t0 = time.perf_counter()
        c = self.chunks[k]
        block = self.cache.resident.get(k)
        if block is not None:
            flat = self.blocks[block]
            self._release_views(k)
            self.cache.resident.pop(k)
        else:
            flat = self.dev.empty(c.size, self.dtype, name=f"gradient of chunk {k}")
        flat.zero_()
        for slot in c.params:
            p = self.params[slot.name]
            if p.grad is not None:
                flat[slot.offset: slot.offset + slot.numel] = p.grad.reshape(-1)
                p.grad = None
        if self.world == 1:
            mine = flat
        else:
            mine = self.dev.empty(self.shard, self.dtype, name=f"gradient shard of chunk {k}")
            _reduce_scatter(mine, flat)
            self.trace.span(f"reduce chunk {k}", "reduce", t0, time.perf_counter())
        self.counters.reduce_bytes += flat.numel() * flat.element_size()
        self.counters.peer += mine.numel() * mine.element_size() * (self.world - 1)
        if self.on_device[k]:
            self.master_grad[k].add_(mine)
            if last and not self.rule.max_grad_norm:
                self._update(k, self.dev.compute)
            return
        # Offloaded: the shard goes home on its own stream; the optimizer thread takes it from there.
        self.counters.d2h += mine.numel() * mine.element_size()
        slot = self._next_staging
        self._next_staging = 1 - slot
        if self._staging_free[slot] is not None:  # its previous gradient must have been added first
            self.grads_out.wait(self._staging_free[slot].result())
        self.grads_out.wait(self.dev.compute.record())
        begin = self.grads_out.record() if self.trace.enabled else None
        self.grads_out.copy(self.staging[slot], mine, name=f"gradient staging {slot}")
        arrived = self.grads_out.record()
        if begin is not None:
            self.trace.device_span(f"gradient of chunk {k} to host", "d2h", begin, arrived, self.dev.time_of,
                                   bytes=mine.numel() * mine.element_size())
        if block is not None and mine is flat:  # the block's next gather must wait for this copy
            self._block_read_out[block] = arrived
        freed: Future = Future()
        self._staging_free[slot] = freed
        self._host_jobs.append(self._pool.submit(self._gradient_home, k, slot, arrived, last, freed))

    def _gradient_home(self, k: int, slot: int, arrived: Event, last: bool, freed: Future) -> Event:
        """On the optimizer thread: add the staged gradient to the master gradient and hand the
        staging buffer back (``freed``), so that the next gradient's copy home and the backward
        that issues it do not wait for this chunk's AdamW; after the step's last pass, update the
        chunk."""
        try:
            self.host.wait(arrived)
            t0 = time.perf_counter()
            self.host.reads(self.staging[slot])
            self.master_grad[k].add_(self.staging[slot])
            self.trace.span(f"gradient of chunk {k} into fp32", "optimizer", t0, time.perf_counter())
            freed.set_result(self.host.record())
        except BaseException as err:  # whoever waits for the buffer must not wait forever
            freed.set_exception(err)
            raise
        if last and not self.rule.max_grad_norm:
            self._update(k, self.host)
        return self.host.record()

    def _update(self, k: int, stream) -> None:
        """AdamW on chunk ``k``'s shard (on ``stream``: the compute stream for a device chunk, the
        optimizer thread for an offloaded one), then the compute copy the next gather reads."""
        t0 = time.perf_counter()
        optimizer = self.optimizers[k]
        if optimizer is not None:
            set_lr(optimizer, self._lr)
            if self.on_device[k]:
                rate = 0.0 if self.timing is None else self.timing.device_adam_params_per_s
                span = self.dev.compute_span(self.shard / rate if rate else 0.0)
            else:  # an emulated host takes its own rate's time, whatever the plan assumed
                span = self.dev.host_update_span(self.shard)
            with span:
                optimizer.step()
            self.master_grad[k].zero_()
        stream.writes(self.compute_shards[k], name=f"compute shard of chunk {k}")
        self.compute_shards[k].copy_(self.master[k])
        self.trace.span(f"AdamW chunk {k}", "optimizer" if stream is self.host else "compute", t0, time.perf_counter())

    # ---- one step -----------------------------------------------------------------------------
    def _layer(self, i: int, backward: bool, n: int):
        """The compute of layer ``i`` for ``n`` micro-batches: emulated at the GPU's time under
        ``--emulate``, traced on the compute lane."""
        emulated = 0.0
        if self.timing is not None:
            fwd, bwd = self.timing.layer_s[i]
            emulated = n * (fwd + bwd if backward else fwd)  # backward recomputes the forward
        return _Traced(self, f"{'B' if backward else 'F'}{i}", emulated)

    def step(self, step: int, batches: BatchSource) -> StepMetrics:
        t0 = time.perf_counter()
        self.counters.reset()
        micro = batches.step(step)
        M = len(micro)
        mine = micro[self.rank * M // self.world: (self.rank + 1) * M // self.world]
        self._lr = self.rule.lr_at(step)
        self.cache.new_step()
        self.recorded = []
        group = self.group or len(mine)
        passes = [mine[a: a + group] for a in range(0, len(mine), group)]
        losses = []
        for p, batch in enumerate(passes):
            losses += self._pass(batch, last=p == len(passes) - 1)
        # The order just recorded is every later step's future: Belady from now on.
        if not self.cache.future_known:
            self.cache.set_future(self.recorded)
        for k in list(self.inflight):
            self._finish_gather(k)
        grad_norm = self._clipped_updates() if self.rule.max_grad_norm else None
        for job in self._host_jobs:  # the next step's gathers read the updated compute copies
            self.dev.compute.wait(job.result())
        self._host_jobs.clear()
        for k in list(self.cache.resident):
            self._release_views(k)
        self.cache.drop_all()
        stats = torch.tensor([sum(float(x) for x in losses), self.counters.h2d, self.counters.d2h,
                              self.counters.peer], dtype=torch.float64)
        dist.all_reduce(stats)
        tokens = M * micro[0].tokens.numel()
        block_bytes = self.n_block * self.chunks[0].size * self.blocks[0].element_size()
        return StepMetrics(step=step, loss=stats[0].item(), lr=self._lr, tokens=tokens,
                           step_time_s=time.perf_counter() - t0, h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]),
                           peer_bytes=int(stats[3]), peak_device_bytes=block_bytes, grad_norm=grad_norm)

    def _clipped_updates(self) -> float:
        """Clipping: every chunk's update waits for the step's global gradient norm (the sum of
        every rank's shards' squares); then each chunk is updated with its gradient scaled, device
        chunks on the compute stream, offloaded ones on the optimizer thread.  Returns the norm."""
        for job in self._host_jobs:  # every offloaded gradient is home
            self.dev.compute.wait(job.result())
        self._host_jobs.clear()
        total = torch.tensor([squares(self.master_grad)], dtype=torch.float64)
        dist.all_reduce(total)
        clip = clip_coefficient(total.item(), self.rule.max_grad_norm)
        for k in range(len(self.chunks)):
            if self.on_device[k]:
                self._scaled_update(k, clip, self.dev.compute)
            else:
                self._host_jobs.append(self._pool.submit(self._scaled_update, k, clip, self.host))
        return total.item() ** 0.5

    def _scaled_update(self, k: int, clip: float, stream) -> Event:
        if clip < 1.0:
            self.master_grad[k].mul_(clip)
        self._update(k, stream)
        return stream.record()

    def _pass(self, batch: list, last: bool) -> list[torch.Tensor]:
        """Forward and backward of ``batch`` (micro-batches) layer by layer; returns their losses."""
        layers = self.model.layers
        xs = [mb.tokens.to(self.device) for mb in batch]
        layouts = [mb.layout.to(self.device) for mb in batch]
        inputs: list[list[torch.Tensor]] = []
        # Forward without autograd: a graph would hold views of rCache blocks that get reused.
        with torch.no_grad():
            for i, layer in enumerate(layers):
                for k in self.layer_chunks[i]:
                    self._access(k)
                self._prefetch(i + 1)
                inputs.append(xs)
                with self._layer(i, False, len(batch)):
                    xs = [layer(x, layout) for x, layout in zip(xs, layouts)]
                for k in self.layer_chunks[i]:
                    self.cache.pinned.discard(k)
        losses = xs
        pending = {c.index: len(c.layers) for c in self.chunks}
        grads: list[torch.Tensor | None] = [None] * len(batch)
        # Backward layer by layer, recomputing each layer's forward (activation checkpointing).
        for i in range(len(layers) - 1, -1, -1):
            layer = layers[i]
            for k in self.layer_chunks[i]:
                self._access(k)
            self._prefetch(i - 1)
            with self._layer(i, True, len(batch)):
                for j, (x_in, layout) in enumerate(zip(inputs.pop(), layouts)):
                    x_in = x_in.detach()
                    x_in.requires_grad_(x_in.is_floating_point())
                    y = layer(x_in, layout)
                    # the loss is already this micro-batch's share of the step's mean
                    y.backward() if grads[j] is None else y.backward(grads[j])
                    grads[j] = x_in.grad
            for k in self.layer_chunks[i]:
                self.cache.pinned.discard(k)
                pending[k] -= 1
                if pending[k] == 0:
                    self._reduce(k, last)
        return losses

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
                            self.cache.pinned.discard(c)
                total += x.item()
        for c in list(self.inflight):
            self._finish_gather(c)
        for c in list(self.cache.resident):
            self._release_views(c)
        self.cache.drop_all()
        stats = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(stats)
        return stats.item()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.h2d.synchronize()
        self.grads_out.synchronize()

    # ---- checkpoints --------------------------------------------------------------------------
    def _gather_full(self, k: int, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """All-gather an fp32 shard of chunk ``k`` into full tensors by name (host copies)."""
        mine = self.dev.empty(self.shard, torch.float32, name=f"fp32 shard of chunk {k}")
        mine.copy_(shard)
        full = self.dev.empty(self.chunks[k].size, torch.float32, name=f"fp32 chunk {k}")
        _all_gather(full, mine)
        return {slot.name: full[slot.offset: slot.offset + slot.numel].view(slot.shape).cpu().clone()
                for slot in self.chunks[k].params}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights by name (all-gathered; for tests and checkpoints)."""
        out = {}
        for k in range(len(self.chunks)):
            out.update(self._gather_full(k, self.master[k]))
        return out

    def _adam_shard(self, k: int, key: str) -> torch.Tensor:
        """AdamW's ``key`` state of chunk ``k``'s shard as one flat tensor (zeros where none)."""
        out = torch.zeros(self.shard, dtype=torch.float32, device=self.master[k].device)
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
                for name, t in self._gather_full(k, self._adam_shard(k, key)).items():
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
                self.compute_shards[k].copy_(self.master[k])


class _Traced:
    """One layer's compute over a pass: at least its emulated time, a span on the compute lane."""

    def __init__(self, engine: ChunkedEngine, name: str, emulated_s: float):
        self.engine, self.name, self.emulated_s = engine, name, emulated_s

    def __enter__(self):
        self.span = self.engine.dev.compute_span(self.emulated_s)
        self.span.__enter__()
        self.begin = self.engine.dev.compute.record() if self.engine.trace.enabled else None
        return self

    def __exit__(self, *exc):
        if self.begin is not None:
            self.engine.trace.device_span(self.name, "compute", self.begin, self.engine.dev.compute.record(),
                                          self.engine.dev.time_of)
        return self.span.__exit__(*exc)
