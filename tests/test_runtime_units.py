"""The pipeline runtime's units one at a time, in this process: device-memory accounting, the
working memory of a running stage, the prefetcher and the gradient offload with the host's AdamW
(under the stream-order checker, with jittered streams), and, between two workers (threads over
the in-process transport), the activation links and the tied embedding's gradient sum."""

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from mobius.metrics import Trace
from mobius.models import build_layer, get_config
from mobius.partition.profile import measure_profile
from mobius.runtime.device import CpuDevice
from mobius.runtime.optim import DynamicLossScaler, UpdateRule
from mobius.stages.host_optimizer import HostOptimizer
from mobius.stages.links import ActivationLinks
from mobius.stages.tied import TiedEmbedding
from mobius.stages.transport import LocalGroup, on_threads
from mobius.stages.working_memory import WorkingMemory
from mobius.swap.memory import DeviceBudgetError, DeviceMemory, Traffic
from mobius.swap.prefetch import Prefetcher
from mobius.swap.store import HostStageStore

MiB = 2**20


def test_an_allocation_past_the_budget_names_what_did_not_fit():
    memory = DeviceMemory(10 * MiB, "worker 0")
    memory.allocate(6 * MiB, "stage weights")
    with pytest.raises(DeviceBudgetError, match=r"worker 0: saved activations needs 5.0 MiB but only 4.0 MiB"):
        memory.allocate(5 * MiB, "saved activations")
    memory.free(6 * MiB)
    assert memory.used == 0 and memory.peak == 6 * MiB


def test_a_prefetch_waits_for_what_the_running_stage_reserved():
    """The plan's P_j <= G - W_{j-N} at run time: a prefetch takes only memory the running stage's
    reservation leaves, and goes on once that stage's pass ends."""
    memory = DeviceMemory(10 * MiB)
    memory.set_compute_reserve(8 * MiB)  # the running stage expects to need 8 of the 10 MiB
    memory.allocate(1 * MiB, "activations")  # ... and holds 1 of them now
    done = threading.Event()
    prefetch = threading.Thread(target=lambda: (memory.reserve_for_prefetch(4 * MiB), done.set()))
    prefetch.start()
    assert not done.wait(0.3)  # 2 MiB beside the reservation: not enough
    memory.set_compute_reserve(0)  # the pass ended: its reservation is released
    assert done.wait(60)
    prefetch.join()
    assert memory.used == 5 * MiB and memory.peak <= memory.budget


def test_weights_give_way_to_an_input_upload_under_way_and_not_to_one_not_begun():
    """The dispatched schedule's rule on one device's link: while an input upload runs, the
    prefetcher issues no piece of weights; once it ends, the stage loads, in pieces of a quarter of
    the upload, every weight as the host has it.  An upload its stream has not reached yet (the
    stream still computes what came before) holds nothing back."""
    from mobius.swap.upload_gate import UploadGate

    device = CpuDevice(check=True, jitter_ms=1.0)
    store = tiny_store(device)
    memory, traffic, gate = DeviceMemory(64 * MiB, "worker 0"), Traffic(), UploadGate(device)
    gate.min_piece_bytes = 1024
    prefetcher = Prefetcher(store, store.config, memory, device, traffic, Trace(enabled=False), gate=gate)
    uploading, finish = threading.Event(), threading.Event()

    def upload():  # as the compute thread's copy of an input on the CPU device: the body is the copy
        with gate.upload(device.compute, 16384):  # the stage's weights go in pieces of 4 KiB
            uploading.set()
            finish.wait()

    thread = threading.Thread(target=upload)
    try:
        thread.start()
        uploading.wait()
        handle = prefetcher.request(1, priority=0)
        assert not handle._loaded.wait(0.3) and traffic.h2d == 0  # not one piece while it runs
        assert gate.piece_bytes() == 4096
        finish.set()
        thread.join()
        layers = prefetcher.wait(handle)
        assert all(torch.equal(d, h) for (_, h), d in zip(store.stages[1].named_params(), layers.parameters()))
        assert traffic.h2d == store.stages[1].param_bytes > 8 * 4096
        prefetcher.release(handle)
    finally:
        finish.set()
        prefetcher.close()
        device.close()

    class Point:  # an event of a stream that has (not) reached it yet
        def __init__(self, reached):
            self.reached = reached

        def query(self):
            return self.reached

        def synchronize(self):
            raise AssertionError("waited for an upload that had not begun")

    stream = SimpleNamespace(record=lambda: Point(False))
    with gate.upload(stream, 16384):
        gate.wait_clear()  # returns at once
    gate.wait_clear()


def test_saved_activations_count_each_storage_once_and_are_freed():
    memory = DeviceMemory(100 * MiB)
    working = WorkingMemory(memory, plan=None)
    x = torch.randn(256, 256, requires_grad=True)
    with working.saved_activations([]) as ledger:
        y = (x * x).sum()  # autograd saves x twice (both operands): one storage
    assert memory.used == x.numel() * 4 and len(ledger.entries) == 1
    y.backward()
    working.release(ledger)
    assert memory.used == 0 and ledger.entries == []


def test_saved_activations_leave_out_the_stage_weights_and_agree_with_the_profile():
    """A linear layer saves ``weight.t()`` for backward, a view of the weight: those bytes are the
    stage's parameters, accounted already.  Counted as activations (as they were) they made a
    block's saved bytes half as large again, and the analytic profile of an emulated run (which
    leaves them out) planned a step that ran out of its budget at run time.  A block saves its
    activations only: within a few percent of the analytic profile, and what the measured profile says."""
    config = get_config("small")
    block = build_layer(config, 1, seed=0)
    memory = DeviceMemory(10**10)
    working = WorkingMemory(memory, plan=None)
    x = torch.randn(4, 128, config.hidden, requires_grad=True)
    with working.saved_activations([block]) as ledger:
        y = block(x)
    analytic = block.working_bytes(4, 128)
    assert 0.9 * analytic <= memory.used <= analytic  # with the weights counted: 1.47 x analytic
    measured = measure_profile("small", config, 4, 128, "fp32", "cpu", repeats=1).layers[1]
    assert measured.bwd_work_bytes == memory.used
    y.sum().backward()
    working.release(ledger)
    assert memory.used == 0


def tiny_store(device, bounds=((0, 2), (2, 6)), config=None, stages=(0, 1)) -> HostStageStore:
    return HostStageStore(config or get_config("tiny"), list(bounds), list(stages), seed=0, rule=UpdateRule(lr=1e-3),
                          compute_dtype=torch.float32, device=device)


def test_the_prefetcher_loads_stages_within_the_budget_under_the_checker():
    """Two stages requested at once under a budget that holds only the larger: the second load
    waits for the first stage's release; every weight arrives as the host store has it, every
    byte is counted, and the checker (with jittered streams) sees the copies ordered.  The trace's
    prefetch lane times the copies, not the wait for memory: the second load's span begins after
    the release it waited for."""
    device = CpuDevice(check=True, jitter_ms=1.0)
    store = tiny_store(device)
    sizes = {s: st.compute.numel() * 4 + st.frozen.numel() * st.frozen.element_size() for s, st in store.stages.items()}
    memory, traffic, trace = DeviceMemory(max(sizes.values()), "worker 0"), Traffic(), Trace(enabled=True)
    prefetcher = Prefetcher(store, store.config, memory, device, traffic, trace)
    try:
        first, second = prefetcher.request(0, priority=0), prefetcher.request(1, priority=1)
        layers = prefetcher.wait(first)
        for (name, host), (_, dev) in zip(store.stages[0].named_params(), layers.named_parameters()):
            assert torch.equal(dev, host), name
        assert not second._loaded.wait(0.3)  # no room beside stage 0
        trace.span("released", "test", time.perf_counter(), time.perf_counter())  # on the trace's clock
        prefetcher.release(first)
        layers = prefetcher.wait(second)
        assert all(torch.equal(d, h) for (_, h), d in zip(store.stages[1].named_params(), layers.parameters()))
        prefetcher.release(second)
    finally:
        prefetcher.close()
        device.close()
    assert traffic.h2d == sum(sizes.values()) and memory.used == 0 and memory.peak <= memory.budget
    events = trace.collect()
    released = next(e["ts"] for e in events if e["name"] == "released")
    loads = [e for e in events if e["tid"] == "prefetch"]
    assert {e["name"] for e in loads} == {"load stage 0", "load stage 1"}
    assert all(sum(e["args"]["bytes"] for e in loads if e["name"] == f"load stage {s}") == sizes[s] for s in sizes)
    assert all(e["ts"] >= released for e in loads if e["name"] == "load stage 1")


def test_the_tied_embedding_sums_both_copies_alike_on_two_workers():
    """Worker 0 holds the token table (stage 0), worker 1 the LM head (the last stage): after the
    exchange both copies carry embedding + head, summed in the same order, bit for bit equal."""
    config = dataclasses.replace(get_config("tiny"), tie_embeddings=True)
    bounds = [(0, 3), (3, 6)]
    plan = SimpleNamespace(bounds=bounds, micro_batches=2, gpu_of_stage=lambda s: s % 2)
    device = CpuDevice(check=False)
    stores = [tiny_store(device, bounds, config, stages=[r]) for r in (0, 1)]
    names = {0: "layers.0.wte.weight", 1: f"layers.{bounds[-1][1] - 1}.lm_head.weight"}
    torch.manual_seed(0)
    grads = {r: torch.randn(config.vocab_size, config.hidden) for r in (0, 1)}
    params = {r: dict(stores[r].stages[r].trained())[names[r]] for r in (0, 1)}
    for r in (0, 1):
        params[r].grad = grads[r].clone()
    group = LocalGroup(2)
    traffic = {r: Traffic() for r in (0, 1)}
    on_threads(lambda r: TiedEmbedding(stores[r], plan, group.endpoint(r), traffic[r]).sum_gradients(), (0, 1))
    want = grads[0] + grads[1]
    assert torch.equal(params[0].grad, want) and torch.equal(params[1].grad, want)
    assert traffic[0].peer == traffic[1].peer == want.numel() * 4


def test_gradients_go_home_and_the_hosts_adamw_updates_what_the_next_load_reads():
    """A stage's device gradients leave on their own stream, the optimizer thread turns them into
    the master gradients and steps AdamW; the master weights are then torch's AdamW of the same
    gradients, and a reload of the stage brings the updated weights."""
    device = CpuDevice(check=True, jitter_ms=1.0)
    store = tiny_store(device)
    before = {n: p.detach().clone() for n, p in store.stages[1].named_params()}
    memory, traffic = DeviceMemory(2**30), Traffic()
    plan = SimpleNamespace(bounds=[(0, 2), (2, 6)], micro_batches=1, gpu_of_stage=lambda s: 0)
    prefetcher = Prefetcher(store, store.config, memory, device, traffic, Trace(enabled=False))
    optimizer = HostOptimizer(store, device, memory, traffic, Trace(enabled=False), DynamicLossScaler(False),
                              TiedEmbedding(store, plan, LocalGroup(1).endpoint(0), traffic), LocalGroup(1).endpoint(0))
    host = device.host_stream("test")
    torch.manual_seed(1)
    try:
        handle = prefetcher.request(1, priority=0)
        layers = prefetcher.wait(handle)
        grads, phase = optimizer.gradients_for(1, layers)
        wanted = {n: torch.randn_like(p) for n, p in store.stages[1].named_params()}
        for (name, _), p in zip(store.stages[1].named_params(), layers.parameters()):
            p.grad.copy_(wanted[name])  # a view of the flat buffer, as autograd leaves it
        optimizer.offload(1, layers, grads, phase, step=0, lr=1e-2)
        prefetcher.release(handle)
        optimizer.finish_step(0, 1e-2, host)
        optimizer.drain()
        again = prefetcher.request(1, priority=0)
        reloaded = {n: p.detach().clone()
                    for (n, _), p in zip(store.stages[1].named_params(), prefetcher.wait(again).parameters())}
        prefetcher.release(again)
    finally:
        optimizer.close()
        prefetcher.close()
        device.close()
    ref = {n: torch.nn.Parameter(w.clone()) for n, w in before.items()}
    for n, p in ref.items():
        p.grad = wanted[n]
    rule = UpdateRule(lr=1e-2)
    torch.optim.AdamW([{"params": [p for p in ref.values() if p.dim() >= 2], "weight_decay": rule.weight_decay},
                       {"params": [p for p in ref.values() if p.dim() < 2], "weight_decay": 0.0}],
                      lr=1e-2, betas=rule.betas, eps=rule.eps).step()
    for name, p in store.stages[1].named_params():
        torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(p.detach(), before[name]), name
        assert torch.equal(reloaded[name], p.detach()), name
    assert traffic.d2h == store.stages[1].grad_bytes and memory.used == 0


def test_activations_reach_the_next_stage_on_either_worker():
    """Stages 0 and 1 on worker 0, stage 2 on worker 1: stage 0's output of each micro-batch goes to
    stage 1 through worker 0's own mailbox, stage 1's to worker 1 through the transport; the
    receivers get exactly what was computed, under the checker with jittered streams, and the
    traffic counts what crossed to the host, to the devices and to the peer."""
    M, shape = 3, (2, 4, 8)
    def tag_of(key):
        stage, m, backward = key
        return (stage * M + m) * 2 + int(backward)

    group = LocalGroup(2)
    got: dict = {}
    traffic = {r: Traffic() for r in (0, 1)}
    want = {m: torch.full(shape, float(m + 1)) for m in range(M)}

    def worker(rank: int) -> None:
        device = CpuDevice(check=True, jitter_ms=1.0)
        links = ActivationLinks(group.endpoint(rank), device, device.host_stream("host"),
                                DeviceMemory(2**30), traffic[rank], Trace(enabled=False), tag_of)
        try:
            for m in range(M):
                if rank == 0:
                    out = device.empty(want[m].numel(), torch.float32).view(shape)
                    out.copy_(want[m])
                    links.send(out, 0, (0, m, False))  # stage 0 -> stage 1, this worker's own
                    links.flush()
                    x = links.to_device(links.recv(0, (0, m, False), shape, torch.float32), "stage input")
                    got[(1, m)] = x.clone()
                    links.send(x * 2, 1, (1, m, False))  # stage 1 -> stage 2, on worker 1
                else:
                    x = links.to_device(links.recv(0, (1, m, False), shape, torch.float32), "stage input")
                    got[(2, m)] = x.clone()
            links.finish_sends()
        finally:
            links.close()
            device.close()

    on_threads(worker, (0, 1))
    for m in range(M):
        assert torch.equal(got[(1, m)], want[m]) and torch.equal(got[(2, m)], want[m] * 2)
    size = want[0].numel() * 4
    assert (traffic[0].d2h, traffic[0].h2d, traffic[0].peer) == (2 * M * size, M * size, M * size)
    assert (traffic[1].d2h, traffic[1].h2d, traffic[1].peer) == (0, M * size, 0)


def test_one_copy_off_the_device_serves_several_messages_and_delivered_buffers_are_reused():
    """``send_to``: a tensor for two other workers and this one leaves the device once; each gets
    it; once delivered, :meth:`reap` frees the buffer without waiting for anything, so sending step
    after step reuses the same buffers instead of allocating more."""
    shape = (2, 4, 8)
    group = LocalGroup(3)
    traffic = Traffic()
    device = CpuDevice(check=True, jitter_ms=1.0)
    links = ActivationLinks(group.endpoint(0), device, device.host_stream("host"), DeviceMemory(2**30), traffic,
                            Trace(enabled=False), lambda key: key[0])
    peers = [group.endpoint(r) for r in (1, 2)]
    try:
        for step in range(5):
            out = device.empty(64, torch.float32).view(shape)
            out.fill_(float(step))
            links.send_to(out, [(1, (step,)), (0, (step,)), (2, (step,))])
            links.flush()
            mine = links.recv(0, (step,), shape, torch.float32)
            for peer in peers:
                got = torch.empty(shape)
                peer.recv(got, 0, step)
                assert torch.equal(got, torch.full(shape, float(step)))
            assert torch.equal(mine, torch.full(shape, float(step)))
            device.compute.synchronize()
            for _ in range(500):  # the sender thread records the delivery just after it
                links.reap()
                if not links._pending:
                    break
                time.sleep(0.01)
        assert traffic.d2h == 5 * 64 * 4 and traffic.peer == 2 * 5 * 64 * 4
        assert len(links.buffers._ours) <= 2  # reused, step after step
    finally:
        links.close()
        device.close()


def test_an_unreachable_rendezvous_store_is_one_line_naming_it():
    """``MASTER_ADDR:MASTER_PORT`` with nothing listening: refused within the rendezvous limit, in
    one line that names the address; a store that is there is reached."""
    import socket

    from mobius.boundary.errors import InputError
    from mobius.runtime.worker import reach_store

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        reach_store("127.0.0.1", port, 5.0)
    with pytest.raises(InputError, match=rf"no rendezvous store at 127.0.0.1:{port} after 0.5 s .*check MASTER_ADDR"):
        reach_store("127.0.0.1", port, 0.5)  # closed now


def test_a_hand_launched_run_meets_in_rank_0s_store_or_says_who_is_missing():
    """Every rank counts itself in at rank 0's store; a peer that never comes is one line naming how
    many came, within the rendezvous limit, not the collectives' timeout."""
    import socket
    import threading

    from mobius.boundary.errors import InputError
    from mobius.runtime.worker import meet

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    stores = {}
    peer = threading.Thread(target=lambda: stores.__setitem__(1, meet("127.0.0.1", port, 1, 2, 10.0)))
    peer.start()
    stores[0] = meet("127.0.0.1", port, 0, 2, 10.0)
    peer.join()
    assert stores[0].add("mobius/joined", 0) == stores[1].add("mobius/joined", 0) == 2
    with pytest.raises(InputError, match=r"worker 0: 1 of the run's 3 workers at 127.0.0.1:\d+ after 0.5 s: start "
                                         r"every RANK from 0 to 2"):
        meet("127.0.0.1", free_port(), 0, 3, 0.5)


def test_sigquit_and_sighup_stop_a_run_as_sigterm_does(tmp_path, capsys):
    """A terminal's SIGHUP and SIGQUIT are the run's own: the step finishes and is saved (the stop
    file every worker checks), not torch's agent raising through the launcher; afterwards the
    handlers are the caller's again."""
    import os
    import signal

    from mobius.signals import StopRequest

    before = signal.getsignal(signal.SIGQUIT)
    for sig in (signal.SIGQUIT, signal.SIGHUP):
        stop_file = tmp_path / f"stop-{sig.name}"
        with StopRequest(stop_file) as stop:
            os.kill(os.getpid(), sig)
            assert stop.check() and stop_file.exists()
        assert f"{sig.name}: finishing the current step, then saving" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGQUIT) == before


def test_a_cache_lock_replaced_by_a_link_to_a_users_file_leaves_that_file_alone(tmp_path, monkeypatch, capsys):
    """The lock beside a cache entry, replaced by a link to a file of the user's: writing the entry
    neither truncates nor writes that file (the lock is opened without following links); the run
    goes on without the cache, saying so once."""
    from mobius.boundary import cache

    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(cache, "_said", set())
    store = cache.Cache("plans", "plan")
    store.directory.mkdir(parents=True)
    mine = tmp_path / "thesis.tex"
    mine.write_text("years of work")
    (store.directory / ".k.lock").symlink_to(mine)
    store.put("k", {"x": 1})
    assert mine.read_text() == "years of work"
    assert store.get("k", dict) is None
    assert "cannot write the plans cache" in capsys.readouterr().err


def _what_a_forked_worker_finds(out) -> None:
    import os
    import signal
    import sys

    from mobius.runtime.worker import parent_of
    out.put((sorted(m for m in ("mobius.backends", "torch._dynamo") if m in sys.modules),
              parent_of(os.getppid()), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()),
              torch.cuda.is_initialized()))


def test_workers_are_forked_from_a_server_that_imported_their_modules_with_our_signals_blocked():
    """What makes a worker's start cheap and safe: the fork server (a child of the launcher) has
    imported the workers' modules, no CUDA, and a worker starts with the launcher's signals
    blocked until its own handler is installed."""
    import multiprocessing
    import os

    from mobius.launcher import start_worker_server

    start_worker_server()
    context = multiprocessing.get_context("forkserver")
    out = context.SimpleQueue()
    child = context.Process(target=_what_a_forked_worker_finds, args=(out,))
    child.start()
    child.join()
    assert child.exitcode == 0
    assert out.get() == (["mobius.backends", "torch._dynamo"], os.getpid(), True, False)


def test_a_forked_worker_adopts_the_launchers_environment_and_keeps_its_rank(monkeypatch):
    """A worker forked from the server starts with the server's environment, taken earlier: it
    takes the launcher's as of the launch, with the rank torch's agent gave it."""
    import os

    from mobius.runtime.worker import Inherited

    launcher = {k: v for k, v in os.environ.items() if k != "MOBIUS_STREAM_JITTER_MS"}
    launcher["MOBIUS_CACHE"] = "/launchers/own/cache"
    monkeypatch.setenv("MOBIUS_STREAM_JITTER_MS", "3")  # the server's, since unset by the launcher
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("MOBIUS_CACHE", "/the/servers/cache")
    Inherited(launcher, output=(None, None)).adopt()
    assert "MOBIUS_STREAM_JITTER_MS" not in os.environ
    assert (os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"], os.environ["MOBIUS_CACHE"]) == (
        "1", "run", "/launchers/own/cache")
    from mobius.boundary.cache import cache_root
    assert str(cache_root()) == "/launchers/own/cache"


def _say(inherited) -> None:
    import sys

    inherited.adopt()
    print("to the launcher's stdout")
    print("to its stderr", file=sys.stderr)


def test_a_forked_worker_writes_where_the_launcher_writes_now_not_where_the_server_started(capfd):
    """The server started while this process's output went elsewhere (a caller capturing it
    since, as this test does): a worker forked from it still writes here."""
    import multiprocessing
    import os

    from mobius.launcher import start_worker_server
    from mobius.runtime.worker import Inherited

    saved = os.dup(1), os.dup(2)
    elsewhere = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(elsewhere, 1), os.dup2(elsewhere, 2)
        start_worker_server()  # (or started by an earlier test: its output is not this test's either)
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (elsewhere, *saved):
            os.close(fd)
    worker = multiprocessing.get_context("forkserver").Process(target=_say, args=(Inherited.now(),))
    worker.start()
    worker.join()
    assert worker.exitcode == 0
    said = capfd.readouterr()
    assert (said.out, said.err) == ("to the launcher's stdout\n", "to its stderr\n")


def test_a_cache_lock_another_process_holds_is_waited_for_a_bounded_time_and_said(monkeypatch, capsys):
    """A write whose entry lock stays held (a process stopped while it held it) is given up after
    the bounded wait, said on stderr, and the run goes on: the cache only saves time."""
    import fcntl
    import os

    from mobius.boundary import cache as cache_module

    monkeypatch.setattr(cache_module, "LOCK_WAIT_S", 1.2)
    monkeypatch.setattr(cache_module, "_said", set(), raising=False)
    entries = cache_module.Cache("locktest", "lock test entry")
    entries.directory.mkdir(parents=True, exist_ok=True)
    held = os.open(entries.directory / ".k.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file: another holder, as another process would be
    try:
        entries.put("k", {"x": 1})
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert "waiting for the lock of the locktest cache entry" in err and "going on without writing it" in err
    assert entries.get("k", lambda d: d) is None
    entries.put("k", {"x": 1})  # free again: written
    assert entries.get("k", lambda d: d) == {"x": 1}


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """The step just done diverged (no later loss would show it): the save refuses in one line and
    writes nothing; a checkpoint already there stays as it was."""
    import torch

    from mobius.boundary.errors import RunError
    from mobius.runtime import checkpoint as ck

    bad = {"weights.safetensors": {"w": torch.tensor([1.0, float("inf")]), "step": torch.tensor([3])}}
    with pytest.raises(RunError, match="after step 3 w holds values that are not finite .* nothing is saved"):
        ck.save(tmp_path / "ck", bad, {"step": 3})
    assert not (tmp_path / "ck").exists() and list(tmp_path.iterdir()) == []


def test_a_signal_before_training_started_is_not_lost_on_workers_spawned_after_it(tmp_path):
    """SIGTERM in the seconds before the agent has spawned the workers: none to kill yet, so the
    stop file is there for them, and each stops after its first step as it would mid-training."""
    import signal

    from mobius.signals import LauncherSignals, StopRequest

    launcher = LauncherSignals(tmp_path)
    launcher._on_signal(signal.SIGTERM)
    assert launcher.aborted == signal.SIGTERM
    assert StopRequest(launcher.stop.stop_file, announce=False).check()  # what a worker reads after a step
