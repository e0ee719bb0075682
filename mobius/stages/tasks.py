"""The dispatched schedule as data: every task of a step and the GPU that runs it, after RoundPipe
(Luo et al. 2026).  :mod:`mobius.sim.dispatched` predicts it and :mod:`mobius.stages.dispatch`
runs it, both from :func:`step_tasks`, so the schedule the plan chose is the one that runs.

A step is a chain of *tasks*: the forward of each forward stage, then the backward of each backward
stage, last to first.  Forward and backward have partitions of their own (a backward with
recomputation costs about three forwards, so its stages hold about a third of the layers).  Tasks
go to the GPUs in turn (the cross mapping's order), all micro-batches of a task while its weights
are there.  Two exceptions:

* the last forward stage holds the head, and each micro-batch's backward of the last backward stage
  (which lies within it) runs right after its forward: the *head's task*, whose micro-batches are
  split over ``head_gpus`` GPUs in turn (``H.<part>``);
* the ``kept`` forward stages before it are backward stages too, and each one's backward runs on the
  GPU that ran its forward, from the activations that forward kept there (out of turn, no
  recomputation); a ``resident`` one runs on the same GPU every step (out of turn), which keeps its
  weights and AdamW state and updates it there.

The turn goes on from one step to the next, so with ``--optimizer-lag 1`` the next step's first
tasks start on the GPUs that are free while this step's last tasks run elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from mobius.runtime.spec import DispatchedShape, valid_partitions

__all__ = ["DispatchedShape", "Task", "pieces", "step_tasks", "tasks_in_turn", "valid_partitions"]


@dataclass(frozen=True)
class Task:
    name: str  # F<j>, H.<part> (the last forward stage with the head's backward), B<k>
    kind: str  # F | H | B
    stage: int  # its index in its partition
    gpu: int
    micro_batches: tuple[int, ...]  # numbered across steps
    step: int
    keeps: bool = False  # a forward that keeps its activations for its backward, on its GPU
    recomputes: bool = True  # a backward that recomputes its forward


def step_tasks(forward, backward, kept: int, head_gpus: int, order: list[int], micro_batches: int,
               steps: int = 1, first_step: int = 0, resident=()) -> list[Task]:
    """Every task of ``steps`` steps from ``first_step`` in the order they are issued.  The turn
    goes on from one step to the next (it starts at ``first_step``'s place in it); a kept stage's
    backward goes to the GPU of its forward, out of turn, and a ``resident`` stage's forward
    (``(forward stage, GPU)`` pairs) to its GPU."""
    n = len(order)
    pinned = dict(resident)
    turn = count(first_step * tasks_in_turn(forward, backward, kept, head_gpus, len(pinned)))
    tasks = []
    for step in range(first_step, first_step + steps):
        first = step * micro_batches
        every = tuple(range(first, first + micro_batches))
        ran_on = {}
        for j in range(len(forward) - 1):
            keeps = j >= len(forward) - 1 - kept
            gpu = pinned[j] if j in pinned else order[next(turn) % n]
            tasks.append(Task(f"F{j}", "F", j, gpu, every, step, keeps=keeps))
            ran_on[forward[j]] = tasks[-1].gpu
        for part in range(head_gpus):
            tasks.append(Task(f"H.{part}", "H", len(forward) - 1, order[next(turn) % n], every[part::head_gpus], step))
        for k in range(len(backward) - 2, -1, -1):
            if k >= len(backward) - 1 - kept:
                tasks.append(Task(f"B{k}", "B", k, ran_on[backward[k]], every, step, recomputes=False))
            else:
                tasks.append(Task(f"B{k}", "B", k, order[next(turn) % n], every, step))
    return tasks


def tasks_in_turn(forward, backward, kept: int, head_gpus: int, resident: int = 0) -> int:
    """How many of a step's tasks take their GPU in turn (all but the kept stages' backwards and
    the ``resident`` stages' forwards)."""
    return len(forward) - 1 + head_gpus + len(backward) - 1 - kept - resident


def pieces(forward: list[tuple[int, int]], backward: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The layers cut wherever either partition cuts them: each task's weights are whole pieces,
    so the host keeps (and updates) the weights piece by piece."""
    cuts = sorted({lo for lo, _ in forward} | {lo for lo, _ in backward} | {forward[-1][1]})
    return list(zip(cuts, cuts[1:]))
