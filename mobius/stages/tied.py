"""Tied input/output embeddings across stages (GPT-2, and Llama/Qwen models that tie them).

Stage 0 (the token table) and the last stage (the LM head) each hold a copy of the tied matrix.
Before either copy is updated their gradients are summed, in the same order on both holders
(embedding + head), so both apply bit-identical updates and the copies stay equal, as the one
shared parameter of the single-device reference does.
"""

from __future__ import annotations

import torch
from torch import nn

from mobius.runtime.spec import Plan
from mobius.stages.transport import Transport
from mobius.swap.memory import Traffic
from mobius.swap.store import HostStageStore


def sum_copies(embedding: nn.Parameter, head: nn.Parameter) -> None:
    """Both copies of a tied table held in one process get the sum of their gradients, embedding +
    head (that order on every holder: both copies then take bit-identical updates)."""
    total = embedding.grad + head.grad
    embedding.grad, head.grad = total, total.clone()


class TiedEmbedding:
    def __init__(self, store: HostStageStore, plan: Plan, transport: Transport, traffic: Traffic):
        self.store, self.plan, self.transport, self.traffic = store, plan, transport, traffic
        n_stages = len(plan.bounds)
        self.last = n_stages - 1
        # Stages whose update waits for the sum (none when the model does not tie, or under LoRA,
        # which freezes the table).
        trains = store.config.tie_embeddings and not store.config.lora_rank
        self.stages: set[int] = {0, self.last} if trains else set()
        self._tag = n_stages * plan.micro_batches * 2  # above every activation message's tag

    def _copies(self) -> dict[str, nn.Parameter]:
        """This worker's copies of the tied table: {"embedding": ..., "head": ...} (those it holds)."""
        n_layers = self.plan.bounds[-1][1]
        wanted = {"embedding": (0, "layers.0.wte.weight"), "head": (self.last, f"layers.{n_layers - 1}.lm_head.weight")}
        out = {}
        for role, (s, name) in wanted.items():
            if s in self.store.stages:
                host = self.store.stages[s]
                out[role] = dict(host.trained())[name]
        return out

    def head_copy(self) -> nn.Parameter | None:
        """The head's copy of the tied table where this worker holds it and it trains: its gradient
        (after :meth:`sum_gradients`) is the embedding's again, so a norm counts only one of them."""
        return self._copies().get("head") if self.stages else None

    def sum_gradients(self) -> None:
        """grad(embedding copy) + grad(head copy) into both copies' ``.grad``."""
        if not self.stages:
            return
        mine = self._copies()
        if len(mine) == 2:  # this worker holds both copies
            sum_copies(mine["embedding"], mine["head"])
            return
        if not mine:
            return
        (role, param), = mine.items()
        other_stage = self.last if role == "embedding" else 0
        other_rank = self.plan.gpu_of_stage(other_stage)
        other = torch.empty_like(param.grad)
        work = self.transport.isend(param.grad.contiguous(), other_rank, self._tag)
        self.transport.recv(other, other_rank, self._tag)
        work.wait()
        self.traffic.peer += param.grad.numel() * param.grad.element_size()
        param.grad = param.grad + other if role == "embedding" else other + param.grad
