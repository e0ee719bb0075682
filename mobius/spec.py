"""Decide once: the device kind, the precision, the recompute decision, the per-device budgets and
the plan of a run are resolved here, before any worker starts, and handed to every worker (and
shown by ``mobius.plan``) as they are.  Nothing downstream picks a default of its own."""

from __future__ import annotations

from mobius import checkpoint as ck
from mobius.backend import resolve_topology
from mobius.config import RunConfig
from mobius.models import GPTConfig
from mobius.planner import Plan, make_plan
from mobius.runtime.device import cuda_available
from mobius.runtime.inputs import check_model_input, make_batches
from topology import Topology

GB = 10**9


def default_precision(on_gpus: bool) -> str:
    """bf16 where GPUs compute (every card we target has it), fp32 on CPU workers."""
    return "bf16" if on_gpus else "fp32"


def choose_recompute(cfg: RunConfig, budgets: list[int], make) -> bool:
    """``--recompute auto``: keep activations on the device when every worker can hold all of its
    stages' saved activations for all micro-batches beside its largest stage; else recompute."""
    if cfg.recompute != "auto":
        return cfg.recompute == "on"
    plan = make(recompute=False)
    for gpu in set(plan.order):
        mine = [plan.stages[s] for s in plan.stages_of_gpu(gpu)]
        kept = sum(st.mem_bwd_bytes - 2 * st.param_bytes for st in mine) * plan.micro_batches
        if max(st.mem_bwd_bytes for st in mine) + kept > budgets[gpu]:
            return True
    return False


def run_plan(cfg: RunConfig, model_config: GPTConfig, topo: Topology, precision: str, **plan_options) -> Plan:
    """The plan a run on ``topo`` executes, with its recompute decision: ``mobius.train`` and
    ``mobius.plan`` both call this, so the plan printed is the plan trained."""
    budgets = [int(g.memory_gb * GB) for g in topo.gpus]

    def make(recompute: bool) -> Plan:
        return make_plan(cfg.model, model_config, topo, cfg.micro_batch_size, cfg.micro_batches, cfg.seq_len,
                         precision, partitioner=cfg.partitioner, recompute=recompute, stages=cfg.stages,
                         **plan_options)

    return make(choose_recompute(cfg, budgets, make))


def prepare(cfg: RunConfig, topo: Topology | None = None) -> dict:
    """Everything the workers need, decided once, up front: device kind, precision, plan,
    per-device budgets (and ``cfg.precision`` resolved)."""
    model_config = check_model_input(cfg)
    topo = topo or resolve_topology(cfg)
    cuda = not topo.virtual and cuda_available()
    if not topo.virtual and not cuda:
        topo.virtual = True  # rehearsal: CPU workers stand in for the topology's GPUs
    cfg.precision = cfg.precision or default_precision(cuda)
    make_batches(cfg, model_config)  # data present and non-empty, before any worker starts
    if cfg.resume:
        ck.open_for_resume(cfg, model_config)
    plan = run_plan(cfg, model_config, topo, cfg.precision)
    return {"plan": plan.to_dict(), "budget_bytes": [int(g.memory_gb * GB) for g in topo.gpus], "cuda": cuda,
            "topology": topo, "plan_obj": plan}
