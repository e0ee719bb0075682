"""The Mobius schedule of one worker, as data (Mobius §3.1, Fig. 4).

:func:`worker_ops` is a pure function from the plan's shape to the ordered operations one worker
performs in an optimizer step, in the spirit of torchgpipe's ``clock_cycles``;
:class:`mobius.stages.executor.StageRunner` executes them with the device layer and a transport,
and the simulator replays them as its tasks (:func:`mobius.sim.schedules.simulate_mobius`), so the
step a bound plan predicts is the order that runs.
The rules it encodes:

* forward, stage by stage in order: wait until the stage is resident, start loading the worker's
  next stage, then run *every* micro-batch while the stage is resident (receive its input, compute,
  send its output), end the stage's pass, then evict it, except the worker's last stage, which
  backward needs first;
* the model's last stage (the head and its loss) runs forward and backward together, one
  micro-batch after the other: each micro-batch's input gradient leaves as soon as it exists, so
  the previous stage's worker starts its backward while the head computes the next micro-batch
  (1F1B where nothing is gained by waiting: the loss is the only thing the head's backward needs),
  and the head is never recomputed;
* backward, the same in reverse order (with recomputation, each micro-batch's forward is redone
  before its output gradient is awaited, except in the stages the plan lets keep their
  activations); after a stage's last micro-batch its gradients leave for the host (and AdamW),
  then the stage is evicted;
* a stage the plan keeps *resident* is loaded once and never evicted: after its backward it is
  updated on the device (``update``) instead of offloading its gradients.

Loads carry the transfer priority of the mapping (the stage that executes earlier goes first).
"""

from __future__ import annotations

from dataclasses import dataclass

from mobius.mapping import transfer_priority

LOAD, WAIT, RECV, RECOMPUTE, COMPUTE, SEND, END, OFFLOAD, UPDATE, RELEASE = (
    "load", "wait", "recv", "recompute", "compute", "send", "end", "offload", "update", "release")


@dataclass(frozen=True)
class Op:
    kind: str  # one of the constants above
    stage: int
    mb: int = -1  # micro-batch (RECV, RECOMPUTE, COMPUTE, SEND)
    backward: bool = False  # of the backward pass (RECV of an output gradient, SEND of an input gradient)
    priority: int = 0  # LOAD: lower goes first
    recompute: bool = False  # forward COMPUTE keeps only its input (on the host) for a RECOMPUTE

    def __str__(self) -> str:
        pass_ = "B" if self.backward else "F"
        if self.mb >= 0:
            return f"{self.kind} {pass_}{self.stage}.{self.mb}"
        return f"{self.kind} {pass_}{self.stage}"


def worker_ops(n_stages: int, stages_of_worker: list[int], micro_batches: int, recompute: bool,
               prefetch: bool = True, forward_only: bool = False,
               resident: frozenset[int] = frozenset(), kept: frozenset[int] = frozenset()) -> list[Op]:
    """The ordered operations of one worker in one step; ``stages_of_worker`` in pipeline order.
    Without ``prefetch`` a stage's load is issued only once the previous stage is released.
    ``forward_only`` (evaluation): the forward pass without autograd, every stage released after it.
    ``resident``: stages that stay on the device (their load is a no-op once they are there).
    ``kept``: with ``recompute``, stages that keep their activations instead."""
    mine = list(stages_of_worker)
    last = n_stages - 1
    ops: list[Op] = [Op(LOAD, mine[0], priority=0)] if mine else []

    def load_next(k: int, stages: list[int], backward: bool, after_release: bool) -> None:
        if k + 1 < len(stages) and after_release != prefetch:
            ops.append(Op(LOAD, stages[k + 1], backward=backward,
                          priority=transfer_priority(stages[k + 1], n_stages, "backward" if backward else "forward")))

    for k, s in enumerate(mine):
        if s == last and not forward_only:
            break  # the head's forward runs with its backward, below
        ops.append(Op(WAIT, s))
        load_next(k, mine, False, after_release=False)
        for m in range(micro_batches):
            if s > 0:
                ops.append(Op(RECV, s, m))
            ops.append(Op(COMPUTE, s, m, recompute=recompute and s not in kept))
            if s < last:
                ops.append(Op(SEND, s, m))
        ops.append(Op(END, s))
        if (k + 1 < len(mine) or forward_only) and s not in resident:
            ops.append(Op(RELEASE, s))
        load_next(k, mine, False, after_release=True)
    if forward_only:
        return ops
    reverse = mine[::-1]
    for k, s in enumerate(reverse):
        ops.append(Op(WAIT, s, backward=True))
        load_next(k, reverse, True, after_release=False)
        for m in range(micro_batches):
            if s == last:  # forward and backward of one micro-batch, its input gradient sent at once
                if s > 0:
                    ops.append(Op(RECV, s, m))
                ops.append(Op(COMPUTE, s, m))
                ops.append(Op(COMPUTE, s, m, backward=True))
                if s > 0:
                    ops.append(Op(SEND, s, m, backward=True))
                continue
            if recompute and s not in kept:  # before the output gradient is awaited: it overlaps its arrival
                ops.append(Op(RECOMPUTE, s, m, backward=True))
            if s < last:
                ops.append(Op(RECV, s, m, backward=True))
            ops.append(Op(COMPUTE, s, m, backward=True))
            if s > 0:
                ops.append(Op(SEND, s, m, backward=True))
        ops.append(Op(END, s, backward=True))
        if s in resident:
            ops.append(Op(UPDATE, s, backward=True))
        else:
            ops.append(Op(OFFLOAD, s, backward=True))
            ops.append(Op(RELEASE, s, backward=True))
        load_next(k, reverse, True, after_release=True)
    return ops
