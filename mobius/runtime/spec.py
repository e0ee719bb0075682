"""What a run executes, as data: the :class:`Plan` of a pipeline run, the :class:`ChunkedSetup` of a
chunked one, and the :class:`RunSpec` every worker receives, which holds its backend's own setup
(:class:`PipelineSetup`: the plan, with the dispatched shape where that schedule runs; or the
:class:`ChunkedSetup`) and, under ``--emulate``, the :class:`~mobius.runtime.emulation.EmulationSpec`.
Decided by :mod:`mobius.planning.prepare` (and :mod:`mobius.planning.pipeline`,
:mod:`mobius.planning.planner`) or :mod:`chunked_dp.prepare` before any worker starts; plain data
here, so workers need neither the solver nor the profiler to read it, and pickled once, at the
process boundary, inside the worker's payload."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from enum import Enum

from mobius.models.precision import element_bytes
from mobius.runtime.emulation import EmulationSpec


class Lane(str, Enum):
    """A lane of a step's work, whose first-principles floor a plan states (:attr:`Plan.lane_floor_s`)."""

    COMPUTE = "compute"
    PCIE = "PCIe"  # every host<->device copy of the pipeline
    H2D = "h2d"  # the chunked engine's copies to the devices
    D2H = "d2h"  # and from them
    HOST_ADAM = "host AdamW"
    NETWORK = "network"  # between the nodes of data-parallel replicas
    DISK = "disk"  # AdamW's moments to the drives and back (--offload-dir)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# What to do about a step bound by each lane.
HELPS = {Lane.HOST_ADAM: "more tokens per step amortise it",  # (without the lag, the lag too: bound_summary)
         Lane.PCIE: "more micro-batches per step amortise the stage loads",
         Lane.COMPUTE: "the GPUs themselves are the limit",
         Lane.NETWORK: "a faster network between the nodes, or fewer replicas with more micro-batches each",
         Lane.DISK: "more host memory (fewer stages' state on disk), more or faster drives, or more tokens per step"}


@dataclass
class SolverReport:
    """How the partition MIP went, and which partition the plan kept."""

    status: str
    solve_s: float
    gap: float
    variables: int
    constraints: int
    chosen: str = "mip"  # the partition kept: the MIP's, or a baseline's within 1% and moving fewer bytes


@dataclass
class StagePlan:
    index: int
    layers: tuple[int, int]  # [start, end)
    gpu: int
    param_bytes: int
    fwd_ms: float  # per micro-batch
    bwd_ms: float  # per micro-batch, including recomputation
    prefetch_fwd_bytes: float
    prefetch_bwd_bytes: float
    mem_fwd_bytes: int
    mem_bwd_bytes: int
    grad_bytes: int = 0  # the trained parameters' gradients (under LoRA, the adapters')


def runs(stages: list[int]) -> str:
    """Stage numbers as runs: ``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out: list[list[int]] = []
    for s in sorted(stages):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


@dataclass
class Plan:
    model: str
    topology: str
    micro_batch_size: int
    micro_batches: int
    seq_len: int
    precision: str
    recompute: bool
    partitioner: str
    bounds: list[tuple[int, int]]
    order: list[int]  # pipeline slot -> GPU
    contention: float
    # The step: the simulator's timing of the plan (simulated), or where it does not model the plan
    # (state on disk) the cost model's; the cost model's step is what the search compared plans by.
    predicted_step_s: float
    stages: list[StagePlan]
    solver: SolverReport | None = None  # where the MIP partitioned
    profile_source: str = ""
    baselines: dict = field(default_factory=dict)  # partitioner -> predicted step seconds
    mapping: str = "cross"  # how slots were placed on GPUs: cross (Mobius §3.3) or sequential
    prefetch: bool = True  # False (--no-prefetch): a stage loads only once the previous one is released
    host_costs: dict = field(default_factory=dict)  # the HostCosts the prediction assumed
    lane_floor_s: dict[Lane, float] = field(default_factory=dict)  # first-principles floor of each lane's work
    recomputation_s: float = 0.0  # of the compute floor: the forwards the recomputing stages redo
    # Stages kept on their GPUs with their optimizer state, updated there (never swapped), and the
    # rate that AdamW runs at there (mobius.stages.device_optimizer).
    resident: list[int] = field(default_factory=list)
    device_adam_params_per_s: float = 1e12
    # With recompute on: the stages whose activations stay on their GPU anyway (memory has room).
    kept: list[int] = field(default_factory=list)
    # Data-parallel replicas of this plan (one per node), and the network between them.
    data_parallel: int = 1
    network: str = ""
    optimizer_lag: int = 0  # the host's updates overlap the next step's passes (--optimizer-lag)
    # The disk tier (--offload-dir): the stages whose AdamW moments wait on disk, their bytes, and
    # the drives' bandwidth the prediction assumed (GB/s, read and write, all drives).
    disk_stages: list[int] = field(default_factory=list)
    disk_masters: list[int] = field(default_factory=list)  # of those, the stages whose fp32 masters wait there too
    disk_weights: list[int] = field(default_factory=list)  # and of those, the stages whose compute copy does
    disk_bytes: int = 0
    disk_gbps: tuple[float, float] = (0.0, 0.0)
    modelled_step_s: float = 0.0  # the partition MIP's cost model's step of this plan
    simulated: bool = False  # predicted_step_s is the simulator's
    # Where clipping's norm would hold the host updates but they start before it (predicted_step_s
    # is of the steps that keep them): the step after one that clipped, whose updates wait for its
    # norm (simulated), and a step that clips, whose updates are taken back and redone after it.
    waiting_step_s: float | None = None
    clipped_step_s: float | None = None

    def host_adam_s(self) -> float:
        """The busiest worker's host AdamW seconds in a step, as planned: the parameters of its stages
        that swap (resident ones are updated on their GPU) at the rate the plan assumed, but those
        whose state waits on disk (their updates run at the drives' pace)."""
        rate = self.host_costs.get("adam_params_per_s", 0.0)
        if not rate:
            return 0.0
        per_worker: dict[int, float] = {}
        for st in self.stages:
            if st.index not in self.resident and st.index not in self.disk_stages:
                per_worker[st.gpu] = per_worker.get(st.gpu, 0.0) + st.grad_bytes / element_bytes(self.precision) / rate
        return max(per_worker.values(), default=0.0)

    def steps(self) -> StepPrediction:
        """The plan's predicted step, with those of steps that clip and of the steps after them."""
        return StepPrediction(self.predicted_step_s, self.waiting_step_s, self.clipped_step_s)

    def recomputes(self, stage: int) -> bool:
        """Whether stage ``stage``'s backward redoes its forward (the head never does: it runs each
        micro-batch's backward right after its forward)."""
        return self.recompute and stage < len(self.bounds) - 1 and stage not in self.kept

    def recompute_text(self) -> str:
        """``on``, ``off``, or which stages recompute and which keep their activations."""
        if not self.recompute or not self.kept:
            return "on" if self.recompute else "off"
        again = [s for s in range(len(self.bounds)) if self.recomputes(s)]
        return (f"on for stages {runs(again)}, activations kept by stages {runs(self.kept)}" if again
                else f"off (activations kept by stages {runs(self.kept)})")

    def gpu_of_stage(self, stage: int) -> int:
        return self.order[stage % len(self.order)]

    def stages_of_gpu(self, gpu: int) -> list[int]:
        return [s for s in range(len(self.bounds)) if self.gpu_of_stage(s) == gpu]

    def shape(self) -> str:
        """The plan's choices in a few words (a run's header, a switch of plans)."""
        resident = f"; {len(self.resident)} resident" if self.resident else ""
        return (f"{len(self.bounds)} stages ({self.partitioner}{resident}), mapping {self.order}, "
                f"recompute {self.recompute_text()}")

    def same_choices(self, other: "Plan") -> bool:
        """Whether ``other`` runs the same partition, mapping, residency and recomputation."""
        return (self.bounds, self.order, sorted(self.resident), self.recompute, sorted(self.kept)) == \
            (other.bounds, other.order, sorted(other.resident), other.recompute, sorted(other.kept))

    def bound_summary(self) -> str:
        """The first-principles floor beside the prediction, what bounds the step and what would help."""
        lane, floor = max(self.lane_floor_s.items(), key=lambda kv: kv[1])
        lanes = ", ".join(f"{k} {v:.3g} s" + (f" of which recomputation {self.recomputation_s:.3g} s"
                                               if k is Lane.COMPUTE and self.recomputation_s else "")
                          for k, v in sorted(self.lane_floor_s.items(), key=lambda kv: -kv[1]))
        helps = HELPS[lane] + (", and the recomputation their memory forces"
                               if lane is Lane.COMPUTE and self.recomputation_s else "")
        if lane is Lane.HOST_ADAM and not self.optimizer_lag:
            helps = f"--optimizer-lag 1 takes it off the critical path; {helps}"
        return (f"first-principles floor: {floor:.3g} s/step ({lanes}); predicted {self.predicted_step_s / floor:.2f}x "
                f"the floor; bound by {lane} ({floor:.3g} of {self.predicted_step_s:.3g} s): {helps}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["stages"] = [StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in d["stages"]]
        d["bounds"] = [tuple(b) for b in d["bounds"]]
        d["lane_floor_s"] = {Lane(k): v for k, v in d.get("lane_floor_s", {}).items()}
        d["solver"] = SolverReport(**d["solver"]) if d.get("solver") else None
        d["disk_gbps"] = tuple(d.get("disk_gbps", (0.0, 0.0)))
        return cls(**d)

    def checked(self, layers: int, workers: int) -> "Plan":
        """This plan, if it runs a model of ``layers`` layers on ``workers`` workers: its stages
        cover each layer exactly once, in order, each stage on a worker that exists and every
        worker given a stage; else a ``ValueError`` saying what is wrong."""
        ends = [0] + [end for _, end in self.bounds]
        whole = all(type(x) is int for b in self.bounds for x in b)
        if not whole or [start for start, _ in self.bounds] != ends[:-1] or ends[-1] != layers or any(
                end <= start for start, end in self.bounds):
            raise ValueError(f"its stages {self.bounds} do not cover layers 0-{layers - 1} once each, in order")
        if [tuple(s.layers) for s in self.stages] != list(self.bounds):
            raise ValueError("its stage table does not match its stages")
        if sorted(self.order) != list(range(workers)):
            raise ValueError(f"its mapping {self.order} does not give each of {workers} workers a place")
        if not (isinstance(self.predicted_step_s, (int, float)) and 0 < self.predicted_step_s < float("inf")):
            raise ValueError(f"its predicted step {self.predicted_step_s!r} is not a positive time")
        if any(type(s) is not int or not 0 <= s < len(self.bounds) for s in self.resident):
            raise ValueError(f"its resident stages {self.resident} are not stages of it")
        if any(type(s) is not int or not 0 <= s < len(self.bounds) - 1 for s in self.kept):
            raise ValueError(f"its stages that keep their activations {self.kept} are not stages of it before the head")
        return self

    def on_disk_text(self) -> str:
        """What waits on disk, and on what drives."""
        masters = f", the master weights of stages {runs(self.disk_masters)}" if self.disk_masters else ""
        weights = f", the compute weights of stages {runs(self.disk_weights)}" if self.disk_weights else ""
        return (f"AdamW's moments of stages {runs(self.disk_stages)}{masters}{weights} "
                f"({self.disk_bytes / 1e9:.2f} GB) on the drives ({self.disk_gbps[0]:g} GB/s read, {self.disk_gbps[1]:g} GB/s write)")

    def state_home(self, stage: int) -> str:
        """Where stage ``stage``'s fp32 master weights and AdamW state (and, swapped, its compute
        weights) live between updates."""
        if stage in self.resident:
            return "GPU (resident)"
        if stage in self.disk_weights:
            return "disk, disk; weights on disk"
        if stage in self.disk_masters:
            return "disk, disk"
        return "host, disk" if stage in self.disk_stages else "host, host"

    def activations_of(self, stage: int) -> str:
        """What stage ``stage``'s backward starts from: its forward redone (``recomputed``), every
        micro-batch's activations kept on the GPU (``kept``), or, the head, its forward just run."""
        if stage == len(self.bounds) - 1:
            return "1F1B"
        return "recomputed" if self.recomputes(stage) else "kept"

    def render(self) -> str:
        lines = [f"plan: {self.model} on {self.topology}, {self.micro_batches} micro-batches of "
                 f"{self.micro_batch_size}x{self.seq_len}, {self.precision}, recompute {self.recompute_text()}",
                 f"partitioner {self.partitioner}: {len(self.bounds)} stages; mapping slot->GPU {self.order} "
                 f"(Eq. 13 contention {self.contention:.3f})"]
        if self.solver:
            lines.append(f"solver: {self.solver.status} in {self.solver.solve_s:.2f} s, gap {self.solver.gap:.2e}")
        lines.append(f"{'stage':>5} {'layers':>9} {'GPU':>4} {'params MB':>10} {'fwd ms':>8} {'bwd ms':>8} "
                     f"{'prefetch MB f/b':>16} {'mem MB f/b':>14} {'activations':>11}  master, AdamW state")
        for s in self.stages:
            lines.append(f"{s.index:>5} {f'{s.layers[0]}-{s.layers[1] - 1}':>9} {s.gpu:>4} {s.param_bytes / 1e6:>10.1f} "
                         f"{s.fwd_ms:>8.2f} {s.bwd_ms:>8.2f} "
                         f"{f'{s.prefetch_fwd_bytes / 1e6:.0f}/{s.prefetch_bwd_bytes / 1e6:.0f}':>16} "
                         f"{f'{s.mem_fwd_bytes / 1e6:.0f}/{s.mem_bwd_bytes / 1e6:.0f}':>14} "
                         f"{self.activations_of(s.index):>11}  {self.state_home(s.index)}")
        if self.resident:
            lines.append(f"resident: {len(self.resident)} stages stay on their GPUs and are updated there by AdamW "
                         "(no swap, no gradient offload, no host update)")
        if self.disk_stages:
            lines.append(f"disk tier: {self.on_disk_text()}, between updates, streamed in blocks")
        if self.data_parallel > 1:
            lines.append(f"replicas: {self.data_parallel}, one per node, each running this plan on "
                         f"{self.micro_batches} of the step's {self.micro_batches * self.data_parallel} micro-batches; "
                         f"each host sums gradients and broadcasts weights over {self.network} and updates 1/"
                         f"{self.data_parallel} of the parameters (ZeRO-1)")
        tokens = self.micro_batches * self.micro_batch_size * self.seq_len * self.data_parallel
        lines.append(f"predicted step time: {self.predicted_step_s * 1e3:.1f} ms "
                     f"({tokens / self.predicted_step_s:,.0f} tokens/s)")
        if self.steps().clipping:
            lines.append(f"clipping: {self.steps().clipping_text()}")
        if self.solver and self.solver.chosen != "mip":
            lines.append(f"chosen: the {self.solver.chosen} partition, within 1% of the fastest and moving the "
                         "fewest bytes between host and GPUs")
        if self.lane_floor_s:
            lines.append(self.bound_summary())
        if self.baselines:
            lines.append("baselines: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.baselines.items()))
        return "\n".join(lines)


@dataclass(frozen=True)
class Timing:
    """Emulated device time (``--emulate``): per layer, one micro-batch's forward and backward on
    the emulated GPU, and AdamW's rate on the device (parameters/s; the emulated host's is the
    emulation's own, :attr:`~mobius.runtime.emulation.EmulationSpec.host_adam_params_per_s`)."""

    layer_s: tuple[tuple[float, float], ...]
    device_adam_params_per_s: float


@dataclass(frozen=True)
class ChunkedSetup:
    chunk_size: int  # elements per chunk
    n_chunks: int
    n_block: int  # rCache blocks
    offload: bool  # chunks beyond ``device_chunks`` live (master, AdamW) in host memory
    device_chunks: int
    group: int  # micro-batches per pass (each pass gathers a layer's chunks once)
    predicted: dict = field(default_factory=dict)  # lane -> busy seconds of a step, and "step"
    reasons: str = ""  # why the search chose this
    timing: Timing | None = None  # under --emulate

    @property
    def chunks_on_device(self) -> int:
        return self.n_chunks if not self.offload else min(self.device_chunks, self.n_chunks)

    def predicted_step_s(self) -> float:
        return self.predicted["step"]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ChunkedSetup":
        timing = d.get("timing")
        if timing is not None:
            timing = Timing(tuple(tuple(t) for t in timing["layer_s"]), timing["device_adam_params_per_s"])
        return cls(**{**d, "timing": timing})


@dataclass(frozen=True)
class DispatchedShape:
    """The dispatched schedule a run executes, as the plan chose it, and the time of each task's
    micro-batch on the GPUs it was planned for (what an emulated GPU takes) and the memory it works
    in (empty: not planned, as in tests)."""

    forward: list[tuple[int, int]]  # the forward stages' [start, end) layers
    backward: list[tuple[int, int]]  # the backward stages'; the last lies within the last forward stage
    order: list[int]  # the GPUs in turn
    kept: int = 0
    head_gpus: int = 1
    forward_s: list[float] = field(default_factory=list)  # a micro-batch's forward, per forward stage
    backward_s: list[float] = field(default_factory=list)  # its backward (recomputation in it), per backward stage
    # The device memory each pass works in beyond its weights (a kept stage's: one micro-batch's).
    forward_bytes: list[int] = field(default_factory=list)
    backward_bytes: list[int] = field(default_factory=list)
    # Kept stages that stay on one GPU with their AdamW state, updated there: (forward stage, GPU).
    resident: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if not valid_partitions(self.forward, self.backward, self.kept):
            raise ValueError(f"backward partition {self.backward} does not fit forward partition {self.forward} "
                             f"with {self.kept} kept stages")
        kept = range(len(self.forward) - 1 - self.kept, len(self.forward) - 1)
        if any(j not in kept for j, _ in self.resident):
            raise ValueError(f"resident stages {[j for j, _ in self.resident]} are not among the kept stages {list(kept)}")

    def describe(self) -> str:
        """In a run's header."""
        resident = f" ({len(self.resident)} resident, updated on their GPUs)" if self.resident else ""
        return (f"{len(self.forward)} forward / {len(self.backward)} backward stages, the head's task on "
                f"{self.head_gpus} GPU{'s' if self.head_gpus > 1 else ''}, {self.kept} kept{resident}, GPUs in "
                f"turn {self.order}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DispatchedShape":
        return cls(**{**d, "forward": [tuple(b) for b in d["forward"]], "backward": [tuple(b) for b in d["backward"]],
                      "resident": [tuple(r) for r in d.get("resident", [])]})


def valid_partitions(forward: list[tuple[int, int]], backward: list[tuple[int, int]], kept: int = 0) -> bool:
    """Both cover the same layers, the head's backward lies within the last forward stage, and the
    ``kept`` forward stages before it are backward stages too."""
    return (forward[0][0] == backward[0][0] and forward[-1][1] == backward[-1][1]
            and backward[-1][0] >= forward[-1][0] and kept < min(len(forward), len(backward))
            and all(forward[-1 - k] == backward[-1 - k] for k in range(1, kept + 1)))



@dataclass(frozen=True)
class StepPrediction:
    """A schedule's predicted step; where its host updates start before clipping's norm (the step
    is of steps that keep them), also the step after one that clipped, whose updates wait for its
    norm, and a step that clips, whose updates are taken back and redone after it."""

    step_s: float
    waiting_step_s: float | None = None
    clipped_step_s: float | None = None

    @property
    def clipping(self) -> bool:
        return self.waiting_step_s is not None and self.clipped_step_s is not None

    def step_of(self, clipped: bool, after_clipped: bool) -> float:
        """The predicted step of a step that clipped or not, after one that clipped or not."""
        if not self.clipping:
            return self.step_s
        return self.waiting_step_s if after_clipped else self.clipped_step_s if clipped else self.step_s

    def median_step_of(self, clipped: list[bool]) -> float:
        """The median predicted step of a run of steps, each but the first (which only says whether
        the next one waits) by whether it and the one before clipped (:meth:`step_of`)."""
        return statistics.median(self.step_of(now, before) for before, now in zip(clipped, clipped[1:]))

    def clipping_text(self) -> str:
        """Where the host updates start before clipping's norm: what a step that clips costs, and the
        step after it (empty otherwise)."""
        if not self.clipping:
            return ""
        return (f"the updates start before the step's norm; predicted, a step that clips "
                f"{self.clipped_step_s * 1e3:.1f} ms (its updates redone), the step after it "
                f"{self.waiting_step_s * 1e3:.1f} ms (waiting for its norm)")


@dataclass(frozen=True)
class PipelineSetup:
    """The pipeline backend's own part of a run's spec (:func:`mobius.planning.pipeline.prepare_pipeline`)."""

    plan: Plan  # the bound plan: it runs, or its prediction stands beside the dispatched shape that does
    data_parallel: int = 1  # replicas (mobius.stages.replicas); the plan is one replica's
    # The cache entry where the run keeps the host AdamW rate it measures when its plan was off
    # (mobius.runtime.plan_check); empty where the host is not this machine's own (emulated).
    host_rate_key: str = ""
    # The cache entry of the layer profile the plan was made from, where it was measured on this
    # machine: forgotten when the run's compute is faster than it says (measured on a busy machine).
    profile_key: str = ""
    # --schedule dispatched (or auto, where it is predicted faster): the shape that runs instead of
    # ``plan``, and its predicted steps.
    dispatched: DispatchedShape | None = None
    dispatched_steps: StepPrediction | None = None
    schedule: str = ""  # which schedule runs and why (mobius.planning.pipeline.choose_schedule), for the header

    def predicted(self) -> StepPrediction:
        """The steps of the schedule that runs."""
        return self.dispatched_steps if self.dispatched is not None else self.plan.steps()

    def predicted_step_s(self) -> float:
        return self.predicted().step_s


@dataclass(frozen=True)
class RunSpec:
    """What every worker of a run executes (pickled once into its payload): its devices, and its
    backend's own setup, which says which backend it is."""

    cuda: bool  # real GPUs, or CPU workers standing in for the topology's devices
    precision: str  # "fp32" | "bf16" | "fp16"
    budget_bytes: tuple[int, ...]  # per device
    setup: PipelineSetup | ChunkedSetup
    emulation: EmulationSpec | None = None  # --emulate

    def collectives(self) -> str:
        """The process group's backends.  On GPUs the chunked engine's collectives of device chunks
        go through NCCL, those of offloaded chunks (host memory) through gloo: NCCL has no CPU
        tensors.  The pipeline's activations cross host memory (no peer-to-peer): gloo moves them."""
        return "cuda:nccl,cpu:gloo" if self.cuda and isinstance(self.setup, ChunkedSetup) else "gloo"

    def enforced_budget(self, gpu: int) -> int | None:
        """The device memory GPU ``gpu`` (counted over every replica's box) is held to: the plan's
        budget for a pipeline; the chunked engine keeps within its budget by the sizes its search
        chose."""
        return self.budget_bytes[gpu % len(self.budget_bytes)] if isinstance(self.setup, PipelineSetup) else None

    def first_gpu(self, rank: int) -> int:
        """The first GPU (counted over every replica's box) process ``rank`` drives: a bound
        worker drives one, the dispatched schedule's process every GPU of its box."""
        dispatched = isinstance(self.setup, PipelineSetup) and self.setup.dispatched is not None
        return rank * len(self.budget_bytes) if dispatched else rank

    def predicted_step_s(self) -> float:
        """The step the run was planned to take (on the devices it emulates, if it does)."""
        return self.setup.predicted_step_s()
