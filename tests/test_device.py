"""The device layer's CPU implementation: asynchronous for real, and checked.

The runtime's copy/compute ordering runs here exactly as on CUDA, so these tests are where that
ordering is tested: the checker must catch a wait removed from the runtime, and a run whose copy
streams are slowed at random must still equal the reference."""

import contextlib
import os
import time

import pytest
import torch

from conftest import reference

from mobius.backends import resolve
from mobius.metrics import Trace
from mobius.runtime.device import CpuDevice, Event, Stream, StreamOrderError


@pytest.fixture()
def device():
    d = CpuDevice(check=True, jitter_ms=2)
    yield d
    d.close()


def test_side_streams_are_asynchronous_and_ordered_by_events(device):
    h2d = device.new_stream("h2d", "h2d")
    host = torch.arange(1 << 16, dtype=torch.float32)
    dev = device.empty(host.numel(), host.dtype, h2d, name="slab")
    gate = device.host_stream("gate")
    h2d.wait(gate_event := gate.record())  # an event that is already complete
    assert gate_event.query()
    for _ in range(20):  # each copy queued behind the previous one, in order
        h2d.copy(dev, host)
    done = h2d.record()
    device.compute.wait(done)
    device.compute.reads(dev)
    assert torch.equal(dev, host) and done.query()


def test_checker_names_the_buffer_and_both_streams(device):
    h2d = device.new_stream("h2d", "h2d")
    dev = device.empty(8, torch.float32, h2d, name="weights of stage 3")
    h2d.copy(dev, torch.ones(8))
    loaded = h2d.record()
    with pytest.raises(StreamOrderError, match="weights of stage 3 is read on stream 'compute' before it waited "
                                               "for its last write on stream 'h2d'"):
        device.compute.reads(dev)
    device.compute.wait(loaded)
    device.compute.reads(dev)
    device.compute.record()
    with pytest.raises(StreamOrderError, match="reused on stream 'h2d' while it may still be read on stream 'compute'"):
        h2d.copy(dev, torch.zeros(8))


def test_ordering_is_transitive(device):
    """a -> b -> c: c has waited for a's write through b (vector clocks)."""
    a, b = device.new_stream("a", "h2d"), device.new_stream("b", "h2d")
    buf = device.host_buffer(4, torch.float32)
    a.writes(buf)
    b.wait(a.record())
    device.compute.wait(b.record())
    device.compute.reads(buf)


def test_a_failed_copy_is_raised_where_it_is_waited_for(device):
    s = device.new_stream("h2d", "h2d")
    s.copy(torch.empty(3), torch.empty(4))  # shapes differ: fails on the stream's thread
    with pytest.raises(RuntimeError, match="stream 'h2d' failed"):
        s.record().synchronize()


def test_device_spans_are_timed_when_the_stream_reaches_them_not_when_issued(device):
    """A copy stream held behind an event no stream has reached yet: the host issues the copy at
    once, the trace's span starts when the stream gets to it (as a CUDA copy issued with
    ``non_blocking`` starts when its stream gets to it)."""
    h2d, held = device.new_stream("h2d", "h2d"), device.new_stream("held", "h2d")
    gate = Event(held, 1, {})  # not reached: whatever waits for it waits
    h2d.wait(gate)
    src, dst = torch.ones(1 << 16), torch.empty(1 << 16)
    trace = Trace(enabled=True)
    trace.set_origin(0.0)
    begin = h2d.record()
    h2d.copy(dst, src)
    trace.device_span("load", "prefetch", begin, h2d.record(), device.time_of, bytes=src.numel() * 4)
    issued = time.perf_counter()
    time.sleep(0.05)
    gate._done.set()
    (span,) = trace.collect()
    assert span["ts"] / 1e6 >= issued + 0.05 and span["dur"] >= 0 and span["args"]["bytes"] == 1 << 18
    assert torch.equal(dst, src)


# ---- the runtime under the checker ---------------------------------------------------------------------

def one_worker(recompute: str, steps: int = 2):
    from mobius.config import RunConfig

    return RunConfig.of(model="tiny", topology="cpu", cpu_workers=1, stages=3, steps=steps, seq_len=32,
                        micro_batch_size=2, micro_batches=3, recompute=recompute, progress=False)


def run_one_worker(cfg) -> list[float]:
    """The pipeline runtime of one worker holding every stage, in this process (gloo, world 1)."""
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.runtime.inputs import check_model_input
    from mobius.runtime.worker import WorkerPayload
    from mobius.stages.worker import worker_main

    spec, _ = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    return [h.loss for h in worker_main(WorkerPayload(cfg, spec, "test")).history]


@pytest.fixture()
def one_worker_env(monkeypatch):
    from torch.distributed.elastic.utils.distributed import get_free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(get_free_port()), "MOBIUS_CHECK_STREAMS": "1"}.items():
        monkeypatch.setenv(k, v)
    # The worker's process-level parts stay out of the test process.
    from mobius.signals import StopRequest

    monkeypatch.setattr("mobius.runtime.worker.tied_to_launcher", lambda launcher_pid=None: contextlib.nullcontext())
    monkeypatch.setattr("mobius.runtime.worker.install_stop", lambda payload: StopRequest())


@pytest.mark.parametrize("recompute", ["on", "off"])
def test_runtime_under_the_checker_equals_the_reference(one_worker_env, recompute):
    cfg = one_worker(recompute)
    assert run_one_worker(cfg) == reference(cfg, precision="fp32")[0]


@pytest.mark.parametrize("victim,caught", [
    ("compute", "weights of stage 0 is read on stream 'compute' before it waited for its last write on stream "
                "'h2d-params'"),
    ("d2h-activations", "activation staging buffer is overwritten or reused on stream 'd2h-activations'"),
    ("d2h-gradients", "on stream 'd2h-gradients'"),
    ("h2d-params", "host weights of stage"),
])
def test_checker_catches_a_wait_removed_from_the_runtime(one_worker_env, monkeypatch, victim, caught):
    real = Stream.wait

    def wait_except_on_victim(self, event):
        if self.name != victim:
            real(self, event)

    monkeypatch.setattr(Stream, "wait", wait_except_on_victim)
    with pytest.raises(StreamOrderError, match=caught) as info:
        run_one_worker(one_worker("on"))
    print(info.value)


@pytest.mark.slow
def test_jittered_streams_equal_the_reference(one_worker_env, monkeypatch):
    """Random sleeps before every job of every copy stream: the order of the work may change, the
    numbers may not."""
    monkeypatch.setenv("MOBIUS_STREAM_JITTER_MS", "3")
    cfg = one_worker("off", steps=4)
    assert run_one_worker(cfg) == reference(cfg, precision="fp32")[0]
    assert os.environ["MOBIUS_STREAM_JITTER_MS"] == "3"
