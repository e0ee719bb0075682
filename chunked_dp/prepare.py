"""A chunked data-parallel run, decided before any worker starts: the refusals, Elixir's search
(:mod:`chunked_dp.search`), the micro-batches per pass, the step's prediction by lane and, under
``--emulate``, the emulated GPUs' timing.  The launcher prints the result with its reasons."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from chunked_dp.cache import count_replacements
from chunked_dp.chunks import chunks_of_layers, pack, step_access_order, trace_first_use
from chunked_dp.search import DoesNotFit, search
from mobius.boundary.errors import InputError
from mobius.config import RunConfig
from mobius.models import GPTConfig, build_model
from mobius.models.precision import DTYPES
from mobius.partition.profile import Profile
from mobius.planning.prepare import (
    Decided,
    budgets_of,
    check_run_inputs,
    emulation_spec,
    get_profile,
)
from mobius.runtime.spec import ChunkedSetup, RunSpec, Timing
from topology import Topology, cpu_topology

# What one pass's activations (every layer's input of its micro-batches, their gradients and one
# layer's autograd graph) may take of a GPU's memory; the rest goes to the rCache and resident chunks.
ACTIVATION_SHARE = 0.25


def prepare_chunked(decided: Decided, model_config: GPTConfig) -> RunSpec:
    """The spec of a chunked run: chunk size, rCache blocks and device-resident chunks searched for
    this model and topology (Elixir), unless given; the micro-batches per pass; the prediction.
    ``model_config`` as :func:`mobius.runtime.inputs.check_model_input` checked it, the options as
    :func:`mobius.backends.check_options` checked them."""
    cfg, topo, precision = decided.cfg, decided.topology, decided.precision
    check_run_inputs(cfg, model_config)
    # The GPUs' costs from FLOPs and bytes: the prediction, the passes and the emulated timing use them.
    batch = cfg.batch
    gpu = get_profile(cfg.model, model_config, topo, batch.micro_batch_size, batch.seq_len, precision, "analytic")
    per_worker = cfg.batch.micro_batches // topo.n
    capacity = min(g.memory_gb for g in topo.gpus) * 1e9
    group = micro_batches_per_pass(gpu, per_worker, ACTIVATION_SHARE * capacity)
    use = trace_first_use(model_config)
    try:
        found = search(use, topo, activation_bytes=pass_activation_bytes(gpu, group),
                       cpu_adam_params_per_s=gpu.host.adam_params_per_s)
    except DoesNotFit as err:
        raise InputError(f"--backend chunked: {err}; give more --gpu-mem-gb or a smaller --chunk-size") from None
    chunk_size = cfg.chunked.chunk_size or found.chunk_size
    check_chunk_size(cfg, chunk_size, model_config)
    packed = pack(use, chunk_size, topo.n)
    layer_chunks = chunks_of_layers(packed, use)
    need = max(len(cs) for cs in layer_chunks)
    n_block = cfg.chunked.rcache_blocks or found.n_block
    if n_block < need:
        raise InputError(f"--rcache-blocks {n_block}: a layer of {cfg.model} spans {need} chunks of "
                         f"{packed[0].size} elements; the rCache needs at least {need} blocks")
    rcache = min(n_block, len(packed)) * packed[0].size * DTYPES[precision].itemsize
    if rcache > capacity:
        raise InputError(f"--chunk-size {chunk_size} x --rcache-blocks {n_block} needs {rcache / 1e9:.3g} GB of rCache "
                         f"on each device, more than its {capacity / 1e9:.3g} GB; give fewer or smaller chunks "
                         "(or leave both to the search)")
    offload = cfg.chunked.offload != "off"
    setup = ChunkedSetup(chunk_size=chunk_size, n_chunks=len(packed), n_block=n_block, offload=offload,
                         device_chunks=0 if cfg.chunked.offload == "on" else found.device_chunks, group=group,
                         reasons=found.reasons())
    predicted = predict(setup, gpu, topo, per_worker, layer_chunks, packed[0].size // topo.n,
                        DTYPES[precision].itemsize)
    timing, emulation = None, None
    if cfg.emulation.enabled:
        timing = Timing(tuple((layer.fwd_s, layer.bwd_s) for layer in gpu.layers), gpu.host.device_adam_params_per_s)
        cpu = get_profile(cfg.model, model_config, cpu_topology(topo.n), cfg.batch.micro_batch_size, cfg.batch.seq_len,
                          precision, "measure")
        ratio = _pass_s(cpu) / max(_pass_s(gpu), 1e-12)
        emulation = emulation_spec(cfg, topo, ratio, per_worker * _pass_s(cpu), predicted["step"])
    setup = replace(setup, predicted=predicted, timing=timing)
    return RunSpec(decided.gpus, precision, budgets_of(topo), setup, emulation)


def check_chunk_size(cfg: RunConfig, chunk_size: int, model_config: GPTConfig) -> None:
    """A chunk holds whole parameters; one more than twice the model's size is mostly padding, which
    every device and host would have to allocate (a round number a little above the model is fine)."""
    params = build_model(model_config, device="meta").num_parameters()
    if cfg.chunked.chunk_size is not None and chunk_size > 2 * params:
        raise InputError(f"--chunk-size {chunk_size} is more than twice {cfg.model}'s {params:,} parameters: a "
                         "chunk that size is mostly padding (leave it to the search, or give at most the model's size)")


def _pass_s(profile: Profile) -> float:
    """One micro-batch through every layer: forward, then backward with the layer recomputed."""
    return sum(2 * layer.fwd_s + layer.bwd_s for layer in profile.layers)


def pass_activation_bytes(profile: Profile, group: int) -> float:
    """Device memory of one pass's activations: every layer's input for ``group`` micro-batches,
    their gradients in backward, and the largest layer's autograd graph for one of them."""
    inputs = sum(layer.out_bytes for layer in profile.layers)
    largest = max(layer.out_bytes for layer in profile.layers)
    return group * (inputs + largest) + max(layer.bwd_work_bytes for layer in profile.layers)


def micro_batches_per_pass(profile: Profile, per_worker: int, allowed: float) -> int:
    """The most micro-batches (a divisor of a worker's ``per_worker``) whose activations fit in
    ``allowed`` bytes: every pass gathers each chunk again, so fewer passes move fewer bytes."""
    fitting = [g for g in range(1, per_worker + 1) if per_worker % g == 0
               and pass_activation_bytes(profile, g) <= allowed]
    return max(fitting, default=1)


def predict(setup: ChunkedSetup, profile: Profile, topo: Topology, per_worker: int, layer_chunks: list[list[int]],
            shard: int, dtype_bytes: int) -> dict[str, float]:
    """Busy seconds of one step per lane of a worker, and the step they bound (a prediction from
    the analytic profile; collectives between workers are taken as free, as on NVLink):

    * compute: every micro-batch forward, then backward with its layer recomputed; AdamW of the
      device-resident chunks on the device;
    * h2d: each pass gathers the offloaded chunks it misses in the rCache (Belady over one pass's
      accesses) over the GPU's share of its root complex;
    * d2h: each pass sends every offloaded chunk's gradient shard home;
    * host AdamW: the offloaded shards at the host's rate.  Updates start in the step's last pass,
      once the first offloaded chunk's gradient is home (:func:`_first_update_s`): the host's work
      overlaps the rest of that backward, nothing before it."""
    passes = per_worker // setup.group
    off = setup.n_chunks - setup.chunks_on_device
    misses, _ = count_replacements(step_access_order(layer_chunks), setup.n_block, "belady")
    off_misses = misses * off / setup.n_chunks
    link = min(topo.host_bandwidth_share(i, topo.n) for i in range(topo.n)) * 1e9
    shard_bytes = shard * dtype_bytes
    compute = per_worker * _pass_s(profile) + setup.chunks_on_device * shard / profile.host.device_adam_params_per_s
    h2d = passes * off_misses * shard_bytes / link
    d2h = passes * off * shard_bytes / link
    host_adam = off * shard / profile.host.adam_params_per_s
    first = _first_update_s(profile, layer_chunks, setup, passes) + shard_bytes / link if off else 0.0
    return {"compute": compute, "h2d": h2d, "d2h": d2h, "host AdamW": host_adam,
            "step": max(compute, h2d, d2h, first + host_adam)}


def _first_update_s(profile: Profile, layer_chunks: list[list[int]], setup: ChunkedSetup, passes: int) -> float:
    """Compute before the first offloaded chunk is reduced in the step's last pass: every earlier
    pass, the last one's forward, and its backward (from the last layer) down to that chunk's
    first user.  Chunks past the first ``chunks_on_device`` in first-use order are offloaded."""
    users = Counter(k for chunks in layer_chunks for k in chunks)
    backward = 0.0
    for i in range(len(layer_chunks) - 1, -1, -1):
        layer = profile.layers[i]
        backward += layer.fwd_s + layer.bwd_s  # the recomputed forward, then the backward
        for k in layer_chunks[i]:
            users[k] -= 1
        if any(users[k] == 0 and k >= setup.chunks_on_device for k in layer_chunks[i]):
            break
    forward = sum(layer.fwd_s for layer in profile.layers)
    return setup.group * ((passes - 1) * _pass_s(profile) + forward + backward)
