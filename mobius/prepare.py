"""Decide once: the topology, the backend, the device kind, the precision, the recompute decision,
the per-device budgets and the plan (or the chunked configuration) of a run are resolved here,
before any worker starts, into a frozen :class:`RunSpec` handed to every worker (and shown by
``mobius.plan``) as it is.  Nothing downstream picks a default of its own."""

from __future__ import annotations

import copy
import math
import os

from mobius.config import RunConfig
from mobius.errors import InputError
from mobius.models import GPTConfig
from mobius.partition.cost import stage_costs
from mobius.planner import DoesNotFit, get_profile, make_plan
from mobius.precision import default_precision
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import CUDA_RESERVE_BYTES, cuda_available
from mobius.runtime.emulation import EmulationSpec
from mobius.runtime.spec import Plan, RunSpec
from topology import Topology, TopologyError, cpu_topology, load_topology, network_of

GB = 10**9


def resolve_topology(cfg: RunConfig) -> Topology:
    try:
        topo = load_topology(cfg.topology, cpu_workers=cfg.cpu_workers, memory_gb=cfg.gpu_mem_gb)
    except TopologyError as err:
        raise InputError(str(err)) from None
    if cfg.gpu_mem_gb is not None:
        for g in topo.gpus:
            g.memory_gb = min(g.memory_gb, cfg.gpu_mem_gb)
    if cfg.host_adam_gbps is not None:
        topo.host_memory_bandwidth_gbps = cfg.host_adam_gbps
    if cfg.network is not None:
        try:
            topo.network = network_of(cfg.network)
        except TopologyError as err:
            raise InputError(str(err)) from None
    return topo


def resolve_backend(cfg: RunConfig) -> tuple[str, Topology | None]:
    """``(backend, topology)``; ``single`` needs no topology, but a bad one is still an error."""
    topo = resolve_topology(cfg)
    if cfg.backend == "single":
        return "single", None
    backend = cfg.backend
    if backend == "auto":
        backend, _ = topo.choose_backend()
    return backend, topo


def resolve_devices(topo: Topology, emulate: bool = False) -> tuple[bool, Topology]:
    """Whether real GPUs compute (the topology is this machine's and CUDA works here), and the
    topology as the run's devices see it, a copy: on GPUs without the CUDA reserve; otherwise CPU
    workers rehearse its devices (``virtual``: the profile is measured on them, unless they
    ``emulate`` the topology's GPUs)."""
    cuda = not emulate and not topo.virtual and cuda_available()
    seen = copy.deepcopy(topo)
    seen.virtual = not cuda
    return cuda, reserve_cuda_memory(seen) if cuda else seen


def reserve_cuda_memory(topo: Topology) -> Topology:
    """``topo`` as a run on its GPUs budgets it (a copy): only what the CUDA context and libraries
    leave free (:data:`CUDA_RESERVE_BYTES`), taken once, recorded in its ``extra``.  CPU workers
    rehearsing GPUs budget the whole ``--gpu-mem-gb``: the runtime enforces it there itself."""
    if "cuda_reserve_gb" in topo.extra:
        return topo
    reserved = copy.deepcopy(topo)
    reserved.extra["cuda_reserve_gb"] = CUDA_RESERVE_BYTES / GB
    for g in reserved.gpus:
        g.memory_gb = max(0.0, g.memory_gb - CUDA_RESERVE_BYTES / GB)
    return reserved


def nodes_under_torchrun() -> int:
    """How many nodes ``torchrun`` started this run on (1 when it did not start it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))


def data_parallel_of(cfg: RunConfig) -> int:
    """``--data-parallel``, or one replica per node under torchrun (one otherwise)."""
    replicas = cfg.pipeline.data_parallel or nodes_under_torchrun()
    if cfg.batch.micro_batches % replicas:
        raise InputError(f"--micro-batches {cfg.batch.micro_batches} is not divisible by the {replicas} replicas "
                         "(one per node under torchrun; set --data-parallel D)")
    return replicas


def resolve_precision(cfg: RunConfig, cuda: bool) -> str:
    """``--precision`` or the default for the devices.  The run's spec carries it; the workers'
    configuration is given it (:func:`mobius.launcher.launch_workers`), and so are checkpoints."""
    return cfg.optim.precision or default_precision(cuda)


def budgets_of(topo: Topology) -> tuple[int, ...]:
    return tuple(int(g.memory_gb * GB) for g in topo.gpus)


def run_plan(cfg: RunConfig, model_config: GPTConfig, topo: Topology, precision: str, **plan_options) -> Plan:
    """The plan a run on ``topo`` executes, with its recompute decision: ``mobius.train`` and
    ``mobius.plan`` both call this, so the plan printed is the plan trained.

    ``--recompute auto`` plans both ways and keeps the faster prediction: activations kept on the
    device, where some partition lets every worker hold all of its stages' saved activations for
    all micro-batches beside its largest stage (:func:`mobius.partition.cost.activations_overflow`),
    or recomputed, which leaves the memory to more prefetch and to resident stages
    (:mod:`mobius.stages.device_optimizer`).  ``--recompute off`` where no partition fits is
    refused here, before any worker starts."""
    if cfg.emulation.enabled:  # the plan of the GPUs emulated: their profile, from FLOPs and bytes
        plan_options.setdefault("profile_how", "analytic")

    replicas = data_parallel_of(cfg)

    def make(recompute: bool) -> Plan:
        batch, pipe = cfg.batch, cfg.pipeline
        return make_plan(cfg.model, model_config, topo, batch.micro_batch_size, batch.micro_batches // replicas,
                         batch.seq_len, precision, partitioner=pipe.partitioner, recompute=recompute,
                         stages=pipe.stages, mapping=pipe.mapping, prefetch=pipe.prefetch,
                         optimizer_lag=cfg.optim.optimizer_lag, device_optimizer=pipe.device_optimizer == "auto",
                         data_parallel=replicas, **plan_options)

    if cfg.pipeline.recompute == "on":
        return make(recompute=True)
    try:
        kept = make(recompute=False)
    except DoesNotFit as err:
        if cfg.pipeline.recompute == "off":
            raise InputError(f"--recompute off: {err.reason}; use --recompute on or auto, fewer or smaller "
                             "micro-batches, or more memory") from None
        return make(recompute=True)
    if cfg.pipeline.recompute == "off":
        return kept
    recomputed = make(recompute=True)
    return kept if kept.predicted_step_s <= recomputed.predicted_step_s else recomputed


def plan_on(cfg: RunConfig, model_config: GPTConfig, topo: Topology, **plan_options) -> Plan:
    """The plan ``mobius.train`` runs on ``topo``'s own devices (its GPUs, budgeted as a run on them
    budgets them, or this machine's CPU workers), with the precision and recompute it decides:
    what ``mobius.plan`` prints, and what every script that plans reports."""
    on_gpus = not topo.virtual and not cfg.emulation.enabled  # emulating, CPU workers stand for the GPUs
    if on_gpus:
        topo = reserve_cuda_memory(topo)
    return run_plan(cfg, model_config, topo, resolve_precision(cfg, on_gpus), **plan_options)


def check_run_inputs(cfg: RunConfig, model_config: GPTConfig) -> None:
    """The checkpoint to resume, before any worker starts (the data: :func:`mobius.train.run`)."""
    if cfg.checkpoint.resume:
        ck.open_for_resume(cfg, model_config)


def prepare_pipeline(cfg: RunConfig, topo: Topology, model_config: GPTConfig) -> tuple[RunSpec, Plan]:
    """The spec of a pipeline run (and its plan, for the launcher's header); ``model_config`` as
    :func:`mobius.runtime.inputs.check_model_input` checked it."""
    cuda, topo = resolve_devices(topo, cfg.emulation.enabled)
    if cuda and data_parallel_of(cfg) > nodes_under_torchrun():
        raise InputError(f"--data-parallel {data_parallel_of(cfg)} on the GPUs of one machine is not built: start one "
                         "replica per node with torchrun (README: two boxes), or rehearse on CPU workers")
    precision = resolve_precision(cfg, cuda)
    check_run_inputs(cfg.changed(precision=precision), model_config)
    plan = run_plan(cfg, model_config, topo, precision)
    emulation = emulation_for(cfg, model_config, topo, plan) if cfg.emulation.enabled else None
    return RunSpec("pipeline", cuda, precision, budgets_of(topo), plan=plan, emulation=emulation,
                   data_parallel=data_parallel_of(cfg)), plan


# The CPU work must fit this many times into the emulated time it stands for: the margin for noise
# and for the runtime's own work.
EMULATION_MARGIN = 2.0
# An emulated run expected to take longer than this (wall seconds) is refused unless --dilation is given.
MAX_EMULATED_WALL_S = 3600.0


def emulation_for(cfg: RunConfig, model_config: GPTConfig, topo: Topology, plan: Plan) -> EmulationSpec:
    """The emulated links of ``topo``'s GPUs and the dilation ``F`` (wall seconds per emulated
    second), one for every variant of a comparison:

    * the model's: its layers' measured CPU time over their GPU time, with :data:`EMULATION_MARGIN`
      and the workers' crowding of this machine's cores.  It depends on the model, the batch, the
      GPUs and this machine, not on the partition, the mapping, prefetching or the optimizer lag,
      so the variants of those are measured under one factor;
    * raised, if need be, until each worker's CPU work of a step fits into the emulated step (else
      the CPU, not the emulated GPU, would set the pace);
    * ``--dilation F`` instead, refused below that floor.

    A run expected to take more than :data:`MAX_EMULATED_WALL_S` of wall time is refused in one line
    saying what to change."""
    cpu = get_profile(cfg.model, model_config, cpu_topology(topo.n), cfg.batch.micro_batch_size, cfg.batch.seq_len,
                      plan.precision, "measure")
    cpu_stages = stage_costs(cpu, plan.bounds, plan.recompute)
    gpu_total = sum(st.fwd_ms + st.bwd_ms for st in plan.stages) / 1e3
    model_ratio = sum(c.fwd_s + c.bwd_s for c in cpu_stages) / max(gpu_total, 1e-12)
    work = [0.0] * topo.n  # each worker's CPU work of one step
    passes = 3 if plan.recompute else 2  # forward, (recomputation,) backward: the runtime's work per micro-batch
    for c, st in zip(cpu_stages, plan.stages):
        work[st.gpu] += plan.micro_batches * (c.fwd_s + c.bwd_s + passes * cpu.host.micro_batch_s) \
            + 2 * cpu.host.stage_switch_s
    return emulation_spec(cfg, topo, model_ratio, max(work), plan.predicted_step_s)


def emulation_spec(cfg: RunConfig, topo: Topology, model_ratio: float, worker_cpu_s: float,
                   predicted_step_s: float) -> EmulationSpec:
    """The emulated links of ``topo`` and the dilation (see :func:`emulation_for`), for a backend
    whose layers take ``model_ratio`` times as long on this machine's CPU as on the emulated GPUs,
    whose busiest worker's CPU work of a step is ``worker_cpu_s``, and whose step is predicted at
    ``predicted_step_s`` of emulated time."""
    crowding = max(1.0, topo.n / (os.cpu_count() or 1))  # workers per core when all compute at once
    model_factor = EMULATION_MARGIN * crowding * model_ratio
    step_floor = EMULATION_MARGIN * crowding * worker_cpu_s / predicted_step_s
    if cfg.emulation.dilation is not None:
        if cfg.emulation.dilation < step_floor:
            raise InputError(f"--dilation {cfg.emulation.dilation:g} is below what this machine needs for the run "
                             f"({step_floor:.3g}: a worker's CPU work of a step would outlast the emulated step); "
                             f"give at least {_round_up(step_floor):g}")
        factor, how = cfg.emulation.dilation, "given"
    else:
        factor = _round_up(max(model_factor, step_floor))
        how = "chosen for the model" if model_factor >= step_floor else "raised for the busiest worker"
        wall = factor * predicted_step_s * cfg.optim.steps
        if wall > MAX_EMULATED_WALL_S:
            raise InputError(f"--emulate: {cfg.optim.steps} steps at 1/{factor:g} speed would take about "
                             f"{wall / 3600:.1f} h "
                             f"of wall time ({_round_up(factor * predicted_step_s):g} s a step: this machine's "
                             f"CPU is {model_ratio:.3g}x slower than the emulated GPUs on this model); run fewer "
                             "--steps, a larger model or batch, or fix --dilation F")
    return EmulationSpec(topology=topo.name, factor=factor,
                         link_bps=tuple(g.link_bandwidth_gbps * 1e9 for g in topo.gpus),
                         root_complex=tuple(g.root_complex for g in topo.gpus),
                         rc_bps={str(r.id): r.host_bandwidth_gbps * 1e9 for r in topo.root_complexes},
                         counters="", how=how)  # the launcher makes the counters file


def _round_up(x: float) -> float:
    """The next of 1, 2, 5, 10, 20, 50, ... at or above ``x``."""
    decade = 10 ** math.floor(math.log10(max(x, 1.0)))
    return next(m * decade for m in (1, 2, 5, 10) if m * decade >= x)
