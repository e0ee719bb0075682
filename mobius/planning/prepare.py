"""Decide once what every backend shares: the topology, the device kind, the precision, the
per-device budgets and the profile of a run are resolved here, before any worker starts; each
backend makes its own decisions from them (the pipeline's plan: :mod:`mobius.planning.pipeline`;
the chunked configuration: :mod:`chunked_dp.prepare`) into the frozen :class:`RunSpec` handed to
every worker (and shown by ``mobius.plan``) as it is.  Nothing downstream picks a default of its own.

The profile (:func:`get_profile`) is measured on this machine's device, with what the runtime
itself costs here (:mod:`mobius.stages.calibrate`, measured by running it), or computed from the
topology's GPUs; the planner takes it as data and runs nothing.  Measured profiles are cached by
(model, micro-batch, sequence, dtype, device, workers) and by what they depend on besides
(:func:`measured_on`: this machine's processor, cores and memory, the device, torch, and our own
code), so a second run with the same settings does not profile again and the same command on the
same machine plans the same.  A profile is measured again when one of those changed, never because
one timing was noisy (a busy moment would otherwise become the plan); the run says so when it
measures."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mobius.boundary.cache import Cache, key_of
from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.models import GPTConfig, layer_count
from mobius.models.precision import default_precision, element_bytes, use_fp16_accumulation
from mobius.partition.profile import (
    GPU_ADAM_PARAMS_PER_S,
    MAX_TIME_S,
    Profile,
    analytic_efficiency,
    analytic_profile,
    host_adam_rate,
    host_update_rate,
    measure_profile,
)
from mobius.planning.planner import available_host_memory
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import (
    CUDA_RESERVE_BYTES,
    cpu_threads_per_worker,
    cuda_available,
    cuda_device_name,
    usable_cores,
)
from mobius.runtime.emulation import EmulationSpec
from mobius.runtime.optim import HostUpdatePath
from mobius.runtime.plan_check import HOST_RATES, PROFILES, host_rate_key
from mobius.stages.calibrate import (CALIBRATION_VERSION, calibration_bytes, finish_early, measure_handoff,
                                     measure_runtime_costs, started_early)
from topology import (ASSUMED_DRIVE_GBPS, Drive, Topology, TopologyError, assumed_network, load_topology,
                      network_of)

GB = 10**9

RUNTIME_COSTS = Cache("runtime", "runtime calibration")
# Part of every measured profile's key: a profile measured by older code (without the runtime's
# costs, or with the host AdamW rate timed on a cache-sized tensor) is measured again.
PROFILE_VERSION = 6


def get_profile(model_name: str, config: GPTConfig, topo: Topology, micro_batch: int, seq_len: int,
                precision: str, how: str = "auto", fresh: bool = False, *,
                path: HostUpdatePath = HostUpdatePath(converts=True, refreshes=True)) -> Profile:
    """``measure`` on this machine's device, ``analytic`` from the topology, or ``auto``: measure
    when the topology is this machine (CPU workers or probed GPUs), else analytic.  ``fresh``:
    measure again, whatever is cached (``--no-cache``).  ``path``: what the run's host updates do
    beside AdamW (:func:`~mobius.planning.pipeline.update_path`; by default a run's without clipping,
    fp16 or replicas: all in one pass), which its host rate covers."""
    if profile_how(config, topo, how) == "analytic":
        gpu = min(topo.gpus, key=lambda g: g.tflops)  # the slowest GPU sets the pace; the host's bandwidth, its AdamW
        profile = analytic_profile(model_name, config, micro_batch, seq_len, gpu.tflops, precision,
                                   analytic_efficiency(gpu.name, micro_batch * seq_len, block_efficiency(topo, gpu))[0],
                                   host_adam_rate(topo.host_memory_bandwidth_gbps, topo.n), device_adam_rate(topo))
        return with_measured_host_rate(with_host_update(profile, path), host_key(topo, measured=False))
    device, workers = _measuring(topo)
    key = profile_key(config, topo, micro_batch, seq_len, precision)
    profile = None if fresh else PROFILES.get(key, lambda d: Profile.from_dict(d).checked(layer_count(config)))
    if profile is None:
        t0 = time.perf_counter()
        print(f"profiling: measuring {model_name}'s layers on this machine's {device} (once for these settings on "
              "this machine and code; cached)", flush=True)
        finish_early()
        profile = measure_profile(model_name, config, micro_batch, seq_len, precision, device, workers=workers,
                                  host_workers=topo.n)
        print(f"profiling: {profile.distinct_measured} distinct of {profile.n} layers timed, host AdamW "
              f"{profile.host.adam_params_per_s / 1e6:,.0f} M parameters/s ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        profile.host = replace(profile.host, **runtime_costs(profile, device, workers))
        PROFILES.put(key, profile.to_dict())
    return with_measured_host_rate(with_host_update(profile, path), host_key(topo, measured=True))


def with_host_update(profile: Profile, path: HostUpdatePath) -> Profile:
    """``profile`` with its host rate the whole host update's by its ``path``, conversions included
    (:func:`mobius.partition.profile.host_update_rate`), not AdamW's alone; a rate a run measured
    (:func:`with_measured_host_rate`) is its update's already."""
    rate = host_update_rate(profile.host.adam_params_per_s, profile.dtype, path)
    elt = element_bytes(profile.dtype)
    one, (first, each) = path.bytes_per_param(elt), path.split_bytes(elt)
    return replace(profile, host=replace(profile.host, adam_params_per_s=rate, split_base=first / one,
                                         split_per_part=each / one))


def block_efficiency(topo: Topology, gpu) -> tuple[int, float] | None:
    """The (tokens, fraction of peak) of a block ``mobius.rates`` measured on ``gpu``, as its
    topology file records it; refused in one line if it is not a measurement."""
    found = gpu.extra.get("block_efficiency")
    if found is None:
        return None
    tokens, fraction = (found.get(k) if isinstance(found, dict) else None for k in ("tokens", "fraction"))
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0
            and isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1):
        raise InputError(f"topology {topo.name}: GPU {gpu.index}'s block_efficiency must be {{\"tokens\": a positive "
                         f"integer, \"fraction\": a number in (0, 1]}}, got {str(found)[:80]}")
    return tokens, float(fraction)


def device_adam_rate(topo: Topology) -> float:
    """The GPUs' AdamW rate (parameters/s) ``mobius.rates`` measured, as the topology file records
    it on each GPU (the slowest counts), else the assumed rate; refused in one line if it is not one."""
    found = [g.extra["adam_params_per_s"] for g in topo.gpus if "adam_params_per_s" in g.extra]
    for rate in found:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
            raise InputError(f"topology {topo.name}: a GPU's adam_params_per_s must be a positive number, got "
                             f"{str(rate)[:40]}")
    return float(min(found)) if found else GPU_ADAM_PARAMS_PER_S


def profile_how(config: GPTConfig, topo: Topology, how: str) -> str:
    """``auto`` resolved: measured when the topology is this machine (CPU workers or probed GPUs)."""
    if how != "auto":
        return how
    return "measure" if (topo.virtual or topo.name == "auto") and config.runnable else "analytic"


def profile_key(config: GPTConfig, topo: Topology, micro_batch: int, seq_len: int, precision: str) -> str:
    """The cache entry of the profile measured on this machine for these settings."""
    # Every worker, CPU or GPU, steps its optimizer on the host's cores: topo.n share them.
    # The GPUs' peaks: fp16 accumulation (resolve_topology) is another profile.
    return key_of([PROFILE_VERSION, config.to_dict(), micro_batch, seq_len, precision, *_measuring(topo), topo.n,
                   measured_on(), sorted({g.tflops for g in topo.gpus})])


def _measuring(topo: Topology) -> tuple[str, int]:
    """(the device a profile for ``topo`` is measured on, the workers sharing it: CPU workers share
    this machine's cores, a GPU is its worker's own)."""
    device = "cuda" if (not topo.virtual and cuda_available()) else "cpu"
    return device, topo.n if device == "cpu" else 1


def host_key(topo: Topology, measured: bool) -> str:
    """Where the host AdamW rate a run measures is kept (:data:`HOST_RATES`): this machine's with
    ``topo.n`` workers sharing its cores, for profiles measured here; else the host of the box
    ``topo`` describes (one planned for, or emulated: its rate is what the topology states, so an
    emulated run measures that box's host)."""
    return this_host_key(topo.n) if measured else host_rate_key({"box": topo.name, "host": topo.to_dict()["host"]},
                                                                 topo.n)


def this_host_key(workers: int) -> str:
    """Where the host AdamW rate of this machine with ``workers`` workers sharing its cores is kept."""
    return host_rate_key(measured_on(), workers)


def with_measured_host_rate(profile: Profile, key: str) -> Profile:
    """``profile`` with the host AdamW rate a run on that host measured (``key``: :func:`host_key`)
    where its plan's was off (:mod:`mobius.runtime.plan_check`): a run is a better measurement than
    the profiler's timing of one tensor, or than the rate a topology assumes."""
    def rate_of(entry: dict) -> float:
        rate = float(entry["adam_params_per_s"])
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"the rate {rate} is not a positive number")
        return rate

    measured = HOST_RATES.get(key, rate_of)
    if measured is None or measured == profile.host.adam_params_per_s:
        return profile
    line = (f"profiling: host AdamW at {measured / 1e6:,.0f} M parameters/s, as measured on this host "
            f"({'assumed' if profile.source.startswith('analytic') else 'timed'} at "
            f"{profile.host.adam_params_per_s / 1e6:,.0f})")
    if line not in _said:  # once, however many plans the command makes
        _said.add(line)
        print(line, flush=True)
    return replace(profile, host=replace(profile.host, adam_params_per_s=measured))


_said: set[str] = set()


def runtime_costs(profile: Profile, device: str, workers: int) -> dict[str, float]:
    """What the runtime itself costs on this machine (:mod:`mobius.stages.calibrate`), as
    :class:`~mobius.partition.profile.HostCosts` fields.  The hand-off of this model's boundary
    activation from one worker to another: on CPU workers the calibrated hand-off plus what gloo
    takes longer for this activation than for the calibration's; on GPUs (whose workers hand off
    through the host alike) gloo's time.  On CPU workers also the runtime's work per micro-batch and
    per stage switch.  The calibration is made once per machine and threads per worker, then cached.
    On GPUs that work is the host's, issued while the device computes: it is not measured there,
    and not charged."""
    gloo = measure_handoff(max(l.out_bytes for l in profile.layers))
    if device != "cpu":
        return {"handoff_s": gloo}
    key = runtime_costs_key(workers)
    costs = RUNTIME_COSTS.get(key, _runtime_costs_of)
    if costs is None:
        t0 = time.perf_counter()
        print(f"calibrating: the runtime's own costs with {workers} worker processes (once per machine; cached)",
              flush=True)
        costs = measure_runtime_costs(workers)
        RUNTIME_COSTS.put(key, costs)
        print(f"calibrating: done ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {**costs, "handoff_s": costs["handoff_s"] + max(0.0, gloo - measure_handoff(calibration_bytes()))}


def runtime_costs_key(workers: int) -> str:
    """The cache entry of the calibration of CPU workers with the threads of one of ``workers``."""
    return key_of([CALIBRATION_VERSION, cpu_threads_per_worker(workers), measured_on()])


@contextlib.contextmanager
def early_calibration(decided: Decided, model_config: GPTConfig):
    """Within the block, the calibration a pipeline run on CPU workers will need (its profile measured
    here, neither it nor the calibration cached) runs in the background
    (:func:`mobius.stages.calibrate.started_early`): the command reads its data meanwhile."""
    cfg, seen = decided.cfg, decided.topology
    needed = (not decided.gpus and not cfg.emulation.enabled and profile_how(model_config, seen, "auto") == "measure"
              and PROFILES.get(profile_key(model_config, seen, cfg.batch.micro_batch_size, cfg.batch.seq_len,
                                           decided.precision), dict) is None
              and RUNTIME_COSTS.get(runtime_costs_key(seen.n), dict) is None)
    with started_early(cpu_threads_per_worker(seen.n)) if needed else contextlib.nullcontext():
        yield


@functools.cache
def measured_on() -> dict:
    """What a measurement depends on besides its settings: this machine (processor, cores, memory,
    GPU), torch, and our code that builds and times the layers and runs the steps."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    root = Path(__file__).parents[1]  # mobius/
    code = hashlib.sha256()
    for f in sorted([*root.glob("models/*.py"), *root.glob("stages/*.py"), *root.glob("swap/*.py"),
                     *root.glob("runtime/device/*.py"), root / "partition" / "profile.py"]):
        code.update(f.name.encode() + f.read_bytes())
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    return {"cpu": cpu, "cores": usable_cores(), "memory_gb": memory_gb, "gpu": cuda_device_name(),
            "torch": torch.__version__, "code": code.hexdigest()[:16]}


def _runtime_costs_of(found: dict) -> dict[str, float]:
    """A cached calibration: each cost a finite number of seconds, at least zero."""
    costs = {k: found[k] for k in ("micro_batch_s", "stage_switch_s", "handoff_s")}
    for k, v in costs.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_TIME_S:
            raise ValueError(f"{k} is {v!r}, not a time")
    return {k: float(v) for k, v in costs.items()}


# What a run with the disk tier leaves of this machine's available memory to everything else on it.
HOST_MEMORY_MARGIN = 0.1


def resolve_topology(cfg: RunConfig) -> Topology:
    try:
        topo = load_topology(cfg.topology, cpu_workers=cfg.cpu_workers, memory_gb=cfg.gpu_mem_gb)
    except TopologyError as err:
        raise InputError(str(err)) from None
    if cfg.gpu_mem_gb is not None:
        for g in topo.gpus:
            g.memory_gb = min(g.memory_gb, cfg.gpu_mem_gb)
    if cfg.optim.fp16_accumulation:  # the peak the run computes at is the one everything plans from
        if topo.virtual:
            raise InputError("--fp16-accumulation is a CUDA GPU's tensor-core mode; these are CPU workers (no NVIDIA "
                             "GPU here): plan a GPU box with --topology PRESET|FILE")
        for g in topo.gpus:
            g.tflops = g.peak_tflops(fp16_accumulation=True)
        topo.name += f" (fp16 accumulation: {', '.join(sorted({f'{g.tflops:g}' for g in topo.gpus}))} TFLOPS)"
    if cfg.host_adam_gbps is not None:
        topo.host_memory_bandwidth_gbps = cfg.host_adam_gbps
    if cfg.host_mem_gb:  # stated (0: as little as the disk tier allows, whatever the host has)
        topo.host_memory_gb = cfg.host_mem_gb
    elif cfg.host_mem_gb is None and cfg.offload_dir and cfg.topology in ("auto", "cpu"):
        available = available_host_memory()  # this machine's, now, less a margin for everything else on it
        if available is not None:
            topo.host_memory_gb = min(topo.host_memory_gb, available / 1e9 * (1 - HOST_MEMORY_MARGIN))
    if cfg.drive_gbps:
        topo.drives = [Drive(f"drive{k}", float(g), float(g)) for k, g in enumerate(cfg.drive_gbps)]
    directories = cfg.offload_dir
    if directories and not topo.drives:  # each directory on a drive of the assumed rate
        topo.drives = [Drive(f"assumed{k}", ASSUMED_DRIVE_GBPS, ASSUMED_DRIVE_GBPS, assumed=True)
                       for k in range(len(directories))]
    if directories and len(topo.drives) != len(directories):
        raise InputError(f"--offload-dir names {len(directories)} "
                         f"{'directory' if len(directories) == 1 else 'directories'}, but the plan is given "
                         f"{len(topo.drives)} drives (the topology's drives or --drive-gbps): name one directory on "
                         "each drive the disk tier uses, in the same order, or state the drives of those directories")
    if cfg.network is not None:
        try:
            topo.network = network_of(cfg.network)
        except TopologyError as err:
            raise InputError(str(err)) from None
    return topo


def resolve_devices(topo: Topology, emulate: bool = False, here: bool = True) -> tuple[bool, Topology]:
    """Whether GPUs compute (``here``: the topology is this machine's and CUDA works here; else on
    the machine the topology describes, wherever the command runs, as ``mobius.plan`` plans it),
    and the topology as the run's devices see it, a copy: on GPUs without the CUDA reserve;
    otherwise CPU workers rehearse its devices (``virtual``: the profile is measured on them,
    unless they ``emulate`` the topology's GPUs)."""
    gpus = not emulate and not topo.virtual and (not here or cuda_available())
    seen = copy.deepcopy(topo)
    seen.virtual = not gpus
    return gpus, reserve_cuda_memory(seen) if gpus else seen


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


def resolve_precision(cfg: RunConfig, gpus: bool) -> str:
    """``--precision`` or the default for the devices."""
    return cfg.optim.precision or default_precision(gpus)


@dataclass(frozen=True)
class Decided:
    """Every decision a run makes from its settings and the machine, made once by :func:`decide`
    (``mobius.train``, ``mobius.plan``, a torchrun worker and the scripts alike, through
    :func:`mobius.backends.resolve`); everything after reads them here and derives none again.
    Sent to workers inside their payload (a replan plans from it)."""

    cfg: RunConfig  # the settings, the precision decided in them (and the steps, once the data is read)
    backend: str  # "pipeline" | "chunked" | "single"
    # The run's devices as they see the topology (:func:`resolve_devices`); None where the backend
    # trains in the command's own process, on this machine's device.
    topology: Topology | None
    gpus: bool  # the devices are GPUs, not CPU workers standing in for them
    replicas: int  # the pipeline's data-parallel replicas (1 for the other backends)

    @property
    def precision(self) -> str:
        return self.cfg.optim.precision

    def with_steps(self, steps: int) -> "Decided":
        """The run's length in steps, where ``--epochs`` gives it: the one decision that needs the
        data (how many steps an epoch takes), made once the data is read."""
        return replace(self, cfg=self.cfg.changed(steps=steps))


def decide(cfg: RunConfig, topo: Topology | None, backend: str, replicated: bool, here: bool = True) -> Decided:
    """The decisions of a run of ``backend`` on ``topo`` (None: in the command's process): whether
    GPUs compute and how its devices see the topology (``here``: on this machine; else on the one
    the topology describes, :func:`resolve_devices`), its precision, its replicas (where the
    backend is ``replicated``), and fp16 accumulation switched on in this process where asked."""
    if topo is None:
        gpus = cuda_available()
    else:
        gpus, topo = resolve_devices(topo, cfg.emulation.enabled, here)
    precision = resolve_precision(cfg, gpus)
    if cfg.optim.fp16_accumulation:
        use_fp16_accumulation(gpus and cuda_available())
    return Decided(cfg.changed(precision=precision), backend, topo, gpus,
                   data_parallel_of(cfg) if replicated else 1)


def budgets_of(topo: Topology) -> tuple[int, ...]:
    return tuple(int(g.memory_gb * GB) for g in topo.gpus)


def check_run_inputs(cfg: RunConfig, model_config: GPTConfig) -> None:
    """The checkpoint to resume, before any worker starts (the data: :func:`mobius.train.run`)."""
    if cfg.checkpoint.resume:
        ck.open_for_resume(cfg, model_config)


# The CPU work must fit this many times into the emulated time it stands for: the margin for noise
# and for the runtime's own work.
EMULATION_MARGIN = 2.0
# An emulated run expected to take longer than this (wall seconds) is refused unless --dilation is given.
MAX_EMULATED_WALL_S = 3600.0


def emulation_spec(cfg: RunConfig, topo: Topology, model_ratio: float, worker_cpu_s: float,
                   predicted_step_s: float, replicas: int = 1, precision: str = "fp32",
                   path: HostUpdatePath = HostUpdatePath(converts=True, refreshes=True)) -> EmulationSpec:
    """The emulated links of ``topo`` and the dilation (see
    :func:`mobius.planning.pipeline.emulation_for`), for a backend whose layers take
    ``model_ratio`` times as long on this machine's CPU as on the emulated GPUs, whose busiest
    worker's CPU work of a step is ``worker_cpu_s``, and whose step is predicted at
    ``predicted_step_s`` of emulated time; ``replicas`` boxes of ``topo`` on its network.  The
    emulated host's update moves what the run's ``path`` moves in ``precision`` at its memory
    bandwidth, as the plan charges it."""
    network = assumed_network(topo)
    # workers per core when all compute at once
    crowding = max(1.0, topo.n * replicas / usable_cores())
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
                         counters="", how=how, floor=step_floor,  # the launcher makes the counters file
                         replicas=replicas, network=network.name, network_bps=network.bandwidth_gbps * GB,
                         host_adam_params_per_s=host_update_rate(host_adam_rate(topo.host_memory_bandwidth_gbps, topo.n),
                                                                 precision, path),
                         disk_bps=tuple(g * GB for g in topo.drive_gbps()) if cfg.offload_dir else
                         (float("inf"), float("inf")))


def _round_up(x: float) -> float:
    """The next of 1, 2, 5, 10, 20, 50, ... at or above ``x``."""
    decade = 10 ** math.floor(math.log10(max(x, 1.0)))
    return next(m * decade for m in (1, 2, 5, 10) if m * decade >= x)
