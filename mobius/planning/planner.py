"""Profile -> partition -> cross map: the :class:`Plan` a run executes (and ``mobius.plan`` prints).

The planner takes its profile as data (:func:`mobius.planning.prepare.get_profile` measures or
computes it) and runs nothing.  Plans are cached under ``~/.cache/mobius/plans`` by a hash of (profile,
topology, batch settings, partitioner), so the same command on the same machine plans the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from mobius.boundary.cache import Cache, key_of
from mobius.boundary.errors import InputError
from mobius.mapping import cross_map, sequential_map
from mobius.models import GPTConfig, build_layer, layer_count, tied_parameter_names
from mobius.models.precision import element_bytes
from mobius.partition.baselines import BASELINES, balanced_bounds, layer_costs, uniform_bounds
from mobius.partition.cost import (
    GB,
    Machine,
    StageCost,
    check_layers_fit,
    disk_bytes_per_param,
    evaluate,
    exchanged_bytes,
    host_traffic_bytes,
    machine_for,
    recomputation_s,
    settle,
    stage_costs,
    step_bounds,
)
from mobius.partition.highs import SAFETY_TIME_LIMIT_S
from mobius.partition.mip import solve_partition
from mobius.partition.profile import Profile
from mobius.runtime.optim import ROLLBACK_PASSES
from mobius.runtime.spec import Lane, Plan, SolverReport, StagePlan
from mobius.sim.schedules import simulate_mobius
from mobius.swap.disk import MASTER_BYTES, MOMENT_BYTES, POOL_BUFFERS, block_params
from topology import Topology, assumed_network

PLANS = Cache("plans", "plan")
# Host bytes per trained parameter (mobius.swap.store): fp32 master + AdamW m and v + fp32 gradient,
# plus for 16-bit compute the compute-dtype copy and the gradient staging buffer.  A frozen
# parameter (LoRA's base weights) is held once, in the compute dtype.
HOST_BYTES_PER_PARAM = {"fp32": 16, "bf16": 20, "fp16": 20}
ADAM_STATE_BYTES = MOMENT_BYTES  # of those: AdamW's two fp32 moments, which data-parallel replicas shard


MAPPINGS = {"cross": cross_map, "sequential": sequential_map}


def tied_stages(config: GPTConfig, bounds: list[tuple[int, int]]) -> set[int]:
    """The stages that hold a copy of a tied embedding (their update waits for the other copy's
    gradients)."""
    if not tied_parameter_names(config):
        return set()
    last = bounds[-1][1]
    return {j for j, (lo, hi) in enumerate(bounds) if lo == 0 or hi == last}


def resident_stages(profile: Profile, bounds: list[tuple[int, int]], step_of,
                    exclude: set[int]) -> tuple[int, ...]:
    """The stages to keep on their GPUs with their AdamW state, updated there
    (:mod:`mobius.stages.device_optimizer`): greedily, largest first, each kept when the step
    ``step_of(resident)`` is still feasible and at least 0.1% faster with it.  A stage that trains
    nothing, or whose update waits for the whole step (``exclude``), stays put."""
    costs = stage_costs(profile, bounds)
    return _greedy(sorted((j for j, c in enumerate(costs) if c.grad_bytes and j not in exclude),
                          key=lambda j: (-costs[j].grad_bytes, j)), step_of)


def kept_stages(profile: Profile, bounds: list[tuple[int, int]], step_of) -> tuple[int, ...]:
    """With recomputation on: the stages that keep their activations on their GPU instead (the
    head never recomputes): greedily, the longest forward first (the most recomputation spared),
    each kept when the step ``step_of(kept)`` is still feasible (every slot holds its kept
    stages' activations for all micro-batches beside its largest pass) and at least 0.1% faster
    with it (the memory it takes is the prefetches' too)."""
    costs = stage_costs(profile, bounds)
    return _greedy(sorted(range(len(costs) - 1), key=lambda j: (-costs[j].fwd_s, j)), step_of)


def _greedy(candidates: list[int], step_of) -> tuple[int, ...]:
    """The stages chosen from ``candidates``, tried in their order: each joins where the step
    ``step_of(chosen)`` is still feasible and at least 0.1% faster with it."""
    chosen, best = (), step_of(()).step_s
    for j in candidates:
        trial = tuple(sorted(chosen + (j,)))
        est = step_of(trial)
        if est.feasible and est.step_s < best * (1 - 1e-3):
            chosen, best = trial, est.step_s
    return chosen


class DoesNotFit(InputError):
    """No partition of the kind asked for fits the devices' memory; ``reason`` says where not."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def master_bytes_freed(precision: str, optimizer_lag: int) -> int:
    """Host bytes a trained parameter's master weight on disk frees: the fp32 master, where the
    compute copy is not it (16-bit compute, or fp32 with a lag), and with 16-bit compute its fp32
    gradient (made from the staged one in the update's buffer)."""
    if precision == "fp32":
        return MASTER_BYTES if optimizer_lag else 0
    return MASTER_BYTES + 4


def host_bytes_needed(config: GPTConfig, precision: str, optimizer_lag: int = 0, data_parallel: int = 1,
                      replicas_here: int = 1, moments_on_disk: bool = False) -> int:
    """What the workers' stage stores hold on the host for this model (all stages together), on a
    host with ``replicas_here`` of a run's ``data_parallel`` replicas: each holds every weight and
    gradient, and 1/``data_parallel`` of the AdamW state (:mod:`mobius.stages.replicas`); with the
    ``moments_on_disk`` (:mod:`mobius.swap.disk`), only the pool their updates pass through, and
    the least the host can need: every master weight on disk too, where that frees memory, and
    then (one compute copy) every compute weight.
    Counted from the three distinct layers (every block has the same parameters), so a config of
    absurd depth is refused at once instead of being built."""
    last = layer_count(config) - 1
    tied = tied_parameter_names(config)
    layers = {0: 1, 1: config.n_layer, last: 1}
    trained = frozen = largest = 0  # largest: the most trained parameters of one layer
    for index, times in layers.items():
        in_layer = 0
        for name, p in build_layer(config, index, seed=0, device="meta").named_parameters():
            if f"layers.{index}.{name}" in tied:
                continue  # the head's copy of the token table is the embedding's
            if p.requires_grad:
                in_layer += p.numel()
            else:
                frozen += times * p.numel()
        trained += times * in_layer
        largest = max(largest, in_layer)
    per_trained = HOST_BYTES_PER_PARAM[precision] - ADAM_STATE_BYTES + ADAM_STATE_BYTES / data_parallel
    if optimizer_lag:  # a second compute copy (fp32: the first no longer aliases the master)
        per_trained += element_bytes(precision) * (2 if precision == "fp32" else 1)
    pool = 0
    if moments_on_disk:  # the moments pass through a pool of a few blocks' worth
        per_trained -= ADAM_STATE_BYTES / data_parallel
        block = block_params(largest)  # the pool's buffers hold a block of a stage each (of a layer at least)
        pool = POOL_BUFFERS * ADAM_STATE_BYTES * block
        freed = master_bytes_freed(precision, optimizer_lag) if data_parallel == 1 else 0
        if freed:  # and the master weights where the host would not hold them all (the least it can need)
            per_trained -= freed
            pool += POOL_BUFFERS * freed * block
            if optimizer_lag == 0:  # and their compute weights, a stage of a layer at least staged for its loads
                per_trained -= element_bytes(precision)
                pool += element_bytes(precision) * largest
    return int(replicas_here * (trained * per_trained + frozen * element_bytes(precision) + pool))


# Part of every cached plan's key: a plan made by an older cost model (or chosen by an older
# planner) is made again, not reused.
COST_MODEL_VERSION = 29


def check_host_memory(model_name: str, config: GPTConfig, precision: str, optimizer_lag: int, available: float,
                      where: str, data_bytes: int = 0, data_parallel: int = 1, replicas_here: int = 1,
                      moments_on_disk: bool = False) -> None:
    """The host-memory pre-flight, the one check both of a planned host and of this machine: master
    weights, AdamW state, gradients (with ``--optimizer-lag``, the second compute copy) and the data
    every process holds (``data_bytes``, all of them together) must fit in ``available`` bytes."""
    need = data_bytes + host_bytes_needed(config, precision, optimizer_lag, data_parallel, replicas_here,
                                          moments_on_disk)
    if need > available:
        held = ("gradients, the disk tier's buffers, what it cannot take of the AdamW state, master and compute "
                "weights" if moments_on_disk else "weights, AdamW state, gradients")
        hint = "" if moments_on_disk else "; --offload-dir DIR keeps AdamW's moments on disk"
        raise InputError(f"model {model_name} needs {need / GB:.1f} GB of host memory ({held}"
                         f"{f', {data_bytes / GB:.1f} GB of data' if data_bytes else ''}), but {where} has "
                         f"{available / GB:.1f} GB{hint}")


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# Plans whose predicted steps differ by less than this are equally fast: the one that moves the
# fewest bytes over PCIe wins (a step bound by something no partition changes, e.g. the host's
# AdamW, would otherwise be cut into as many stages as the solver happens to return).
TIE_TOLERANCE = 0.01


def _least_traffic_among_fastest(found: dict, steps: dict, profile: Profile, micro_batches: int, slots: int,
                                 recompute: bool) -> tuple[list, str]:
    """Lexicographic: the fastest step within :data:`TIE_TOLERANCE`, then the least host traffic."""
    fastest = min(steps[name] for name in found)
    traffic = {name: host_traffic_bytes(stage_costs(profile, b, recompute), micro_batches, slots)
               for name, b in found.items()}
    near = [name for name in found if steps[name] <= fastest * (1 + TIE_TOLERANCE)]
    name = min(near, key=lambda n: (traffic[n], steps[n], n != "mip"))
    return found[name], name


def pcie_bps(topo: Topology) -> float:
    """Host<->device bytes/s with every GPU copying: each root complex's bandwidth, capped by the
    links under it."""
    groups = topo.groups()
    return sum(min(r.host_bandwidth_gbps, sum(topo.gpus[g].link_bandwidth_gbps for g in groups[r.id])) * GB
               for r in topo.root_complexes if groups[r.id])


def check_plannable(model_name: str, config: GPTConfig, topo: Topology, precision: str, stages: int | None = None,
                    optimizer_lag: int = 0, data_parallel: int = 1, moments_on_disk: bool = False) -> None:
    """What refuses a plan before any profiling: the host memory (with AdamW's moments on disk,
    where the disk tier may take them), and a stage for every worker, each stage at least one layer."""
    check_host_memory(model_name, config, precision, optimizer_lag, topo.host_memory_gb * GB, topo.name,
                      data_parallel=data_parallel, moments_on_disk=moments_on_disk)
    layers = layer_count(config)
    workers = f"the {topo.n} {'CPU workers' if topo.virtual else 'GPUs'} of {topo.name}"
    if layers < topo.n:
        raise InputError(f"model {model_name} has {layers} layers, fewer than {workers}: every worker needs a "
                         "stage (use fewer --cpu-workers or a larger model)")
    if stages is not None and stages < topo.n:
        raise InputError(f"--stages {stages} is fewer than {workers}: every worker needs a stage")
    if stages is not None and stages > layers:
        raise InputError(f"--stages {stages} exceeds the model's {layers} layers")


def replica_profile(profile: Profile, topo: Topology, data_parallel: int) -> Profile:
    """``profile`` as the host of one of ``data_parallel`` replicas on ``topo``'s nodes sees it: it
    updates 1/D of each stage and exchanges the stage's gradients and weights with the other
    replicas over the node's network (:func:`~mobius.partition.cost.host_updates`)."""
    if data_parallel == 1:
        return profile
    network_bps = assumed_network(topo).bandwidth_gbps * GB
    return replace(profile, host=replace(profile.host, replicas=data_parallel, network_bps=network_bps))


def other_stage_counts(profile: Profile, found: dict, workers: int) -> dict:
    """Balanced partitions at stage counts the candidates in ``found`` do not try: one and two
    stages per worker, and half and one and a half times each candidate's count.  The MIP and the
    baselines choose their counts for stages that swap; resident stages (decided afterwards, when
    the candidates are finished) can make fewer, larger stages faster, or more, smaller ones: a plan
    at those counts must be in the race, or one a user reaches with ``--stages`` could beat ours."""
    costs = layer_costs(profile)
    counts = {workers, 2 * workers}
    for bounds in found.values():
        m = len(bounds)
        counts |= {m // 2, m + (m + 1) // 2}
    have = {len(b) for b in found.values()}
    return {f"balanced-{k}": balanced_bounds(costs, k)
            for k in sorted(counts) if workers <= k <= profile.n and k not in have}


def disk_stages(costs: list[StageCost], element_bytes: int, data_parallel: int, excess: float,
                master_freed: int = 0, keep_master: frozenset[int] = frozenset(), weights: bool = False,
                workers: int = 1) -> tuple[list[int], list[int], list[int]]:
    """(the host stages whose AdamW moments wait on disk, those whose master weights wait there
    too, those whose compute weights do as well): the moments of the largest stages first, until
    they free ``excess`` bytes of host memory beside the pools they pass through (one a worker of
    ``workers``); where every stage's moments are not enough, the master weights of the largest
    (``master_freed`` bytes a parameter each; not those of ``keep_master``, which the host must
    hold), the pools' blocks then holding a master too; where those are not enough and
    ``weights`` allows (one compute copy, no replicas), the compute weights of the largest stages
    whose master is there, each worker then staging its largest such stage for its loads.
    ``excess`` ``inf``: every moment, every master that frees memory, and where ``weights``
    allows, their stages' weights."""
    if excess <= 0:
        return [], [], []
    params = {j: c.grad_bytes // element_bytes for j, c in enumerate(costs) if not c.resident and c.grad_bytes}
    order = sorted(params, key=lambda j: -params[j])

    def pool(chosen_masters: list[int], chosen_weights: list[int] = ()) -> float:
        grads = MASTER_BYTES if master_freed > MASTER_BYTES else 0  # 16-bit: the fp32 gradients too
        per_param = ADAM_STATE_BYTES // data_parallel + ((MASTER_BYTES + grads) if chosen_masters else 0)
        blocks = POOL_BUFFERS * per_param * block_params(params[order[0]]) if order else 0
        staging = max((params[j] * element_bytes for j in chosen_weights), default=0)
        return workers * (blocks + staging)

    moments: list[int] = []
    freed = 0
    for j in order:
        if moments and freed - pool([]) >= excess:
            break
        moments.append(j)
        freed += params[j] * ADAM_STATE_BYTES // data_parallel
    masters: list[int] = []
    if (excess == math.inf or freed - pool([]) < excess) and master_freed and data_parallel == 1:
        for j in order:
            if masters and freed - pool(masters) >= excess:
                break
            if j not in keep_master:
                masters.append(j)
                freed += params[j] * master_freed
    on_disk: list[int] = []
    if (excess == math.inf or freed - pool(masters) < excess) and weights:
        for j in masters:  # largest first
            if on_disk and freed - pool(masters, on_disk) >= excess:
                break
            on_disk.append(j)
            freed += params[j] * element_bytes
    if excess != math.inf and freed - pool(masters, on_disk) < excess:
        held = ", ".join(["AdamW moments"] + ["master weights"] * bool(masters) + ["weights"] * bool(on_disk))
        raise InputError(f"with every host stage's {held} on disk "
                         f"the host still needs {(excess - freed + pool(masters, on_disk)) / GB:.2f} GB more than "
                         "the run may use (--host-mem-gb)")
    return sorted(moments), sorted(masters), sorted(on_disk)


# The partition MIP models at most this many micro-batches of the step: its rows grow with them
# (Llama-3.1-8B on 8 GPUs: 4,558 at 16, 14,254 at 64) and a HiGHS limit check with their square,
# while the partition it finds moves little past a few per stage-pass.  Its answer is then timed,
# as every candidate is, at the run's own count (:meth:`_Search.finished`).
MIP_MICRO_BATCHES = 16


@dataclass
class _Search:
    """What one plan's search shares: the partitions' timing under their own schedules, what a
    partition becomes in the plan, and the race of the MIP's answer against the baselines."""

    profile: Profile
    config: GPTConfig
    topo: Topology
    micro_batches: int
    precision: str
    recompute: bool
    keep_where_room: bool  # with recompute: the chosen partition's stages whose activations fit keep them
    prefetch: bool
    optimizer_lag: int
    clip: bool
    device_optimizer: bool
    place: Callable
    _simulations: dict = field(default_factory=dict)  # (bounds, order, resident, kept) -> step

    def settled(self, bounds, placement, resident=(), kept=()):
        """The partition's machine and step with the contention of its own schedule."""
        return settle(self.profile, bounds, self.topo, placement, self.micro_batches, self.recompute, self.prefetch,
                      self.profile.host, self.optimizer_lag, resident=resident, clip=self.clip, kept=kept)

    def candidates(self, machine, placement):
        found = {name: fn(self.profile, machine, self.micro_batches, self.recompute) for name, fn in BASELINES.items()}
        return found, {name: self.settled(b, placement) for name, b in found.items()}

    def runnable(self, found) -> list[str]:
        """The baselines that give every worker a stage (max-stage may give fewer)."""
        return [name for name in found if len(found[name]) >= self.topo.n]

    def finished(self, bounds):
        """What a partition becomes in the plan: the mapping searched for its stage count, the stages
        kept resident, and its step under its own schedule's contention."""
        placed = self.place(self.topo, len(bounds))
        resident = ()
        if self.device_optimizer and not self.optimizer_lag and self.precision != "fp16":
            # Candidates are timed at the copy rates of the swapping plan's schedule (settling each
            # would cost a pass over every pair of copies); the choice is then settled once.
            rates, _ = self.settled(bounds, placed)
            resident = resident_stages(self.profile, bounds,
                                       lambda r: evaluate(self.profile, bounds, rates, self.micro_batches,
                                                          self.recompute, r), tied_stages(self.config, bounds))
        return (placed, resident, *self.settled(bounds, placed, resident))

    def kept(self, bounds, placed, resident, machine: Machine) -> tuple[int, ...]:
        """The chosen partition's stages that keep their activations instead of recomputing, in what
        the resident stages leave (:func:`kept_stages`, timed at ``machine``'s copy rates), where the
        simulator (the runtime's operations on the same links) agrees that they shorten the step.
        Decided once the partition is chosen, not for every candidate: on an emulated 8x3090-4+4 the
        cost model took a partition whose stages kept their activations for 4% faster than the one
        that recomputed, the simulator for 5% slower, and it ran 8% slower."""
        kept = kept_stages(self.profile, bounds,
                           lambda k: evaluate(self.profile, bounds, machine, self.micro_batches, True, resident, k))
        if not kept:
            return kept
        return kept if self.simulated(bounds, placed, resident, kept, machine) < \
            self.simulated(bounds, placed, resident, (), machine) else ()

    def simulated(self, bounds, placed, resident, kept, machine: Machine, clip: bool | None = None) -> float:
        """The step of a finished candidate as the simulator times it (:func:`simulate_mobius`), once:
        the chosen plan's is the one its kept stages were decided by.  ``clip``: whether the host
        updates wait for clipping's norm, where not as the search plans them."""
        clip = self.clip if clip is None else clip
        key = (tuple(bounds), tuple(placed.order), tuple(resident), tuple(kept), clip)
        if key not in self._simulations:
            self._simulations[key] = simulate_mobius(
                self.profile, bounds, self.topo, list(placed.order), self.micro_batches, self.recompute,
                optimizer_lag=self.optimizer_lag, prefetch=self.prefetch, kept=tuple(kept), clip=clip,
                resident=tuple(resident), device_adam_params_per_s=machine.device_adam_params_per_s).step_s
        return self._simulations[key]

    def race(self, baselines: dict, settled_of: dict, times: dict, effort: int | None, time_limit_s: float):
        """The MIP sees the copy rates as constants, those of the best baseline's schedule; (solving
        again on the rates of its own answer found plans the emulated runs ranked otherwise).  Its
        answer and every baseline are then finished as the plan would be (mapped, resident stages
        chosen, timed under their own contention), with balanced partitions at other stage counts,
        and the fastest is kept: the MIP's plan is never slower than one --partitioner could have
        given.  Returns (bounds, the solver's report, every finished candidate); ``times`` gets
        the finished baselines' steps."""
        profile, topo = self.profile, self.topo
        best = min(self.runnable(baselines), key=times.get)
        modelled = min(self.micro_batches, MIP_MICRO_BATCHES)
        # (one write, line and newline: the plans with recompute on and off are made on two threads)
        print(f"planning: the partition MIP over {profile.n} layers for {topo.n} workers and {modelled} "
              f"micro-batches, recompute {'on' if self.recompute else 'off'} (effort {effort or 'by its size'}; "
              "cached)\n", end="", flush=True)
        result = solve_partition(profile, settled_of[best][0], modelled, self.recompute, effort=effort,
                                 warm_start=baselines[best], time_limit_s=time_limit_s)
        solver = SolverReport(result.status, result.solve_s, result.gap, result.n_variables, result.n_constraints)
        found = {name: baselines[name] for name in self.runnable(baselines)}
        if result.bounds:
            found["mip"] = result.bounds
        done = {name: self.finished(b) for name, b in found.items()}
        for name, bounds in other_stage_counts(profile, found, topo.n).items():
            plan = self.finished(bounds)
            if plan[3].feasible:  # (where none is, the error names the MIP's or a baseline's plan)
                found[name], done[name] = bounds, plan
        steps = {name: f[3].step_s if f[3].feasible else float("inf") for name, f in done.items()}
        bounds, solver.chosen = _least_traffic_among_fastest(found, steps, profile, self.micro_batches, topo.n,
                                                             self.recompute)
        times.update((name, t) for name, t in steps.items() if name != "mip")  # as the plans they would be
        return bounds, solver, done


def make_plan(model_name: str, config: GPTConfig, topo: Topology, micro_batch: int, micro_batches: int,
              seq_len: int, precision: str, *, profile: Profile, partitioner: str = "mip", recompute: bool = True,
              keep_where_room: bool = False, stages: int | None = None, effort: int | None = None,
              time_limit_s: float = SAFETY_TIME_LIMIT_S, use_cache: bool = True,
              with_baselines: bool = False, mapping: str = "cross", prefetch: bool = True, optimizer_lag: int = 0,
              device_optimizer: bool = True, data_parallel: int = 1, clip: bool = False, disk: str = "off",
              clip_speculates: bool = False) -> Plan:
    """The plan of one pipeline replica on ``topo``, for ``micro_batches`` (its share of the step),
    from ``profile`` (:func:`mobius.planning.prepare.get_profile`).  With ``data_parallel`` replicas each
    host's optimizer thread sums gradients over the network, updates 1/D of the parameters and
    broadcasts them (:func:`replica_profile`, on ``topo``'s network, else
    :data:`~topology.networks.DEFAULT_NETWORK` assumed), and no stage stays resident (its update
    would need the replicas' sum on the device).  ``disk``: the host stages whose AdamW moments
    wait on disk (``--offload-dir``): ``off``, ``all``, or as many as fitting the host memory takes.
    ``effort``: the partition MIP's (:mod:`mobius.partition.highs`): the plan depends on it, never
    on the machine's load; ``time_limit_s``, the safety net, stops only a solve gone wrong.
    ``clip``: clipping's norm holds the host updates; ``clip_speculates``: it would, but they start
    before it: the plan also states the steps that clip (redone) and those after them (waiting)."""
    check_plannable(model_name, config, topo, precision, stages, optimizer_lag, data_parallel, disk != "off")
    workers = f"the {topo.n} {'CPU workers' if topo.virtual else 'GPUs'} of {topo.name}"
    host_adam = profile.host.adam_params_per_s
    if data_parallel > 1:
        profile = replica_profile(profile, topo, data_parallel)
        device_optimizer = False
    place = MAPPINGS[mapping]
    assumed = place(topo, max(topo.n, stages or 2 * topo.n))
    machine = machine_for(topo, assumed, prefetch, profile.host, optimizer_lag, clip=clip)
    check_layers_fit(profile, machine)
    key = key_of([COST_MODEL_VERSION, profile.to_dict(), topo.to_dict(), micro_batches, partitioner, recompute,
                  keep_where_room, effort, stages, with_baselines, mapping, prefetch, optimizer_lag, device_optimizer,
                  data_parallel, clip, disk, clip_speculates,
                  [asdict(d) for d in topo.drives]])  # (assumed drives too, which the topology's dict leaves out)
    cached = PLANS.get(key, lambda d: Plan.from_dict(d).checked(profile.n, topo.n)) if use_cache else None
    if cached is not None:
        return cached
    search = _Search(profile, config, topo, micro_batches, precision, recompute, keep_where_room, prefetch,
                     optimizer_lag, clip, device_optimizer, place)
    # The baselines choose their stage counts on the contention of the best one's schedule; each
    # is then timed under its own.
    baselines, settled_of = search.candidates(machine, assumed)
    first = min(search.runnable(baselines), key=lambda name: settled_of[name][1].step_s)
    baselines, settled_of = search.candidates(settled_of[first][0], assumed)
    times = {name: est.step_s for name, (_, est) in settled_of.items()}
    solver = None
    if stages is not None:
        bounds, partitioner = uniform_bounds(profile.n, stages), f"uniform-{stages}"
    elif partitioner == "mip":
        bounds, solver, done = search.race(baselines, settled_of, times, effort, time_limit_s)
    else:
        bounds = baselines[partitioner]
    if len(bounds) < topo.n:
        raise InputError(f"the {partitioner} partition has {len(bounds)} stages, fewer than {workers}: every "
                         "worker needs a stage (use --stages or fewer workers)")
    est = evaluate(profile, bounds, machine, micro_batches, recompute)
    if not est.feasible:
        raise DoesNotFit(f"the {partitioner} partition does not fit: {est.reason}", est.reason)
    placed, resident, machine, est = done[solver.chosen] if solver is not None else search.finished(bounds)
    kept = search.kept(bounds, placed, resident, machine) if recompute and keep_where_room else ()
    if kept:
        machine, est = search.settled(bounds, placed, resident, kept)
    on_disk, masters, weights, drives = [], [], [], (0.0, 0.0)
    if disk != "off":
        costs = stage_costs(profile, bounds, recompute, resident, kept)
        # The stages resident on their GPUs keep their AdamW state there: the host never makes theirs.
        need = host_bytes_needed(config, precision, optimizer_lag, data_parallel, data_parallel) - sum(
            c.grad_bytes // element_bytes(profile.dtype) * ADAM_STATE_BYTES for c in costs if c.resident)
        tied = {0, len(bounds) - 1} if config.tie_embeddings else set()  # the host sums their gradients
        excess = need - topo.host_memory_gb * GB if disk == "fit" else math.inf
        on_disk, masters, weights = disk_stages(
            costs, element_bytes(profile.dtype), data_parallel, excess, master_bytes_freed(precision, optimizer_lag),
            frozenset(tied), weights=optimizer_lag == 0 and data_parallel == 1, workers=topo.n)
        drives = topo.drive_gbps()
        machine = replace(machine, on_disk=tuple(on_disk), masters_on_disk=tuple(masters),
                          disk_s_per_byte=topo.n * max(1 / drives[0], 1 / drives[1]) / GB,
                          weights_on_disk=tuple(weights), disk_read_s_per_byte=topo.n / drives[0] / GB)
        est = evaluate(profile, bounds, machine, micro_batches, recompute, resident, kept)
    # The step the plan states is the simulator's, where it models the plan (not state on disk):
    # one answer to "how long" for a plan, the schedule choice and the plan check; the cost model
    # (modelled_step_s) is what the search compared candidates by.
    simulated = search.simulated(bounds, placed, resident, kept, machine) if not on_disk else math.inf
    plan = _assembled(search, bounds, placed, resident, kept, machine, est, host_adam, data_parallel, simulated,
                      model_name=model_name, topology=topo.name, micro_batch_size=micro_batch,
                      micro_batches=micro_batches, seq_len=seq_len, precision=precision, recompute=recompute,
                      partitioner=partitioner, solver=solver, baselines=times if with_baselines else {},
                      mapping=mapping, prefetch=prefetch, disk_stages=on_disk, disk_masters=masters,
                      disk_weights=weights, disk_gbps=drives)
    if clip_speculates and not on_disk:
        # A step that clips has its updates taken back, then redone after its norm: a step whose
        # updates wait for the norm, and the busiest worker's rollbacks before them.
        waiting = search.simulated(bounds, placed, resident, kept, machine, clip=True)
        plan = replace(plan, waiting_step_s=waiting,
                       clipped_step_s=waiting + ROLLBACK_PASSES * plan.host_adam_s())
    if use_cache:
        PLANS.put(key, plan.to_dict())
    return plan


def _assembled(search: _Search, bounds, placed, resident, kept, machine: Machine, est, host_adam: float,
               data_parallel: int, simulated_s: float, model_name: str, **fields) -> Plan:
    """The plan of the chosen partition, as its finished candidate made it: the stage table, the
    lanes' floors (with the network's between replicas) and what the prediction assumed; its step
    is ``simulated_s`` where that is finite, else the cost model's."""
    profile, topo, micro_batches = search.profile, search.topo, search.micro_batches
    stage_plans = [StagePlan(j, (c.start, c.end), placed.gpu_of_stage(j), c.param_bytes, c.fwd_s * 1e3,
                             c.bwd_s * 1e3, est.prefetch_fwd[j], est.prefetch_bwd[j], c.mem_fwd, c.mem_bwd,
                             c.grad_bytes)
                   for j, c in enumerate(est.stages)]
    costs = stage_costs(profile, bounds, search.recompute, resident, kept)
    floor = step_bounds(costs, micro_batches, topo.n, pcie_bps(topo), host_adam * data_parallel,
                        element_bytes(profile.dtype))
    network = assumed_network(topo)
    if data_parallel > 1:  # every worker's sums and broadcasts share the node's one network link
        params = sum(c.offloaded_bytes for c in costs) / element_bytes(profile.dtype)
        floor[Lane.NETWORK] = 2 * exchanged_bytes(params, data_parallel) / (network.bandwidth_gbps * GB)
    elt = element_bytes(profile.dtype)
    disk_bytes = sum(costs[j].grad_bytes // elt * disk_bytes_per_param(machine, j, elt)
                     // data_parallel for j in fields.get("disk_stages", ()))
    if disk_bytes:  # every worker's state read and written through the drives (reads beside writes)
        read, write = fields["disk_gbps"]
        weights = fields.get("disk_weights", ())
        state = disk_bytes - sum(costs[j].grad_bytes for j in weights)  # the weights' file is written, not read
        loads = sum(costs[j].grad_bytes * (1 if j >= len(costs) - topo.n else 2) for j in weights)
        floor[Lane.DISK] = max((state + loads) / (read * GB), disk_bytes / (write * GB))
    return Plan(model=model_name, bounds=bounds, order=list(placed.order), contention=placed.contention,
                disk_bytes=disk_bytes, predicted_step_s=simulated_s if math.isfinite(simulated_s) else est.step_s,
                modelled_step_s=est.step_s, simulated=math.isfinite(simulated_s), stages=stage_plans,
                profile_source=profile.source,
                host_costs=asdict(profile.host), lane_floor_s=floor, resident=list(resident), kept=list(kept),
                recomputation_s=recomputation_s(costs, micro_batches, topo.n),
                device_adam_params_per_s=machine.device_adam_params_per_s, data_parallel=data_parallel,
                network=network.name if data_parallel > 1 else "", optimizer_lag=search.optimizer_lag, **fields)
