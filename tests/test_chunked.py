"""chunked_dp: replacement policies, chunk packing, the search, and equivalence with the reference."""

import random
import threading
from dataclasses import replace

import pytest
import torch

from conftest import reference

from chunked_dp.cache import count_replacements
from chunked_dp.chunks import chunks_of_layers, pack, step_access_order, trace_first_use
from chunked_dp.search import allowed_memory, benefits, search
from mobius.backends import resolve
from mobius.backends.chunked import launch_chunked
from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.models import get_config
from mobius.runtime.optim import UpdateRule
from topology import cpu_topology, load_preset


def test_fig4_two_interleaved_chunks_one_block_three_replacements():
    # w1, w3 in chunk 0 and w2, w4 in chunk 1, used in the order w1 w2 w3 w4 (Elixir-000 Fig. 4).
    for policy in ("belady", "lru", "fifo"):
        assert count_replacements([0, 1, 0, 1], 1, policy)[1] == 3


def test_belady_never_worse_than_lru_or_fifo_on_recorded_traces():
    rng = random.Random(0)
    trace = trace_first_use(get_config("tiny8"))
    chunks = pack(trace, 30_000, 1)
    real = step_access_order(chunks_of_layers(chunks, trace)) * 3
    traces = [real] + [[rng.randrange(9) for _ in range(200)] for _ in range(5)]
    for order in traces:
        for blocks in (2, 3, 5):
            belady = count_replacements(order, blocks, "belady")[1]
            assert belady <= count_replacements(order, blocks, "lru")[1]
            assert belady <= count_replacements(order, blocks, "fifo")[1]


def test_packing_follows_first_use_and_handles_the_tied_weight():
    import dataclasses
    tied = dataclasses.replace(get_config("tiny"), tie_embeddings=True)
    trace = trace_first_use(tied)
    assert trace.order[0][0] == "layers.0.wte.weight"
    assert "layers.5.lm_head.weight" not in [n for n, _ in trace.order]  # the same parameter as wte
    assert "layers.0.wte.weight" in trace.layer_params[-1]  # the head uses it too
    chunks = pack(trace, 1, 4)  # raised to the largest parameter, rounded to the world size
    assert all(c.size % 4 == 0 and c.used <= c.size for c in chunks)
    wte_chunk = next(c for c in chunks if any(p.name == "layers.0.wte.weight" for p in c.params))
    assert wte_chunk.layers == [0, 5]  # reduced only after both users ran backward


def test_search_formulas_and_configuration():
    assert allowed_memory(40e9, 1e9, 4e9) == pytest.approx(0.95 * (40e9 - 1e9 - 1.25 * 4e9))
    i_n, j_n = benefits(1e6, 8, 100e9, 100e9, 1e9, 50e9)
    assert i_n == pytest.approx(2e6 / 100e9)
    assert j_n > i_n  # with fast NVLink-era links, keeping chunks on the device pays more
    trace = trace_first_use(get_config("gpt2"))
    dgx = search(trace, load_preset("dgx-a100"))
    assert dgx.device_fraction == 1.0  # 124M parameters fit on 8 x 40 GB
    tight = search(trace, cpu_topology(1, memory_gb=1.0))
    assert tight.device_fraction < 1.0 and tight.n_block >= 1


CASES = [
    # workers, chunk size (elements), rCache blocks, offload, prefetch
    (1, 250_000, 1, "on", True),  # the whole model in one chunk, one block
    (2, 20_000, 4, "on", False),  # the smallest rCache for 20k-element chunks (a layer spans 4)
    (2, 20_000, 8, "on", True),  # room to prefetch the next layer's chunks
    (2, 20_000, 64, "off", True),  # rCache holds every chunk
    (4, 60_000, 2, "off", False),
]


@pytest.mark.slow
@pytest.mark.parametrize("workers,chunk,blocks,offload,prefetch", CASES)
def test_chunked_equals_reference(workers, chunk, blocks, offload, prefetch):
    cfg = RunConfig.of(model="tiny", backend="chunked", topology="cpu", cpu_workers=workers, steps=4, micro_batch_size=2,
                       micro_batches=4, seq_len=32, lr=3e-3, chunk_size=chunk, rcache_blocks=blocks, offload=offload,
                       chunk_prefetch=prefetch, progress=False)
    ref_losses, ref_weights = reference(cfg, precision="fp32")
    history, weights, results = launch_chunked(resolve(cfg, cpu_topology(workers), "chunked"), get_config("tiny"),
                                               return_weights=True)
    for m, r in zip(history, ref_losses, strict=True):
        assert abs(m.loss - r) / r < 1e-5
    for name, w in weights.items():
        ref = ref_weights[name].detach()
        assert ((w - ref).norm() / ref.norm()).item() < 1e-5, name
    assert (history[-1].h2d_bytes > 0) == (offload == "on")
    if prefetch and blocks >= 8:
        assert results[0].report.counters["prefetched"] > 0


@pytest.mark.slow
def test_gather_and_reduce_volume_at_rcache_max_and_min():
    """Elixir Table 1.  rCache-max moves 2·L_c·S per step: each chunk is gathered once and reduced
    once, like ZeRO-2.  rCache-min gathers again in backward every chunk not resident when forward
    ends: (3 - n_block/n_chunks)·L_c·S, tending to ZeRO-3's 3·L_c·S as the model outgrows the
    cache.  Table 1's 4·L_c·S adds the gather of Elixir's whole-segment recomputation; our
    per-layer recomputation runs while the layer's chunks are still pinned, so it needs none."""
    volumes, chunks = {}, {}
    for name, blocks in (("max", 64), ("min", 2)):  # 2: the most chunks one layer spans
        cfg = RunConfig.of(model="tiny", backend="chunked", topology="cpu", cpu_workers=2, steps=1, micro_batch_size=2,
                           micro_batches=2, seq_len=32, chunk_size=60_000, rcache_blocks=blocks, offload="off",
                           progress=False)
        _, _, results = launch_chunked(resolve(cfg, cpu_topology(2), "chunked"), get_config("tiny"),
                                       return_weights=True)
        c = results[0].report.counters
        s_bytes = results[0].report.chunks * results[0].report.chunk_size * 4  # fp32 compute here: L_c = 4
        volumes[name] = ((c["gather_bytes"] + c["reduce_bytes"]) / s_bytes, c["reduce_bytes"] / s_bytes)
        chunks[name] = results[0].report.chunks
    assert volumes["max"] == (pytest.approx(2.0), pytest.approx(1.0))
    assert volumes["min"] == (pytest.approx(3.0 - 2 / chunks["min"]), pytest.approx(1.0))


@pytest.mark.slow
def test_chunked_checkpoint_resumes_exactly_on_another_backend(tmp_path):
    from mobius.train import main

    args = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "6", "--no-progress"]
    main(args + ["--backend", "chunked", "--topology", "cpu", "--cpu-workers", "2", "--chunk-size", "20000",
                 "--rcache-blocks", "8", "--stop-after", "3", "--save", str(tmp_path / "ck"),
                 "--metrics", str(tmp_path / "c.jsonl")])
    main(args + ["--backend", "single", "--resume", str(tmp_path / "ck"), "--metrics", str(tmp_path / "c.jsonl")])
    main(args + ["--backend", "single", "--metrics", str(tmp_path / "s.jsonl")])
    import json
    a = [json.loads(line)["loss"] for line in open(tmp_path / "c.jsonl")]
    b = [json.loads(line)["loss"] for line in open(tmp_path / "s.jsonl")]
    assert len(a) == 6 and all(abs(x - y) / y < 1e-5 for x, y in zip(a, b))


@pytest.fixture
def one_rank_group():
    """A process group of this process alone: the engine's collectives run in-process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_engine_in_passes_with_mixed_placement_equals_the_reference(one_rank_group):
    """In-process: two passes of two micro-batches, 2 of the chunks on the device and the rest
    offloaded through the copy streams and the optimizer thread, under the stream checker with
    jittered streams; losses and weights equal the reference's, and each pass moves each
    offloaded chunk's gradient home once."""
    from chunked_dp.engine import ChunkedEngine
    from mobius.runtime.device import CpuDevice

    cfg = RunConfig.of(model="tiny", steps=3, micro_batch_size=2, micro_batches=4, seq_len=32, lr=3e-3, progress=False)
    ref_losses, ref_weights = reference(cfg, precision="fp32")
    device = CpuDevice(check=True, jitter_ms=1.0)
    engine = ChunkedEngine(get_config("tiny"), 0, 1, device, chunk_size=20_000, n_block=4, offload=True,
                           device_chunks=2, compute_dtype=torch.float32, seed=cfg.optim.seed, rule=UpdateRule.of(cfg.optim),
                           group=2)
    batches = BatchSource(load_corpus(None), cfg.batch.seq_len, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.optim.seed)
    try:
        for k, r in enumerate(ref_losses):
            m = engine.step(k, batches)
            assert abs(m.loss - r) / r < 1e-5
            offloaded = len(engine.chunks) - 2
            assert m.d2h_bytes == 2 * offloaded * engine.shard * 4  # two passes, one shard each
        for name, w in engine.state_dict().items():
            ref = ref_weights[name].detach()
            assert ((w - ref).norm() / ref.norm()).item() < 1e-5, name
    finally:
        engine.close()
        device.close()


def test_backward_does_not_wait_for_the_host_adamw_of_earlier_chunks(one_rank_group):
    """Every chunk offloaded, the host's AdamW held back: backward reduces each chunk and sends its
    gradient home as soon as its layers are done.  The two staging buffers are handed back
    once a gradient is added to its fp32 master, not after that chunk's AdamW, so the third chunk's
    gradient is on its way before the first chunk's update ends (before, backward stalled there)."""
    from chunked_dp.engine import ChunkedEngine
    from mobius.runtime.device import CpuDevice

    cfg = RunConfig.of(model="tiny", steps=1, micro_batch_size=2, micro_batches=2, seq_len=32, progress=False)
    device = CpuDevice(check=True)
    engine = ChunkedEngine(get_config("tiny"), 0, 1, device, chunk_size=20_000, n_block=4, offload=True,
                           device_chunks=0, compute_dtype=torch.float32, seed=cfg.optim.seed,
                           rule=replace(UpdateRule.of(cfg.optim), steps=1), group=2)
    events = []  # ("reduced" | "updated", chunk), in the order they happened
    three_reduced = threading.Event()
    reduce, update = engine.reduction.reduce, engine.reduction.update

    def held_update(k, stream):
        # The host's update waits until backward has reduced three chunks: a backward that waited
        # for an update would stall here, and the wait's minute would end in the wrong order.
        three_reduced.wait(60)
        update(k, stream)
        events.append(("updated", k))

    def noted_reduce(k, last):
        reduce(k, last)
        events.append(("reduced", k))
        if sum(e == "reduced" for e, _ in events) == 3:
            three_reduced.set()

    engine.reduction.update, engine.reduction.reduce = held_update, noted_reduce
    batches = BatchSource(load_corpus(None), cfg.batch.seq_len, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.optim.seed)
    try:
        engine.step(0, batches)
        reduced = [k for e, k in events if e == "reduced"]
        assert len(reduced) >= 3 and sorted(k for e, k in events if e == "updated") == sorted(reduced)
        assert events.index(("reduced", reduced[2])) < events.index(("updated", reduced[0]))
    finally:
        engine.close()
        device.close()


def test_one_emulated_gpu_holding_every_chunk_sends_nothing_over_its_link(one_rank_group, tmp_path):
    """One emulated GPU with every chunk on it and a 4-block rCache: each gather copies a device
    shard into a block, device memory to device memory, so a step crosses no PCIe link (a gather
    timed as a host-to-device copy made the emulated step 1.8x its prediction)."""
    from chunked_dp.engine import ChunkedEngine
    from mobius.runtime.device import CpuDevice
    from mobius.runtime.emulation import EmulatedLinks, EmulationSpec, create_counters

    path = str(tmp_path / "counters")
    create_counters(path, 1)
    links = EmulatedLinks(EmulationSpec("one GPU", 1.0, (1e12,), (0,), {"0": 1e12}, path), 0)
    crossed = []
    through = links.transfer
    links.transfer = lambda nbytes, direction, copy: (crossed.append(direction), through(nbytes, direction, copy))
    device = CpuDevice(check=True, emulation=links)
    cfg = RunConfig.of(model="tiny", steps=1, micro_batch_size=2, micro_batches=2, seq_len=32, progress=False)
    engine = ChunkedEngine(get_config("tiny"), 0, 1, device, chunk_size=20_000, n_block=4, offload=False,
                           device_chunks=0, compute_dtype=torch.float32, seed=cfg.optim.seed,
                           rule=replace(UpdateRule.of(cfg.optim), steps=1), group=2)
    batches = BatchSource(load_corpus(None), cfg.batch.seq_len, cfg.batch.micro_batch_size, cfg.batch.micro_batches, cfg.optim.seed)
    try:
        m = engine.step(0, batches)
        assert len(engine.chunks) > 4 and m.h2d_bytes == m.d2h_bytes == 0
        assert crossed == []
    finally:
        engine.close()
        device.close()


def test_the_host_updates_start_once_the_first_offloaded_gradient_is_reduced():
    """tiny's six layers (embedding, four blocks, the head tied to the embedding), by hand: backward
    runs from the head, and the host's first update waits for the first offloaded chunk whose last
    user has run backward, after every earlier pass and the last pass's forward."""
    from chunked_dp.prepare import _first_update_s, _pass_s
    from mobius.partition.profile import analytic_profile
    from mobius.runtime.spec import ChunkedSetup

    profile = analytic_profile("tiny", get_config("tiny"), 2, 16, 0.05, "fp32")
    f = [la.fwd_s for la in profile.layers]
    b = [la.bwd_s for la in profile.layers]

    def back(lo: int) -> float:  # backward (each layer recomputed first) from the head down to layer lo
        return sum(f[i] + b[i] for i in range(lo, 6))

    tied = [[0], [1], [1], [2], [2], [0]]  # chunk 0: embedding and head; 1: blocks 1-2; 2: blocks 3-4
    for device_chunks in (1, 2):  # chunk 2 (and 1) offloaded: chunk 2 is done at block 3, chunk 0 only at the end
        setup = ChunkedSetup(100, 3, 2, True, device_chunks, group=2)
        assert _first_update_s(profile, tied, setup, 1) == pytest.approx(2 * (sum(f) + back(3)))
    swapped = [[0], [2], [2], [1], [1], [0]]  # the offloaded chunk 2 holds blocks 1-2: its update waits longer
    setup = ChunkedSetup(100, 3, 2, True, 2, group=2)
    assert _first_update_s(profile, swapped, setup, 1) == pytest.approx(2 * (sum(f) + back(1)))
    assert _first_update_s(profile, swapped, setup, 3) == pytest.approx(2 * (2 * _pass_s(profile) + sum(f) + back(1)))


def test_passes_take_the_most_micro_batches_that_fit_and_the_prediction_names_the_bound():
    from chunked_dp.prepare import _first_update_s, micro_batches_per_pass, pass_activation_bytes, predict
    from mobius.partition.profile import analytic_profile
    from mobius.runtime.spec import ChunkedSetup

    profile = analytic_profile("small", get_config("small"), 4, 128, 989.4, "bf16", 0.24, 1e9)
    one = pass_activation_bytes(profile, 1)
    assert pass_activation_bytes(profile, 4) > 3 * (one - max(la.bwd_work_bytes for la in profile.layers))
    assert micro_batches_per_pass(profile, 8, pass_activation_bytes(profile, 8)) == 8
    assert micro_batches_per_pass(profile, 8, pass_activation_bytes(profile, 3)) == 2  # a divisor of 8
    assert micro_batches_per_pass(profile, 8, 0) == 1
    trace = trace_first_use(get_config("small"))
    chunks = pack(trace, 2_000_000, 1)
    layer_chunks = chunks_of_layers(chunks, trace)
    topo = load_preset("1xh100")
    offloaded = ChunkedSetup(2_000_000, len(chunks), 2, True, 0, 4)
    resident = ChunkedSetup(2_000_000, len(chunks), 2, False, 0, 4)
    p_off = predict(offloaded, profile, topo, 8, layer_chunks, chunks[0].size, 2)
    p_res = predict(resident, profile, topo, 8, layer_chunks, chunks[0].size, 2)
    # offloaded: two passes send every gradient home twice; the host's AdamW takes every parameter
    assert p_off["d2h"] == pytest.approx(2 * len(chunks) * chunks[0].size * 2 / (topo.host_bandwidth_share(0, 1) * 1e9))
    assert p_off["host AdamW"] == pytest.approx(len(chunks) * chunks[0].size / 1e9)
    # the host's updates start in the last pass, once the first offloaded gradient is home
    shard_s = chunks[0].size * 2 / (topo.host_bandwidth_share(0, 1) * 1e9)
    first = _first_update_s(profile, layer_chunks, offloaded, 2) + shard_s
    assert p_off["step"] == max(p_off["compute"], p_off["h2d"], p_off["d2h"], first + p_off["host AdamW"])
    assert p_res["h2d"] == p_res["d2h"] == p_res["host AdamW"] == 0 and p_res["step"] == p_res["compute"]
