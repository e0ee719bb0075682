"""Per-layer profile of a layer list: what the partitioner needs to know about each layer.

Two sources produce the same :class:`Profile`:

* :func:`measure_profile` runs each *distinct* layer once (layer similarity: same type, parameter
  shapes and input shape -> same numbers) on CPU (``perf_counter``; working memory from the bytes
  autograd saves) or CUDA (events; the caching allocator's peak counters).  On CPU it measures
  under the workers' conditions: each worker's share of the cores as threads, the other workers
  computing at the same time, the median of several runs; the host's AdamW rate with it.
* :func:`analytic_profile` computes it from FLOPs and bytes for a topology's GPUs, so the paper's
  3B-51B models can be planned on a laptop.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mobius.models import GPTConfig, build_layer, build_model, layer_count
from mobius.models.precision import DTYPES, element_bytes
from mobius.runtime.device import (
    cpu_threads_per_worker,
    memory_allocated,
    peak_memory,
    reset_peak_memory,
    time_per_call,
    usable_cores,
)
from mobius.runtime.optim import HostUpdatePath, UpdateRule, adamw
from mobius.swap.memory import SavedStorages

# The fraction of a GPU's tensor-core peak (the topology's ``tflops``) a training step's layers
# reach, as a function of the tokens of one micro-batch ``t``: ``most * t / (t + half)``.  Small
# micro-batches lose to what does not grow with them (kernel launches, the GEMMs' tails, the
# element-wise kernels between them), so the fraction climbs towards ``most``.  Measured where we
# have measured, on one H100 (989.4 TFLOPS dense BF16) with mobius-3b in bf16 (docs/benchmarks.md):
# plain PyTorch at 1,024 tokens a micro-batch trained at 0.183 of peak counted as this model
# counts (forward FLOPs and twice them backward), 0.199 with its on-device AdamW (~8% of its
# step) taken out; the pipeline's compute-bound step at 4,096 tokens a micro-batch (7.56 s for 32
# micro-batches) puts its layers at 0.41.  The curve through both: most 0.634, half 2,240 tokens.
# Elsewhere an assumption.
MEASURED_EFFICIENCY = {"H100": (0.634, 2240.0)}
ANALYTIC_MFU = 0.5  # assumed where nothing was measured
# Host AdamW rate the analytic model assumes for one worker's optimizer thread when the host's
# memory bandwidth is not known: a fused CPU AdamW on a server socket does about 1e9 parameters/s.
ANALYTIC_ADAM_PARAMS_PER_S = 1.0e9
# AdamW on a GPU (for the stages kept resident there): its memory bandwidth over the 28 bytes AdamW
# moves per fp32 parameter (weights, gradient and two moments read; weights and moments written),
# at the slowest card we target, an RTX 3090's 936 GB/s.  An assumption where nothing was measured:
# a profile measured on a GPU times it there, and ``mobius.rates --write`` records it in a topology.
GPU_ADAM_PARAMS_PER_S = 936e9 / 28
# A fused fp32 AdamW reads the weight, gradient and both moments and writes back the weight and
# the moments: 28 bytes per parameter.  Ours reaches that memory-bandwidth bound with two threads
# (scripts/bench_optimizer.py, docs/benchmarks.md).
ADAM_BYTES_PER_PARAM = 28


def host_update_rate(adam_params_per_s: float, precision: str, path: HostUpdatePath) -> float:
    """The parameters per second a worker's host update covers: its AdamW at ``adam_params_per_s``
    (timed on one fp32 tensor, or assumed from the host's memory bandwidth at
    :data:`ADAM_BYTES_PER_PARAM`), at the same memory bandwidth over what the update moves by its
    ``path`` (in 16 bits the conversions: none beside AdamW's in one pass, 12 bytes a parameter
    converted ahead and refreshed after)."""
    return adam_params_per_s * ADAM_BYTES_PER_PARAM / path.bytes_per_param(element_bytes(precision))


# Where a GPU's curve is not known: the H100's shape, anchored at what was measured.
EFFICIENCY_HALF_TOKENS = 2240.0


def analytic_efficiency(gpu_name: str, tokens: int, measured: tuple[int, float] | None = None) -> tuple[float, str]:
    """(fraction of peak at micro-batches of ``tokens`` tokens, where it comes from) for a GPU of
    this name: :data:`MEASURED_EFFICIENCY`'s curve where known, else :data:`ANALYTIC_MFU`.
    ``measured``: (tokens, fraction) of a block measured on this very GPU (``mobius.rates``), which
    the curve is moved to pass through."""
    most, half, source = ANALYTIC_MFU, None, "assumed"
    for fragment, (most_, half_) in MEASURED_EFFICIENCY.items():
        if fragment in gpu_name:
            most, half, source = most_, half_, f"measured on {fragment}"
    if measured is not None:
        at, fraction = measured
        half = half or EFFICIENCY_HALF_TOKENS
        most, source = fraction * (at + half) / at, f"measured on this GPU at {at} tokens"
    if half is None:
        return most, source
    return min(1.0, most * tokens / (tokens + half)), source


def host_adam_rate(memory_bandwidth_gbps: float | None, workers: int) -> float:
    """One worker's host AdamW rate (parameters/s) when ``workers`` optimizer threads share the
    host's memory bandwidth; the assumed rate where the bandwidth is not known."""
    if not memory_bandwidth_gbps:
        return ANALYTIC_ADAM_PARAMS_PER_S
    return memory_bandwidth_gbps * 1e9 / ADAM_BYTES_PER_PARAM / max(1, workers)


@dataclass
class HostCosts:
    """What the runtime costs beyond the layers, on the machine that runs (cost model, MIP and
    simulator use them).  :func:`measure_profile` measures the host's AdamW rate; the planner adds
    what only running the runtime shows (:mod:`mobius.stages.calibrate`).  An analytic profile
    (a machine we are not on) keeps the zeros."""

    handoff_s: float = 0.0  # an activation from one worker to another, beyond its two copies
    micro_batch_s: float = 0.0  # fixed device time per micro-batch per stage in each pass (the runtime's own work)
    stage_switch_s: float = 0.0  # device time between two passes of one device (the runtime's own work)
    adam_params_per_s: float = ANALYTIC_ADAM_PARAMS_PER_S  # one worker's optimizer thread
    # AdamW on the device that computes (the stages kept resident there): a GPU's, or on CPU
    # workers their own cores', the host's rate
    device_adam_params_per_s: float = GPU_ADAM_PARAMS_PER_S
    # Data-parallel replicas (:mod:`mobius.stages.replicas`): each host updates 1/replicas of the
    # parameters and exchanges every stage's gradients and weights with the others over its node's
    # network (bytes/s each way, shared by the node's workers; unused with one replica).
    replicas: int = 1
    network_bps: float = 0.0
    # A piece whose gradients come home in several parts (the dispatched head's task, split over
    # GPUs) moves more in its update than ``adam_params_per_s``'s path: its update's time over a
    # one-part piece's is ``split_base + (parts - 1) * split_per_part``
    # (:meth:`~mobius.runtime.optim.HostUpdatePath.split_bytes_per_param`, set with the rate).
    split_base: float = 1.0
    split_per_part: float = 0.0

    def split_update_factor(self, parts: int) -> float:
        """How much longer the update of a piece of ``parts`` parts takes than one of one part."""
        return 1.0 if parts <= 1 else self.split_base + (parts - 1) * self.split_per_part


@dataclass
class LayerProfile:
    name: str
    kind: str
    similarity_class: int  # layers with the same class were measured once
    fwd_s: float  # forward time of one micro-batch
    bwd_s: float  # backward time of one micro-batch (without recomputation)
    param_bytes: int  # parameters in the compute dtype (what a stage swap moves)
    out_bytes: int  # boundary activation of one micro-batch (what goes to the next stage)
    fwd_work_bytes: int  # extra device memory while running forward without autograd
    bwd_work_bytes: int  # activations autograd keeps for one micro-batch (forward with grad)
    grad_bytes: int | None = None  # gradients in the compute dtype: the trained parameters (None: all)
    held_bytes: int = 0  # held once per pass of the stage, whatever M (the head's weight-gradient sum)

    @property
    def trained_bytes(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes


@dataclass
class Profile:
    model: str
    micro_batch: int
    seq_len: int
    dtype: str
    source: str  # "measured-cpu", "measured-cuda" or "analytic:<gpu name>"
    layers: list[LayerProfile]
    distinct_measured: int = 0
    profile_seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    host: HostCosts = field(default_factory=HostCosts)

    @property
    def n(self) -> int:
        return len(self.layers)

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs of consecutive layers with equal costs, as ``[start, end)`` ranges.

        The MIP is formulated over runs (how many layers of each run a stage takes), which
        removes the symmetry between identical transformer blocks."""
        out: list[tuple[int, int]] = []
        for i, layer in enumerate(self.layers):
            if out and _same_cost(self.layers[out[-1][0]], layer):
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        d["layers"] = [LayerProfile(**x) for x in d["layers"]]
        d["host"] = HostCosts(**d.get("host", {}))
        return cls(**d)

    def checked(self, layers: int) -> "Profile":
        """This profile, if it can describe a model of ``layers`` layers: times and sizes in range (not
        negative, sizes whole); else a ``ValueError`` saying what is wrong."""
        if self.n != layers:
            raise ValueError(f"it has {self.n} layers, the model {layers}")
        for layer in self.layers:
            for key in ("fwd_s", "bwd_s"):
                if not _number(getattr(layer, key), most=MAX_TIME_S):  # zero: a frozen layer's backward
                    raise ValueError(f"{layer.name}: {key} is {getattr(layer, key)!r}, not a time")
            for key in ("param_bytes", "out_bytes", "fwd_work_bytes", "bwd_work_bytes", "grad_bytes", "held_bytes"):
                value = getattr(layer, key)
                if not (value is None and key == "grad_bytes") and not (_number(value) and value == int(value)):
                    raise ValueError(f"{layer.name}: {key} is {value!r}, not a byte count")
        for key, value in asdict(self.host).items():
            rate = key.endswith("adam_params_per_s")
            most = MAX_AMOUNT if rate or key in ("network_bps", "replicas") else MAX_TIME_S
            if not _number(value, positive=rate or key == "replicas", most=most):
                raise ValueError(f"host cost {key} is {value!r}")
        return self

    def save(self, path: str | os.PathLike) -> None:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        return cls.from_dict(json.loads(Path(path).read_text()))


# Beyond these a cached number is not a measurement (and would overflow the solver's coefficients).
MAX_TIME_S, MAX_AMOUNT = 1e6, 2.0**50  # seconds; bytes or parameters per second


def _number(value, positive: bool = False, most: float = MAX_AMOUNT) -> bool:
    """A number in [0, most] (above zero when ``positive``); not a bool."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= most
    return ok and (value > 0 or not positive)


def _same_cost(a: LayerProfile, b: LayerProfile) -> bool:
    keys = ("kind", "fwd_s", "bwd_s", "param_bytes", "out_bytes", "fwd_work_bytes", "bwd_work_bytes", "grad_bytes",
            "held_bytes")
    return all(getattr(a, k) == getattr(b, k) for k in keys)




def analytic_profile(model_name: str, config: GPTConfig, micro_batch: int, seq_len: int,
                     tflops: float, precision: str = "fp16", efficiency: float = ANALYTIC_MFU,
                     adam_params_per_s: float = ANALYTIC_ADAM_PARAMS_PER_S,
                     device_adam_params_per_s: float = GPU_ADAM_PARAMS_PER_S) -> Profile:
    """Times from FLOPs at ``efficiency`` of ``tflops``; bytes from shapes (no weights allocated);
    the host AdamW at ``adam_params_per_s`` per worker, the GPUs' at ``device_adam_params_per_s``."""
    dtype = DTYPES[precision]
    model = build_model(config, device="meta")
    layers, classes = [], {}
    for i, layer in enumerate(model.layers):
        sig = layer.signature()
        classes.setdefault(sig, len(classes))
        fwd = layer.forward_flops(micro_batch, seq_len) / (tflops * 1e12 * efficiency)
        out = 0 if layer.kind == "head" else layer.output_bytes(micro_batch, seq_len, dtype)
        # Backward: the input's gradient (as much work as forward) plus the weights' (as much
        # again); frozen weights (LoRA's base) need only the former, a frozen embedding neither.
        trains = any(p.requires_grad for p in layer.parameters())
        bwd = (0.0 if i == 0 else fwd) + (fwd if trains and not config.lora_rank else 0.0)
        layers.append(LayerProfile(
            name=f"layers.{i}", kind=layer.kind, similarity_class=classes[sig], fwd_s=fwd, bwd_s=bwd,
            param_bytes=layer.param_bytes(dtype), out_bytes=out,
            fwd_work_bytes=2 * out if layer.kind != "head" else layer.working_bytes(micro_batch, seq_len, dtype),
            bwd_work_bytes=layer.working_bytes(micro_batch, seq_len, dtype), grad_bytes=trained_bytes(layer, dtype),
            held_bytes=layer.held_bytes()))
    return Profile(model=model_name, micro_batch=micro_batch, seq_len=seq_len, dtype=precision,
                   source=f"analytic:{tflops:g}TFLOPS@{efficiency:.3g}", layers=layers, distinct_measured=0,
                   host=HostCosts(adam_params_per_s=adam_params_per_s,
                                  device_adam_params_per_s=device_adam_params_per_s))


def trained_bytes(layer: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the layer's gradients: its trained parameters (under LoRA, the adapters only)."""
    return sum(p.numel() for p in layer.parameters() if p.requires_grad) * dtype.itemsize


class _SavedBytes:
    """Counts the bytes autograd saves for backward as the runtime does (CPU working-memory
    accounting): :class:`~mobius.swap.memory.SavedStorages`."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.total = 0
        self._saved = SavedStorages([layer])

    def pack(self, t: torch.Tensor):
        self.total += self._saved.new_bytes(t)
        return t

    @staticmethod
    def unpack(t):
        return t


def _time(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call: the median of ``repeats`` calls (a busy moment is an outlier, not a cost)."""
    if device.type == "cuda":
        return time_per_call(fn, device, repeats)
    return statistics.median(time_per_call(fn, device, 1) for _ in range(repeats))


@contextmanager
def worker_conditions(device: torch.device, workers: int, busy_work=None):
    """CPU only: this thread computes with one worker's share of the cores while ``workers - 1``
    threads run ``busy_work`` (the other workers computing at the same time)."""
    if device.type != "cpu":
        yield
        return
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker(workers))
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            busy_work()

    others = [threading.Thread(target=keep_busy, daemon=True)
              for _ in range(min(workers, usable_cores()) - 1)] if busy_work else []
    for t in others:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in others:
            t.join()
        torch.set_num_threads(threads_before)


# The tensor the host AdamW rate is timed on: a stage's size, not a cache's.  Weights, gradients and
# both moments of 2**24 fp32 parameters are 256 MB, past any CPU's caches, as the optimizer
# thread's stages are; on 2**21 (32 MB, a few ms a step) an H100 host's rate was timed at a
# fourteenth of what its optimizer thread then did.
ADAM_TIMING_NUMEL = 2**24


def measure_adam_rate(workers: int, numel: int = ADAM_TIMING_NUMEL, repeats: int = 3) -> float:
    """Parameters per second of one worker's AdamW step on the host (the runtime's own, fused), with
    its share of the cores when ``workers`` workers (CPU workers, or one process per GPU) share them."""
    cpu = torch.device("cpu")
    with worker_conditions(cpu, workers):
        return measure_device_adam_rate(cpu, numel, repeats)


def measure_device_adam_rate(device: torch.device, numel: int = ADAM_TIMING_NUMEL, repeats: int = 3) -> float:
    """Parameters per second of AdamW on ``device`` (the stages kept resident there are updated
    so), on a stage-sized tensor."""
    p = torch.nn.Parameter(torch.zeros(numel, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = adamw([{"params": [p], "weight_decay": 0.0}], UpdateRule(lr=1e-3))
    opt.step()
    return numel / _time(opt.step, device, repeats)


def measure_profile(model_name: str, config: GPTConfig, micro_batch: int, seq_len: int,
                    precision: str = "fp32", device: str | torch.device = "cpu", repeats: int = 5,
                    workers: int = 1, host_workers: int | None = None) -> Profile:
    """Run each distinct layer forward and backward (after a warm-up) and record its costs; on CPU
    as one of ``workers`` workers (:func:`worker_conditions`).  The optimizer runs on the host
    whatever computes the layers: its rate is measured with one of ``host_workers`` (default
    ``workers``; on GPUs, one process per GPU) shares of the host's cores."""
    device = torch.device(device)
    dtype = DTYPES[precision]
    t_start = time.perf_counter()
    meta = build_model(config, device="meta")
    measured: dict[tuple, LayerProfile] = {}
    layers = []
    for i in range(layer_count(config)):
        kind = meta.layers[i].kind
        in_shape = (micro_batch, seq_len) if i == 0 else (micro_batch, seq_len, config.hidden)
        sig = (meta.layers[i].signature(), in_shape)
        if sig not in measured:
            measured[sig] = _measure_layer(config, i, micro_batch, seq_len, dtype, device, repeats,
                                           similarity_class=len(measured), workers=workers)
        p = measured[sig]
        layers.append(LayerProfile(**{**asdict(p), "name": f"layers.{i}", "kind": kind}))
    adam = measure_adam_rate(host_workers or workers)
    host = HostCosts(adam_params_per_s=adam, device_adam_params_per_s=adam if device.type == "cpu" else
                     measure_device_adam_rate(device))
    return Profile(model=model_name, micro_batch=micro_batch, seq_len=seq_len, dtype=precision,
                   source=f"measured-{device.type}", layers=layers, distinct_measured=len(measured),
                   profile_seconds=time.perf_counter() - t_start, extra={"workers": workers}, host=host)


def _layer_runs(config: GPTConfig, index: int, b: int, t: int, dtype: torch.dtype, device: torch.device):
    """(layer, input, its call, forward without autograd, forward + backward) of layer ``index``."""
    layer = build_layer(config, index, seed=0).to(device=device, dtype=dtype)
    n = layer_count(config)
    gen = torch.Generator().manual_seed(index)
    if index == 0:
        x = torch.randint(0, config.vocab_size, (b, t), generator=gen).to(device)
    else:
        x = torch.randn(b, t, config.hidden, generator=gen).to(device=device, dtype=dtype)
    targets = torch.randint(0, config.vocab_size, (b, t), generator=gen).to(device)
    run = (lambda inp: layer(inp, targets)) if index == n - 1 else layer

    def forward_no_grad():
        with torch.no_grad():
            return run(x)

    def forward_backward():
        inp = x.detach().requires_grad_(x.is_floating_point())
        out = run(inp)
        if out.requires_grad:  # a frozen embedding under LoRA has no backward
            out.backward(torch.ones_like(out))

    return layer, x, run, forward_no_grad, forward_backward


def time_layer(config: GPTConfig, index: int, b: int, t: int, dtype: torch.dtype, device: torch.device,
               repeats: int, workers: int) -> tuple[float, float]:
    """(forward, forward + backward) seconds of layer ``index`` as one of ``workers`` workers runs it."""
    *_, forward_no_grad, forward_backward = _layer_runs(config, index, b, t, dtype, device)
    busy = _layer_runs(config, index, b, t, dtype, device)[-1] if workers > 1 and device.type == "cpu" else None
    with worker_conditions(device, workers, busy):
        forward_no_grad()
        forward_backward()  # warm-up (allocator, kernels)
        return _time(forward_no_grad, device, repeats), _time(forward_backward, device, repeats)


def _measure_layer(config: GPTConfig, index: int, b: int, t: int, dtype: torch.dtype, device: torch.device,
                   repeats: int, similarity_class: int, workers: int = 1) -> LayerProfile:
    layer, x, run, forward_no_grad, forward_backward = _layer_runs(config, index, b, t, dtype, device)
    n = layer_count(config)
    fwd_s, fwd_bwd_s = time_layer(config, index, b, t, dtype, device, repeats, workers)

    counter = _SavedBytes(layer)
    if device.type == "cuda":
        reset_peak_memory(device)
        base = memory_allocated(device)
        forward_no_grad()
        fwd_work = peak_memory(device) - base
        reset_peak_memory(device)
        forward_backward()
        bwd_work = peak_memory(device) - base
    else:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            inp = x.detach().requires_grad_(x.is_floating_point())
            out = run(inp)
        del out
        bwd_work = counter.total
        fwd_work = 2 * (b * t * config.hidden * dtype.itemsize)
    with torch.no_grad():
        out = run(x)
    out_bytes = out.numel() * out.element_size() if index < n - 1 else 0
    held = layer.held_bytes()  # measured with the one micro-batch's work; a stage holds it once
    return LayerProfile(name=f"layers.{index}", kind=layer.kind, similarity_class=similarity_class,
                        fwd_s=fwd_s, bwd_s=max(fwd_bwd_s - fwd_s, 0.0),
                        param_bytes=layer.param_bytes(dtype), out_bytes=out_bytes,
                        fwd_work_bytes=int(fwd_work), bwd_work_bytes=max(0, int(bwd_work) - held),
                        grad_bytes=trained_bytes(layer, dtype), held_bytes=held)
