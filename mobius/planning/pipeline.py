"""The pipeline's own decisions, made once before any worker starts from the shared ones
(:mod:`mobius.planning.prepare`: topology, devices, precision, profile): the plan with its
recompute decision (:func:`run_plan`, what ``mobius.plan`` prints and ``mobius.train`` runs), the
fit of CPU workers in this machine's memory, the emulated links and time of ``--emulate``, all into
the frozen :class:`RunSpec` every pipeline worker gets (:func:`prepare_pipeline`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.models import GPTConfig
from mobius.models.precision import element_bytes
from mobius.partition.cost import stage_costs
from mobius.partition.profile import Profile
from mobius.planning.planner import (
    DoesNotFit,
    available_host_memory,
    check_plannable,
    host_bytes_needed,
    make_plan,
    replica_profile,
)
from mobius.planning.prepare import (
    GB,
    Decided,
    budgets_of,
    check_run_inputs,
    emulation_spec,
    get_profile,
    host_key,
    nodes_under_torchrun,
    profile_key,
)
from mobius.runtime.emulation import EmulationSpec
from mobius.runtime.optim import ROLLBACK_PASSES, HostUpdatePath, host_update_path, updates_speculate
from mobius.metrics import seconds_text
from mobius.runtime.spec import DispatchedShape, PipelineSetup, Plan, RunSpec
from mobius.planning.dispatched import DispatchedPlan, plan_dispatched, waiting_step
from mobius.stages.dispatch import check_dispatched, dispatched_refusal
from topology import Topology, cpu_topology


def updates_wait_for_the_step(cfg: RunConfig, precision: str, replicas: int) -> bool:
    """Whether a plan's host updates wait for each step's last gradient: clipping's global norm or
    fp16's overflow vote holds them back, and they cannot start before it
    (:func:`~mobius.runtime.optim.updates_speculate`), or state is on disk (a redo would read it
    through the drives again).  A plan whose updates start before the decision is the plan of the
    steps that keep them: a step that clips or overflows takes them back, and the next waits."""
    held = bool(cfg.optim.max_grad_norm) or precision == "fp16"
    return held and (bool(cfg.offload_dir) or not updates_speculate(
        cfg.optim.max_grad_norm, cfg.optim.optimizer_lag, precision == "fp16", replicas > 1))


def update_path(cfg: RunConfig, precision: str, replicas: int) -> HostUpdatePath:
    """What a run's host updates do beside AdamW in their pass, by the runtime's rule."""
    return host_update_path(cfg.optim.max_grad_norm, cfg.optim.optimizer_lag, precision == "fp16", replicas > 1)


def clipping_waits(cfg: RunConfig, precision: str, replicas: int) -> bool:
    """Whether clipping holds the bound plan's host updates (its cost model and simulator count
    clipping's wait, not fp16's vote)."""
    return bool(cfg.optim.max_grad_norm) and updates_wait_for_the_step(cfg, precision, replicas)


def clipping_speculates(cfg: RunConfig, precision: str, replicas: int) -> bool:
    """Whether a plan's host updates start before clipping's norm: it states the steps that clip
    and those after them besides its own (:class:`~mobius.runtime.spec.StepPrediction`)."""
    return bool(cfg.optim.max_grad_norm) and not updates_wait_for_the_step(cfg, precision, replicas)


def layers_timed_how(cfg: RunConfig, asked: str = "auto") -> str:
    """How a plan times its layers (``--profile``): an emulated box's from its GPUs' figures, as its
    run emulates them (``mobius.plan`` refuses ``measure`` with ``--emulate``), else as asked."""
    return "analytic" if cfg.emulation.enabled else asked


def run_plan(decided: Decided, model_config: GPTConfig, profile: Profile | None = None,
             profiled: Callable[[], None] | None = None, **plan_options) -> Plan:
    """The plan a run on ``decided``'s devices executes (its GPUs, budgeted as a run on them
    budgets them, or this machine's CPU workers), with its recompute decision: ``mobius.train``
    and ``mobius.plan`` both call this, so the plan printed is the plan trained; every script that
    plans reports it.

    ``--recompute auto`` plans both ways (at once, on two threads) and keeps the faster prediction:
    activations kept on the device, where some partition lets every worker hold all of its stages'
    saved activations for all micro-batches beside its largest stage (:func:`mobius.partition.cost.activations_overflow`),
    or recomputed only where memory forces it: the partition made for recomputation, with each stage
    whose activations still fit beside the resident stages and the prefetches, and shorten the step,
    keeping them (:meth:`mobius.planning.planner._Search.kept`).  ``--recompute on`` recomputes
    every stage, which leaves the memory to more prefetch and to resident stages
    (:mod:`mobius.stages.device_optimizer`).  ``--recompute off`` where no partition fits is
    refused here, before any worker starts.  ``profile``: plan from this one (a script's own
    figures) instead of the one measured or computed for ``topo``; ``profiled``: called once the
    profile is at hand, before the MIPs (a run starts its workers' imports then: nothing is timed
    after)."""
    # The plan of emulated GPUs is made from their profile, from FLOPs and bytes.
    cfg, topo, precision, replicas = decided.cfg, decided.topology, decided.precision, decided.replicas
    how = layers_timed_how(cfg, plan_options.pop("profile_how", "auto"))
    batch, pipe = cfg.batch, cfg.pipeline
    # The disk tier: as much state on disk as the host memory needs (--host-mem-gb, or the machine's), or
    # with --host-mem-gb 0 all it can take.
    disk = "off" if not cfg.offload_dir else "all" if cfg.host_mem_gb == 0 else "fit"
    check_plannable(cfg.model, model_config, topo, precision, pipe.stages, cfg.optim.optimizer_lag, replicas,
                    moments_on_disk=disk != "off")
    if profile is None:
        profile = get_profile(cfg.model, model_config, topo, batch.micro_batch_size, batch.seq_len, precision, how,
                              fresh=not plan_options.get("use_cache", True), path=update_path(cfg, precision, replicas))
    if profiled is not None:
        profiled()

    def make(recompute: bool) -> Plan:
        return make_plan(cfg.model, model_config, topo, batch.micro_batch_size, batch.micro_batches // replicas,
                         batch.seq_len, precision, profile=profile, partitioner=pipe.partitioner, recompute=recompute,
                         keep_where_room=pipe.recompute == "auto",
                         stages=pipe.stages, mapping=pipe.mapping, prefetch=pipe.prefetch,
                         optimizer_lag=cfg.optim.optimizer_lag, device_optimizer=pipe.device_optimizer == "auto",
                         data_parallel=replicas, clip=clipping_waits(cfg, precision, replicas),
                         disk=disk, clip_speculates=clipping_speculates(cfg, precision, replicas),
                         **plan_options)

    if cfg.pipeline.recompute == "on":
        return make(recompute=True)
    if cfg.pipeline.recompute == "off":
        try:
            return make(recompute=False)
        except DoesNotFit as err:
            raise InputError(f"--recompute off: {err.reason}; use --recompute on or auto, fewer or smaller "
                             "micro-batches, or more memory") from None
    # Both plans at once: HiGHS solves without the GIL, and each thread has a solver of its own.
    with ThreadPoolExecutor(2, thread_name_prefix="mobius-plan") as pool:
        keeping, recomputing = pool.submit(make, recompute=False), pool.submit(make, recompute=True)
        try:
            kept = keeping.result()
        except DoesNotFit:
            kept = None
        recomputed = recomputing.result()
    # (by the cost model, as the search compares every candidate; each plan states its simulation)
    return kept if kept is not None and kept.modelled_step_s <= recomputed.modelled_step_s else recomputed


@dataclass(frozen=True)
class ScheduleChoice:
    """What ``--schedule`` decided, and from which figures."""

    dispatched: DispatchedPlan | None  # the dispatched schedule predicted (where asked and one fits)
    shape: DispatchedShape | None  # what runs instead of the bound plan (None: the bound plan runs)
    why: str  # in the words of a run's header
    bound_step_s: float = 0.0  # the bound plan's step the dispatched one was compared with
    bound_how: str = ""  # how that step was found: "simulated", or "predicted" by the plan's cost model


def dispatched_beside(decided: Decided, model_config: GPTConfig, plan: Plan, profile_how: str = "auto"
                      ) -> tuple[DispatchedPlan | None, DispatchedShape | None, float, str]:
    """The dispatched schedule of the run ``plan`` is for (:mod:`mobius.planning.dispatched`), from the
    same profile and host rate, on the same GPUs in the same order (each of ``plan``'s replicas on
    its share of the micro-batches), and the shape a run executes of it (None, None where none
    fits); and the bound plan's step to compare it with, and how it was found.

    Like is compared with like: the dispatched prediction is a simulation, and so is the bound
    plan's step (:func:`mobius.planning.planner.make_plan`), but for a plan with state on disk,
    whose step is its cost model's (the disk tier is refused before this: ``mobius.plan`` never
    models it here)."""
    cfg, topo = decided.cfg, decided.topology
    batch = cfg.batch
    profile = replica_profile(get_profile(cfg.model, model_config, topo, batch.micro_batch_size, batch.seq_len,
                                          plan.precision, layers_timed_how(cfg, profile_how),
                                          path=update_path(cfg, plan.precision, plan.data_parallel)),
                              topo, plan.data_parallel)
    adam = plan.host_costs.get("adam_params_per_s")
    found = plan_dispatched(profile, topo, plan.order, plan.micro_batches, adam_params_per_s=adam,
                            optimizer_lag=cfg.optim.optimizer_lag,
                            tied=model_config.tie_embeddings and not cfg.lora.rank,
                            whole_step=updates_wait_for_the_step(cfg, plan.precision, plan.data_parallel))
    if found is not None and clipping_speculates(cfg, plan.precision, plan.data_parallel):
        # A step that clips waits for its norm and takes back the busiest host thread's updates first.
        waiting, host_s = waiting_step(found, profile, topo, adam_params_per_s=adam)
        found = replace(found, waiting_step_s=waiting, clipped_step_s=waiting + ROLLBACK_PASSES * host_s)
    bound, how = plan.predicted_step_s, "simulated" if plan.simulated else "predicted"
    return found, found.shape(profile) if found is not None else None, bound, how


def choose_schedule(decided: Decided, model_config: GPTConfig, plan: Plan,
                    profile_how: str = "auto") -> ScheduleChoice:
    """``--schedule``: the dispatched plan (predicted, where asked), the shape to run instead of
    ``plan`` and why; ``auto`` runs the faster of the two simulated steps."""
    cfg = decided.cfg
    if cfg.pipeline.schedule == "bound":
        return ScheduleChoice(None, None, "bound (--schedule bound)")
    if cfg.pipeline.schedule == "dispatched":
        check_dispatched(cfg)
    elif (refusal := dispatched_refusal(cfg)) is not None:
        return ScheduleChoice(None, None, f"bound: dispatched does not run {refusal} yet")
    found, shape, bound, how = dispatched_beside(decided, model_config, plan, profile_how)
    if found is None:
        if cfg.pipeline.schedule == "dispatched":
            raise InputError("--schedule dispatched: no dispatched shape fits the GPUs' memory; use --schedule bound")
        return ScheduleChoice(None, None, "bound: no dispatched shape fits the GPUs' memory", bound, how)
    versus = f"simulated {seconds_text(found.step_s)}/step against the bound plan's {how} {seconds_text(bound)}"
    if cfg.pipeline.schedule == "auto" and found.step_s >= bound:
        return ScheduleChoice(found, None, f"bound (auto): the dispatched schedule was {versus}", bound, how)
    return ScheduleChoice(found, shape, f"dispatched ({cfg.pipeline.schedule}): {versus}", bound, how)


def prepare_pipeline(decided: Decided, model_config: GPTConfig,
                     profiled: Callable[[], None] | None = None) -> tuple[RunSpec, Plan]:
    """The spec of a pipeline run (and its plan, for the launcher's header); ``model_config`` as
    :func:`mobius.runtime.inputs.check_model_input` checked it; ``profiled``: :func:`run_plan`'s."""
    cfg, topo, gpus, precision = decided.cfg, decided.topology, decided.gpus, decided.precision
    asked = cfg.pipeline.data_parallel
    if gpus and asked and asked > nodes_under_torchrun():
        raise InputError(f"--data-parallel {asked} on the GPUs of one machine is not built: start one "
                         "replica per node with torchrun (README: two boxes), or rehearse on CPU workers")
    check_run_inputs(cfg, model_config)
    plan = run_plan(decided, model_config, profiled=profiled)
    if not gpus:
        check_cpu_workers_fit(cfg, model_config, plan, budgets_of(topo), available_host_memory())
    emulation = emulation_for(cfg, model_config, topo, plan) if cfg.emulation.enabled else None
    measured = not plan.profile_source.startswith("analytic")
    layers_key = profile_key(model_config, topo, cfg.batch.micro_batch_size, cfg.batch.seq_len, precision) \
        if measured else ""
    choice = choose_schedule(decided, model_config, plan)
    setup = PipelineSetup(plan, plan.data_parallel, host_key(topo, measured), layers_key, choice.shape,
                          choice.dispatched.steps() if choice.shape is not None else None, choice.why)
    return RunSpec(gpus, precision, budgets_of(topo), setup, emulation), plan


# What one CPU worker process takes before it holds any of the model: the interpreter, torch, gloo.
CPU_WORKER_PROCESS_BYTES = 400 * 2**20


def planned_device_bytes(plan: Plan, worker: int) -> int:
    """The most of its device's memory ``worker`` holds under ``plan``: its resident stages' weights,
    gradients and AdamW state (fp32 masters too in 16 bits), and its largest pass of a swapped stage
    with the next stage prefetched beside it."""
    elt = element_bytes(plan.precision)
    held = passes = 0
    for s in plan.stages:
        if s.gpu != worker:
            continue
        if s.index in plan.resident:
            held += s.param_bytes + s.grad_bytes + s.grad_bytes // elt * ((8 if elt != 4 else 0) + 8)
        passes = max(passes, s.mem_fwd_bytes, s.mem_bwd_bytes)
    return held + 2 * passes


def check_cpu_workers_fit(cfg: RunConfig, model_config: GPTConfig, plan: Plan, budgets: tuple[int, ...],
                          available: int | None) -> None:
    """On CPU workers a device's memory is this machine's: the host's share of the model (masters,
    AdamW state, gradients), every worker process and what each holds of its budget as planned
    must fit in what the machine has ``available`` (None: unknown, not checked)."""
    if available is None:
        return
    replicas = plan.data_parallel
    host = host_bytes_needed(model_config, plan.precision, cfg.optim.optimizer_lag, replicas, replicas)
    workers = replicas * sum(min(budget, planned_device_bytes(plan, k)) + CPU_WORKER_PROCESS_BYTES
                             for k, budget in enumerate(budgets))
    if host + workers > available:
        raise InputError(f"model {cfg.model} on {replicas * len(budgets)} CPU workers needs "
                         f"{(host + workers) / GB:.1f} GB of this machine's memory ({host / GB:.1f} GB on the host, "
                         f"{workers / GB:.1f} GB in the workers as planned), but {available / GB:.1f} GB are "
                         "available: use fewer --cpu-workers, a smaller --gpu-mem-gb or a smaller model")


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
                      plan.precision, "measure", path=update_path(cfg, plan.precision, plan.data_parallel))
    cpu_stages = stage_costs(cpu, plan.bounds, plan.recompute, kept=tuple(plan.kept))
    gpu_total = sum(st.fwd_ms + st.bwd_ms for st in plan.stages) / 1e3
    model_ratio = sum(c.fwd_s + c.bwd_s for c in cpu_stages) / max(gpu_total, 1e-12)
    work = [0.0] * topo.n  # each worker's CPU work of one step
    for c, st in zip(cpu_stages, plan.stages):
        passes = 3 if c.recomputed else 2  # forward, (recomputation,) backward: the runtime's work per micro-batch
        work[st.gpu] += plan.micro_batches * (c.fwd_s + c.bwd_s + passes * cpu.host.micro_batch_s) \
            + 2 * cpu.host.stage_switch_s
    return emulation_spec(cfg, topo, model_ratio, max(work), plan.predicted_step_s, plan.data_parallel,
                          plan.precision, update_path(cfg, plan.precision, plan.data_parallel))
