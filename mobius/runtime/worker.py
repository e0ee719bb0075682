"""One worker process, whichever backend it runs.

:mod:`mobius.launcher` starts one per device through torch's elastic launcher (``torchrun`` may
start them too).  What every worker does the same way is written here once: it dies with the
process that started it, joins the process group with a collective timeout that an emulated step
allows, opens its device (CUDA, or the checked CPU stand-in), shares the host's cores, maps the
run's data, resumes from a checkpoint, stops after a step on a signal, saves checkpoints, runs
the steps and gathers the trace.  A backend supplies what is its own (:class:`WorkerBackend`):
its step, its evaluation, its state as checkpoint files, and its load.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.reduction
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from mobius.boundary.errors import InputError, RunError, first_line, shown
from mobius.config import RunConfig
from mobius.data import BatchSource, ExampleBatches
from mobius.data.packing import EvalBatches
from mobius.metrics import Evaluation, StepMetrics, Trace, seconds_text, write_trace
from mobius.models.precision import use_fp16_accumulation
from mobius.runtime import checkpoint as ck
from mobius.runtime.device import Device, cpu_threads_per_worker, open_device
from mobius.runtime.emulation import EmulatedLinks
from mobius.runtime.inputs import model_config_for, worker_data
from mobius.runtime.loop import run_steps
from mobius.runtime.optim import DynamicLossScaler
from mobius.runtime.plan_check import HOST_RATES, PROFILES, PlanCheck, PlanSwitch
from mobius.runtime.spec import PipelineSetup, RunSpec
from mobius.signals import StopRequest, quiet_resource_tracker

COLLECTIVE_TIMEOUT_S = 60
# Under torchrun the others wait while rank 0 decides: profiling a model never seen on this machine
# and code, and solving its partition, may take minutes.
DECISION_TIMEOUT_S = 3600
PARENT_POLL_S = 0.5


# What torchrun tells the processes it starts: processes we start from inside one of them (the
# runtime's calibration while rank 0 plans) must rendezvous afresh, not join torchrun's.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")

# What torch's elastic agent gives a worker where the launcher's environment does not say.
ELASTIC_DEFAULTS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)


@contextlib.contextmanager
def outside_torchrun():
    """The environment without torchrun's variables, for as long as this lasts."""
    saved = {k: v for k, v in os.environ.items() if k in TORCHRUN_ENV or k.startswith("TORCHELASTIC_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass
class WorkerPayload:
    """What the launcher hands every worker process: typed here, pickled once by the elastic
    launcher at the process boundary."""

    cfg: RunConfig
    spec: RunSpec | None  # None under torchrun: rank 0 decides it (:func:`run_worker`'s ``decide``)
    header: str  # the run's first line, printed by rank 0
    inputs: dict[str, str] | None = None  # the digests its checkpoints record (checkpoint.input_digests)
    exports: list[tuple[str, bool]] = field(default_factory=list)  # (staging directory, merged) per export
    return_weights: bool = False  # each worker returns its final weights (tests, benchmarks)
    data: dict | None = None  # the token arrays the launcher wrote (mobius.data.shared); None: made here
    t_origin: float | None = None  # the traces' common time origin (CLOCK_MONOTONIC)
    launcher_pid: int | None = None  # the process a worker must not outlive
    stop_file: str | None = None  # the launcher's stop request (mobius.signals)
    started_file: str | None = None  # touched once training has started
    run_dir: str | None = None  # the launcher's directory of this run, removed when it ends
    inherited: Inherited | None = None  # the launcher's environment and output at the launch
    # --replan auto (rank 0 calls it): (spec, measured step, steps left, switch cost) -> (new spec or None, why)
    replan: Callable[[RunSpec, float, int, float], tuple[RunSpec | None, str]] | None = None


@dataclass(frozen=True)
class Finished:
    """What a backend's worker hands back after its last step: its own report of itself (a type
    each backend defines: :class:`mobius.stages.worker.PipelineReport`,
    :class:`chunked_dp.worker.ChunkedReport`), and its weights where the payload asked."""

    report: Any
    weights: dict[str, torch.Tensor] | None = None  # by name (tests, benchmarks)


@dataclass
class WorkerResult:
    """What a worker hands back to the launcher, pickled at the process boundary: its history
    (rank 0's), its weights where the payload asked, and its backend's report of itself."""

    rank: int
    history: list[StepMetrics] | None  # rank 0's steps; None on the others
    weights: dict[str, torch.Tensor] | None = None  # by name, when the payload asked (tests, benchmarks)
    report: Any = None  # the backend's (:class:`Finished`)


@dataclass
class WorkerContext:
    """What the runtime hands a backend to build itself on."""

    cfg: RunConfig
    spec: RunSpec
    rank: int
    world: int
    device: Device
    trace: Trace
    data: tuple[BatchSource | ExampleBatches, EvalBatches | None]  # training batches, held-out examples
    payload: WorkerPayload


class WorkerBackend(Protocol):
    """A backend's part of a worker process.  One whose :meth:`step` returns before the step's
    updates are decided (the dispatched schedule's) has a ``settle(metrics) -> metrics`` too, which
    completes them once they are (:func:`mobius.runtime.loop.run_steps`)."""

    scaler: DynamicLossScaler  # the fp16 loss scale a checkpoint keeps (disabled where there is none)
    evaluates: bool  # the run has held-out data

    def step(self, step: int) -> StepMetrics:
        """Optimizer step ``step``, its metrics as every worker agrees on them."""

    def evaluate(self, done: int) -> Evaluation:
        """The held-out loss (and metrics) with the weights after ``done`` steps (every worker calls it)."""

    def drain(self) -> None:
        """Every update issued so far is in the state :meth:`checkpoint_files` reads."""

    def checkpoint_files(self, done: int) -> dict[str, dict[str, torch.Tensor]]:
        """This process's files of a checkpoint after ``done`` steps (every worker calls it)."""

    def restore(self, ckpt: ck.Checkpoint) -> None:
        """Weights and optimizer state from ``ckpt``, written by any backend."""

    def finish(self) -> Finished:
        """After the last step: the backend's report of itself, and the weights where asked."""

    def close(self) -> None:
        """Stop the backend's threads and release its device memory."""


class Inherited:
    """What a worker takes from its launcher as of the launch: the environment, and where stdout
    and stderr go.  A worker forked from the fork server (:mod:`mobius.launcher`) starts with the
    server's, which are the launcher's as of an earlier moment: a variable set since, or output
    redirected since (a caller capturing it, as a test does), would be missed.  The descriptors
    travel as multiprocessing passes a connection's (``reduction.DupFd``, while the worker is
    started); a closed one stays as the worker found it."""

    def __init__(self, environ: dict[str, str], output: tuple[int | None, int | None] = (1, 2)):
        self.environ, self.output = environ, output

    @classmethod
    def now(cls) -> Inherited:
        return cls(dict(os.environ))

    def __reduce__(self):
        return _inherited, (self.environ, *(_passed(fd) for fd in self.output))

    def adopt(self) -> None:
        """This process's environment and output made the launcher's, torch elastic's variables
        for this worker kept."""
        elastic = {k: v for k, v in os.environ.items() if k in TORCHRUN_ENV or k.startswith("TORCHELASTIC_")
                   or k in ELASTIC_DEFAULTS and k not in self.environ}
        os.environ.clear()
        os.environ.update({**self.environ, **elastic})
        for fd, target in zip(self.output, (1, 2)):
            if fd is not None and fd != target:  # a spawned worker was handed its own: nothing to do
                os.dup2(fd, target)
                os.close(fd)


def _passed(fd: int | None):
    if fd is None:
        return None
    try:
        os.fstat(fd)
    except OSError:  # closed in the launcher
        return None
    return multiprocessing.reduction.DupFd(fd)


def _inherited(environ: dict[str, str], *passed) -> Inherited:
    return Inherited(environ, tuple(None if p is None else p.detach() for p in passed))


@contextlib.contextmanager
def tied_to_launcher(launcher_pid: int | None = None):
    """A worker must not outlive the process that started it, however that one dies (SIGKILL
    included): when this process is re-parented it kills itself.  The launcher is
    ``launcher_pid``, not whoever is our parent by the time this runs: a launcher killed while we
    started must not leave us running.  A worker forked by the launcher's fork server
    (:mod:`mobius.launcher`) watches the server's parent: the server outlives the launcher for as
    long as a worker it forked lives (each holds the pipe it would see closed).  (Its temporary
    directories are the launcher's watcher's to remove: :mod:`mobius.boundary.janitor`.)"""
    parent = os.getppid()
    forked_by_server = launcher_pid is not None and parent != launcher_pid

    def launcher_alive() -> bool:
        return os.getppid() == parent and (not forked_by_server or parent_of(parent) == launcher_pid)

    def watch() -> None:
        while launcher_alive():
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mobius-parent-watch", daemon=True).start()
    yield


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold anything: state, parent


def install_stop(payload: WorkerPayload) -> StopRequest:
    """This worker's stop request; from now on a signal stops training after a step, so the
    launcher is told that training has started."""
    stop = StopRequest(payload.stop_file, announce=False).install()
    if payload.started_file:
        Path(payload.started_file).touch()
    return stop


def agree(*wants: bool) -> tuple[bool, ...]:
    """Every worker stops, saves or switches plans after the same step: any worker's request
    counts for all."""
    flags = torch.tensor([float(w) for w in wants])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return tuple(bool(f) for f in flags)


def share_cpu_cores(world: int) -> None:
    """The workers of one machine split its cores between them (CPU workers compute there, GPU
    workers step their optimizer there)."""
    torch.set_num_threads(cpu_threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", world))))


def gather_trace(trace: Trace, path: str | None, rank: int, world: int) -> None:
    """Rank 0 writes every worker's events into one Chrome trace (pid = worker)."""
    events = [None] * world if rank == 0 else None
    dist.gather_object(trace.collect(), events, dst=0)
    if rank == 0 and path:
        write_trace(path, [e for evs in events for e in evs])


def collective_timeout_s(spec: RunSpec | None) -> float:
    """How long a message may wait for its receiver before the run fails: under ``--emulate`` a
    worker may legitimately be busy for several dilated steps' worth of wall time."""
    if spec is None or spec.emulation is None:
        return COLLECTIVE_TIMEOUT_S
    return COLLECTIVE_TIMEOUT_S + 3 * spec.emulation.factor * spec.predicted_step_s()


@dataclass
class Decision:
    """Under torchrun no launcher decided the run: every process describes its node (``node()``),
    rank 0 decides from all of them (``decide(nodes)`` -> the spec and the run's header line) and
    shares its decision, or the one-line error that refused it."""

    node: Callable[[], str]
    decide: Callable[[list[str]], tuple[RunSpec, str]]


def run_worker(payload: WorkerPayload, build: Callable[[WorkerContext], WorkerBackend],
               decision: Decision | None = None) -> WorkerResult:
    """The life of one worker: ``build`` makes its backend.  Under torchrun the payload has no
    spec: it comes from the ``decision``."""
    if payload.inherited is not None:  # None under torchrun: its workers are its children
        payload.inherited.adopt()
    with tied_to_launcher(payload.launcher_pid):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        spec = payload.spec
        join_group(spec.collectives() if spec is not None else "gloo", rank, world, collective_timeout_s(spec))
        try:
            return _run(payload, rank, world, build, decision)
        except (RuntimeError, dist.DistError) as err:
            lost = lost_peer(err)
            if lost is None:
                raise
            if payload.launcher_pid is not None:  # our launcher reports one line: the first worker to stop
                outlive_the_lost_peer()
            raise RunError(f"worker {rank}: another worker of the run stopped ({lost})") from None
        finally:
            dist.destroy_process_group()
            quiet_resource_tracker()


RENDEZVOUS_TIMEOUT_S = 20.0  # every refusal within 30 s of the command, imports included


def join_group(backend: str, rank: int, world: int, timeout_s: float) -> None:
    """Join the run's process group (``env://``: torchrun's variables, or our launcher's), its
    collectives timing out after ``timeout_s``.  Under torchrun's agents (and our launcher, which
    is one) every process has met in the agent's store already.  A hand-launched run meets in rank
    0's store first (:func:`meet`), so that an unreachable ``MASTER_ADDR`` or a peer that never
    comes is one line within :data:`RENDEZVOUS_TIMEOUT_S`, not a traceback a minute later."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "0")
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store = meet(host, int(port), rank, world, RENDEZVOUS_TIMEOUT_S)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, store=store,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError, TimeoutError, ValueError) as err:
        raise InputError(f"worker {rank}: the run's {world} workers did not all join at {shown(host)}:{port} within "
                         f"{timeout_s:.0f} s ({first_line(err, 100)})") from None


def meet(host: str, port: int, rank: int, world: int, within_s: float) -> dist.TCPStore:
    """The rendezvous of a hand-launched run: rank 0 hosts the store at ``host:port``, every rank
    counts itself in and waits until all ``world`` have, for ``within_s`` at most."""
    deadline = time.monotonic() + within_s
    if rank != 0:
        reach_store(host, port, within_s)
    try:
        store = dist.TCPStore(host, port, is_master=rank == 0, timeout=datetime.timedelta(seconds=within_s),
                              wait_for_workers=False)
    except (RuntimeError, dist.DistError) as err:
        raise InputError(f"worker {rank}: cannot open the rendezvous store at {shown(host)}:{port} "
                         f"({first_line(err, 100)})") from None
    joined = store.add("mobius/joined", 1)
    while joined < world:
        if time.monotonic() >= deadline:
            raise InputError(f"worker {rank}: {joined} of the run's {world} workers at {shown(host)}:{port} after "
                             f"{within_s:g} s: start every RANK from 0 to {world - 1} with the same MASTER_ADDR "
                             "and MASTER_PORT")
        time.sleep(0.1)
        joined = store.add("mobius/joined", 0)
    return store


def reach_store(host: str, port: int, within_s: float) -> None:
    """Wait until something listens at ``host:port`` (the rendezvous store), for ``within_s`` at most."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise InputError(f"no rendezvous store at {shown(host)}:{port} after {within_s:g} s "
                                 f"({first_line(err, 80)}): check MASTER_ADDR and MASTER_PORT, and that the master "
                                 "node is running") from None
            time.sleep(0.2)


# How gloo and the store say that the process at the other end is gone.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe",
             "Connection refused", "Connection was likely closed")


def lost_peer(err: BaseException) -> str | None:
    """What a collective that failed because another worker died said, shortly (None: another
    failure, a bug to show in full).  Under torchrun that worker may be on another node, whose own
    line says why it stopped."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if not any(sign in text for sign in PEER_LOST):
        return None
    text = re.sub(r"^\[[^\]]*\] ", "", text)  # gloo's source location
    return text.split(". This is typically")[0][:160]


# How long a worker that lost a peer waits to be stopped: the launcher polls its workers every
# 0.2 s, and the status of a worker killed by a signal reaches it through the fork server.
LOST_PEER_GRACE_S = 2.0


def outlive_the_lost_peer() -> None:
    """A worker of our launcher that lost a peer is not the cause: it gives the launcher time to see
    the worker that stopped first (killed, or failed with its own error), whose failure is then the
    one reported, and dies of the launcher's SIGTERM at once.  (Under torchrun every worker says
    in its own line why it stopped: none waits.)"""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    time.sleep(LOST_PEER_GRACE_S)


def decided(decision: Decision, rank: int, world: int) -> tuple[RunSpec, str]:
    """The spec and header rank 0 decided from every node's description; a refusal is raised on
    every rank, so each node ends with the same one line."""
    waiting = dist.new_group(timeout=datetime.timedelta(seconds=DECISION_TIMEOUT_S))
    nodes = [None] * world
    dist.all_gather_object(nodes, decision.node(), group=waiting)
    shared: list = [None]
    if rank == 0:
        try:
            shared[0] = decision.decide(nodes)
        except InputError as err:
            shared[0] = err
    dist.broadcast_object_list(shared, src=0, group=waiting)
    if isinstance(shared[0], InputError):
        raise shared[0]
    return shared[0]


def switch_plans(backend: WorkerBackend, payload: WorkerPayload, spec: RunSpec, done: int,
                 build: Callable[[RunSpec], WorkerBackend], rank: int) -> WorkerBackend:
    """``--replan``: the training state after ``done`` steps carried from ``backend`` to one built
    for ``spec``'s plan, through a checkpoint in the launcher's run directory (stages change
    workers: the checkpoint is the one format every plan reads).  The old backend is closed before
    the new one takes its device memory."""
    backend.drain()
    path = str(Path(payload.run_dir) / "switch")
    cfg = payload.cfg
    meta = ck.run_meta(cfg, model_config_for(cfg).to_dict(), done, backend.scaler, payload.inputs)
    ck.save(path, backend.checkpoint_files(done), meta, rank, dist.barrier)
    backend.close()
    new = build(spec)
    ck.resume(ck.load_checkpoint(path, verify=False), new.restore, new.scaler, cfg.optim.precision)
    dist.barrier()  # every worker has read it
    return new


def timed_step(backend: WorkerBackend, step: int, trace: Trace, emulation: EmulatedLinks | None
               ) -> StepMetrics:
    """One step of ``backend``, a span in the trace (the window its lanes are read in); under
    ``--emulate`` its times on the emulated GPUs too (once its metrics are complete: a backend with
    a ``settle`` completes them later, :func:`settled_step`)."""
    began = time.perf_counter()
    m = backend.step(step)
    trace.span(f"step {step}", "step", began, time.perf_counter())
    return m if settles(backend) else on_emulated_gpus(m, emulation)


def settles(backend: WorkerBackend) -> bool:
    """Whether ``backend``'s step returns before its updates are decided (the dispatched
    schedule's), its metrics completed later by its ``settle``."""
    return hasattr(backend, "settle")


def settled_step(backend: WorkerBackend, emulation: EmulatedLinks | None
                 ) -> Callable[[StepMetrics], StepMetrics] | None:
    """What completes ``backend``'s step metrics later, where it :func:`settles`; None where its
    steps return complete."""
    if not settles(backend):
        return None
    return lambda m: on_emulated_gpus(backend.settle(m), emulation)


def on_emulated_gpus(m: StepMetrics, emulation: EmulatedLinks | None) -> StepMetrics:
    """``m`` with its times on the emulated GPUs, under ``--emulate``."""
    if emulation is not None:
        m.emulated_step_s = m.step_time_s / emulation.factor
        if m.host_adam_s is not None:
            m.host_adam_s /= emulation.factor
        if m.compute_s is not None:
            m.compute_s /= emulation.factor
        if m.host_adam_params_per_s is not None:
            m.host_adam_params_per_s *= emulation.factor
    return m


def _run(payload: WorkerPayload, rank: int, world: int, build, decision: Decision | None) -> WorkerResult:
    cfg, spec = payload.cfg, payload.spec
    if spec is None:  # started by torchrun: rank 0 decides, everyone follows
        spec, header = decided(decision, rank, world)
        cfg = cfg.changed(precision=spec.precision)
        payload = replace(payload, cfg=cfg, spec=spec, header=header)
    gpu = spec.first_gpu(rank)
    if cfg.optim.fp16_accumulation:
        use_fp16_accumulation(spec.cuda)
    emulation = EmulatedLinks(spec.emulation, gpu) if spec.emulation else None
    device = open_device(spec.cuda, int(os.environ.get("LOCAL_RANK", 0)), spec.enforced_budget(gpu), emulation)
    trace = Trace(enabled=bool(cfg.outputs.trace), pid=rank)
    trace.set_origin(payload.t_origin if payload.t_origin is not None else time.perf_counter())
    # Workers share the host's cores: CPU workers for everything, GPU workers for their optimizer.
    share_cpu_cores(world)
    data = worker_data(cfg, model_config_for(cfg), payload.data)  # mapped, or made here under torchrun
    backend = build(WorkerContext(cfg, spec, rank, world, device, trace, data, payload))
    try:
        device.start_steps()
        start, tracker_runs = 0, {}
        if cfg.checkpoint.resume:  # the launcher checked it; each file is checked as it is read
            resumed = ck.load_checkpoint(cfg.checkpoint.resume, verify=False)
            start = ck.resume(resumed, backend.restore, backend.scaler, cfg.optim.precision)
            tracker_runs = resumed.tracker_runs
        stop = install_stop(payload)
        started = time.perf_counter()

        def one_step(step: int) -> StepMetrics:
            return timed_step(backend, step, trace, emulation)

        # A pipeline's run is checked against its plan (rank 0's check); the chunked engine's is not.
        pipe = spec.setup if isinstance(spec.setup, PipelineSetup) else None

        def keep_rate(params_per_s: float) -> None:
            if pipe.host_rate_key:
                HOST_RATES.put(pipe.host_rate_key, {"adam_params_per_s": params_per_s})

        check = PlanCheck.of(pipe, keep_rate, cfg.optim.max_grad_norm) if rank == 0 and pipe is not None else None
        checks = [check]
        switch = None
        if payload.replan is not None and pipe is not None:
            # The switch costs about what the run's start did: the time to its first step.
            setup_s = (started - payload.t_origin) / (emulation.factor if emulation else 1.0)
            last = cfg.optim.steps if cfg.checkpoint.stop_after is None else \
                min(cfg.optim.steps, start + cfg.checkpoint.stop_after)
            switch = PlanSwitch(check, (lambda step_s, left: payload.replan(spec, step_s, left, setup_s))
                                if rank == 0 else None, last)

        def save(done: int, trackers: dict[str, str]) -> None:
            backend.drain()
            meta = ck.run_meta(cfg, model_config_for(cfg).to_dict(), done, backend.scaler, payload.inputs, trackers)
            ck.save(cfg.checkpoint.save, backend.checkpoint_files(done), meta, rank, dist.barrier)

        header = payload.header + (f", resuming at step {start}" if start else "")
        history = run_steps(cfg, one_step, header, start_step=start, save_fn=save, stop=stop, agree=agree,
                            main=rank == 0, eval_fn=backend.evaluate if backend.evaluates else None, check=check,
                            switch=switch, started=started, tracker_runs=tracker_runs,
                            settle=settled_step(backend, emulation))
        if switch is not None and switch.at is not None:
            shared = [switch.spec]
            dist.broadcast_object_list(shared, src=0)  # rank 0 planned it
            spec, at = shared[0], switch.at
            pipe = spec.setup
            old, backend = backend, None  # closed by the switch
            backend = switch_plans(old, payload, spec, at, lambda new: build(
                WorkerContext(cfg, new, rank, world, device, trace, data, payload)), rank)
            check = PlanCheck.of(pipe, keep_rate, cfg.optim.max_grad_norm, first=len(history)) if rank == 0 else None
            checks.append(check)
            history = run_steps(cfg, one_step, f"switched plans after step {at}: {pipe.plan.shape()}, predicted "
                                f"{seconds_text(pipe.predicted_step_s())}/step",
                                start_step=at, save_fn=save, stop=stop, agree=agree, main=rank == 0,
                                eval_fn=backend.evaluate if backend.evaluates else None, check=check,
                                before=history, started=started, tracker_runs=tracker_runs,
                                settle=settled_step(backend, emulation))
        backend.drain()  # with a lag, the last step's update; resident stages back in the host store
        if pipe is not None and pipe.profile_key and any(c is not None and c.stale_profile for c in checks):
            PROFILES.path(pipe.profile_key).unlink(missing_ok=True)  # the next run measures the layers again
        gather_trace(trace, cfg.outputs.trace, rank, world)
        finished = backend.finish()
    finally:
        if backend is not None:
            backend.close()
    return WorkerResult(rank, history if rank == 0 else None, finished.weights, finished.report)
