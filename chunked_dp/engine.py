"""The sharded chunk engine: data parallelism over chunks with an rCache (Elixir, PatrickStar).

Each worker keeps, per chunk, only its shard (:mod:`chunked_dp.shards`); the model's parameters
are views into rCache blocks, gathered before a layer runs (:mod:`chunked_dp.gathers`); a chunk's
gradient is reduce-scattered once the last layer using it has run backward and its shard is
updated where it lives (:mod:`chunked_dp.reduction`).  This module runs the step:

* a worker's micro-batches run layer by layer as one *pass* (every micro-batch's forward through
  a layer, then the next layer; backward likewise): a chunk is gathered for a layer once per pass,
  not once per micro-batch, and reduced once per pass.  Passes hold every layer's input of their
  micro-batches; ``group`` micro-batches per pass bounds that memory (the launcher picks it).
  Evaluation runs the same forward loop.

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

import torch
import torch.distributed as dist
from torch import nn

from chunked_dp.chunks import chunks_of_layers, pack, trace_first_use
from chunked_dp.gathers import Counters, Gathers
from chunked_dp.reduction import Reduction
from chunked_dp.shards import Shards
from mobius.data import BatchSource
from mobius.data.preference import evaluation_of, held_out_sums
from mobius.metrics import Evaluation, StepMetrics, Trace
from mobius.models import GPTConfig, LayerList, build_layer
from mobius.models.preference import metric_sums, step_metrics
from mobius.runtime.device import Device
from mobius.runtime.optim import UpdateRule
from mobius.runtime.spec import Timing


class ChunkedEngine:
    def __init__(self, config: GPTConfig, rank: int, world: int, device: Device, chunk_size: int,
                 n_block: int, offload: bool, device_chunks: int, compute_dtype: torch.dtype, seed: int,
                 rule: UpdateRule, trace: Trace | None = None, prefetch: bool = True,
                 group: int | None = None, timing: Timing | None = None):
        self.config, self.rank, self.world, self.dev = config, rank, world, device
        self.rule, self.trace, self.group, self.timing = rule, trace or Trace(False), group, timing
        self.counters = Counters()
        use = trace_first_use(config)
        self.chunks = pack(use, chunk_size, world)
        self.layer_chunks = chunks_of_layers(self.chunks, use)
        n_block = max(1, min(n_block, len(self.chunks)))
        if n_block < max(len(cs) for cs in self.layer_chunks):
            raise ValueError(f"the rCache needs at least {max(len(cs) for cs in self.layer_chunks)} blocks "
                             f"(one layer's chunks), got {n_block}")
        # Offload: chunks beyond the first ``device_chunks`` live (master, AdamW) in host memory.
        on_device = [not offload or c.index < device_chunks for c in self.chunks]
        self.shards = Shards(config, self.chunks, rank, world, device, on_device, compute_dtype, rule, seed,
                             self.trace, timing)
        self.nothing = device.nothing(compute_dtype)  # what an evicted parameter points at
        self.model = self._skeleton()
        params = dict(self.model.named_parameters())
        self.gathers = Gathers(self.chunks, self.layer_chunks, n_block, self.shards, device, params, self.nothing,
                               self.counters, self.trace, prefetch)
        self.reduction = Reduction(self.chunks, self.shards, self.gathers, device, params, self.counters,
                                   self.trace, rule)

    @property
    def shard(self) -> int:
        """Elements of each chunk a worker holds."""
        return self.shards.size

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

    def _layer(self, i: int, backward: bool, n: int):
        """The compute of layer ``i`` for ``n`` micro-batches: emulated at the GPU's time under
        ``--emulate``, traced on the compute lane."""
        emulated = 0.0
        if self.timing is not None:
            fwd, bwd = self.timing.layer_s[i]
            emulated = n * (fwd + bwd if backward else fwd)  # backward recomputes the forward
        return _Traced(self, f"{'B' if backward else 'F'}{i}", emulated)

    def _mine(self, micro: list) -> list:
        """This worker's share of a step's (or an evaluation pass's) micro-batches."""
        M = len(micro)
        return micro[self.rank * M // self.world: (self.rank + 1) * M // self.world]

    def step(self, step: int, batches: BatchSource) -> StepMetrics:
        t0 = time.perf_counter()
        self.counters.reset()
        micro = batches.step(step)
        mine = self._mine(micro)
        self.reduction.lr = self.rule.lr_at(step)
        self.gathers.new_step()
        group = self.group or len(mine)
        passes = [mine[a: a + group] for a in range(0, len(mine), group)]
        losses = []
        for p, batch in enumerate(passes):
            losses += self._pass(batch, last=p == len(passes) - 1)
        self.gathers.learn_order()
        self.gathers.settle()
        grad_norm = self.reduction.clipped_updates() if self.rule.max_grad_norm else None
        self.reduction.wait_host_jobs()  # the next step's gathers read the updated compute copies
        self.gathers.drop_all()
        pairs = micro[0].layout.pairs
        stats = torch.cat([torch.tensor([sum(float(x) for x in losses), self.counters.h2d, self.counters.d2h,
                                         self.counters.peer], dtype=torch.float64),
                           metric_sums(mine) if pairs is not None else torch.zeros(0, dtype=torch.float64)])
        dist.all_reduce(stats)  # the loss (and a preference run's metrics) over the workers' shares
        blocks = self.gathers.blocks
        return StepMetrics(step=step, loss=stats[0].item(), lr=self.reduction.lr,
                           tokens=batches.step_tokens(step), step_time_s=time.perf_counter() - t0,
                           h2d_bytes=int(stats[1]), d2h_bytes=int(stats[2]), peer_bytes=int(stats[3]),
                           peak_device_bytes=len(blocks) * blocks[0].numel() * blocks[0].element_size(),
                           grad_norm=grad_norm,
                           preference=None if pairs is None else step_metrics(stats[4:], pairs.step_pairs))

    def _forward(self, batch: list, inputs: list | None = None) -> list[torch.Tensor]:
        """``batch``'s micro-batches forward layer by layer, without autograd (a graph would hold
        views of rCache blocks that get reused); each layer's inputs kept in ``inputs`` for the
        backward, where given.  Returns the micro-batches' losses."""
        xs = [mb.tokens.to(self.dev.torch_device) for mb in batch]
        layouts = [mb.layout.to(self.dev.torch_device) for mb in batch]
        with torch.no_grad():
            for i, layer in enumerate(self.model.layers):
                for k in self.layer_chunks[i]:
                    self.gathers.access(k)
                self.gathers.prefetch(i + 1)
                if inputs is not None:
                    inputs.append(xs)
                with self._layer(i, False, len(batch)):
                    xs = [layer(x, layout) for x, layout in zip(xs, layouts)]
                for k in self.layer_chunks[i]:
                    self.gathers.unpin(k)
        return xs

    def _pass(self, batch: list, last: bool) -> list[torch.Tensor]:
        """Forward and backward of ``batch`` (micro-batches) layer by layer; returns their losses."""
        inputs: list[list[torch.Tensor]] = []
        losses = self._forward(batch, inputs)
        layouts = [mb.layout.to(self.dev.torch_device) for mb in batch]
        pending = {c.index: len(c.layers) for c in self.chunks}
        grads: list[torch.Tensor | None] = [None] * len(batch)
        # Backward layer by layer, recomputing each layer's forward (activation checkpointing).
        for i in range(len(self.model.layers) - 1, -1, -1):
            layer = self.model.layers[i]
            for k in self.layer_chunks[i]:
                self.gathers.access(k)
            self.gathers.prefetch(i - 1)
            with self._layer(i, True, len(batch)):
                for j, (x_in, layout) in enumerate(zip(inputs.pop(), layouts)):
                    x_in = x_in.detach()
                    x_in.requires_grad_(x_in.is_floating_point())
                    y = layer(x_in, layout)
                    # the loss is already this micro-batch's share of the step's mean
                    y.backward() if grads[j] is None else y.backward(grads[j])
                    grads[j] = x_in.grad
            for k in self.layer_chunks[i]:
                self.gathers.unpin(k)
                pending[k] -= 1
                if pending[k] == 0:
                    self.reduction.reduce(k, last)
        return losses

    def evaluate(self, held_out) -> Evaluation:
        """Loss on held-out examples: each worker runs its share of every pass's micro-batches
        forward, gathering chunks as in training; the sum over workers."""
        total = sum(self.forward_only(held_out.pass_batches(k)) for k in range(held_out.passes))
        stats = torch.tensor([total, *held_out_sums(held_out)], dtype=torch.float64)
        dist.all_reduce(stats)
        return evaluation_of(stats.tolist(), held_out)

    def forward_only(self, micro: list) -> float:
        """This worker's share of ``micro`` forward, no autograd; the sum of its losses."""
        self.gathers.new_step()
        total = sum(x.item() for x in self._forward(self._mine(micro)))
        self.gathers.drop_all()
        return total

    def close(self) -> None:
        self.reduction.close()
        self.gathers.h2d.synchronize()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shards.state_dict()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.shards.optimizer_state()

    def load(self, ckpt) -> None:
        self.shards.load(ckpt)


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
