"""Start one worker per device, whichever backend, through torch's elastic launcher (torchrun's
machinery, standalone rendezvous on loopback), after every pre-flight check has passed; the
backends (:mod:`mobius.backends`) say what the workers run.

Workers are forked from multiprocessing's fork server, which imports what every worker needs once
(:data:`WORKER_MODULES`), in the background from :func:`start_worker_server` on: a worker that
imported torch and our modules itself took 2 s of CPU to start.  The server is a fresh interpreter
that has only imported modules: no CUDA context, no thread of ours, nothing to inherit but code.
A worker takes the launcher's environment and output as of the launch (its payload's
:class:`~mobius.runtime.worker.Inherited`, adopted first): a caller that redirected its stdout since
the server started (a test capturing it) still gets its workers' lines.

A worker that dies ends the run: the elastic agent stops the others (no restarts) and we exit
non-zero naming the rank and its error; collectives time out after 60 s, so nothing hangs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mobius.boundary.errors import InputError, shown
from mobius.boundary.janitor import scratch_dir, temporary_files_in
from mobius.data.shared import share
from mobius.runtime.emulation import create_counters
from mobius.runtime.inputs import make_data, model_config_for
from mobius.runtime.spec import RunSpec
from mobius.runtime.worker import Inherited, WorkerPayload, outside_torchrun
from mobius.signals import LauncherSignals, start_fork_server


# What a worker imports: the backends' workers, and the compiler stack torch.optim imports when a
# process makes its first optimizer (0.8 s; a name the server cannot import, it skips).
WORKER_MODULES = ("mobius.backends", "torch._dynamo")


def start_worker_server() -> None:
    """Start the fork server the workers (and the calibration's, :mod:`mobius.stages.calibrate`)
    will be forked from; it imports :data:`WORKER_MODULES` while the caller goes on.  Nothing it
    forks starts before those imports end, so they never share the cores with a calibration's
    steps; a run whose profile is measured without a calibration starts it after the profile
    (:func:`mobius.planning.pipeline.run_plan`'s ``profiled``).  Idempotent.  The environment
    every worker needs is set first, torchrun's variables left out: the server's environment is the
    one its workers start with."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers GPUs as NVML and the topology do
    # Stages of many sizes come and go on each GPU: with fixed segments the caching allocator held
    # 180 MB reserved but unusable beside 500 MB of tensors under a 760 MB cap (H100, GPT-2 medium).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    multiprocessing.set_forkserver_preload(list(WORKER_MODULES))
    global _server_dir
    if _server_dir is None:
        # multiprocessing keeps the server's socket in a directory it removes only at a clean exit:
        # made inside one of ours, it goes however this process ends.  A socket's path has room
        # for 107 bytes: below a temporary directory too deep for it, under /tmp.
        base = tempfile.gettempdir()
        under = base if len(base) + SOCKET_PATH_BELOW <= 107 else "/tmp"
        _server_dir = _lifetime.enter_context(scratch_dir("mobius-server-", under))
    with temporary_files_in(_server_dir), outside_torchrun():
        start_fork_server()


# What the server's socket path adds below the temporary directory: our directory, multiprocessing's
# in it, and the socket's name ("/mobius-server-XXXXXXXX/pymp-XXXXXXXX/listener-XXXXXXXX").
SOCKET_PATH_BELOW = 55
_lifetime = contextlib.ExitStack()  # closed by nobody: what it holds lasts as long as this process
_server_dir: str | None = None


def launch_workers(n: int, entry, payload: WorkerPayload, data: tuple | None, emulated_gpus: int | None = None
                   ) -> dict:
    """:func:`run_workers`; under ``--emulate`` with the emulated links' shared counters (of
    ``emulated_gpus``: default, one per worker), in a directory of the launcher's own."""
    spec = payload.spec
    with scratch_dir("mobius-links-") as links:
        if spec.emulation:
            counters = str(Path(links) / "counters")
            create_counters(counters, emulated_gpus or n)
            payload = replace(payload, spec=replace(spec, emulation=replace(spec.emulation, counters=counters)))
        return run_workers(n, entry, payload, data)


def devices_text(spec: RunSpec) -> str:
    """What the run's workers compute on, in the header's words."""
    return "CUDA GPUs" if spec.cuda else "CPU workers"


def run_workers(n: int, entry, payload: WorkerPayload, data: tuple | None = None) -> dict:
    """Start ``n`` workers running ``entry(payload)`` through the elastic launcher; a failed worker
    ends everything with one line naming it.  ``data`` (training batches, held-out examples; made
    here when not given) is written into the run's directory once and memory-mapped by every
    worker."""
    # We report a failed or interrupted worker in one line ourselves: the agent's own logging
    # (stack traces of the children, "closing process" warnings) would bury it.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    payload = replace(payload, t_origin=time.perf_counter())
    start_worker_server()  # before the temporary directory below: the server outlives the run
    with scratch_dir("mobius-run-") as run_dir, temporary_files_in(run_dir):
        if data is None:  # once here, not in each worker (reading the default corpus took each 0.4 CPU-s)
            data = make_data(payload.cfg, model_config_for(payload.cfg))
        payload = replace(payload, data=share(*data, run_dir))
        return _launch(n, entry, payload, run_dir)


def _launch(n: int, entry, payload: WorkerPayload, run_dir: str) -> dict:
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"mobius-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                          start_method="forkserver", signals_to_handle="",  # SIGINT, SIGTERM, SIGHUP, SIGQUIT: ours
                          logs_specs=DefaultLogsSpecs(log_dir=run_dir))  # the agent's directory goes with ours
    # First SIGINT/SIGTERM: the workers finish the step and save; a second: everything exits now.
    signals = LauncherSignals(run_dir)
    payload = replace(payload, launcher_pid=os.getpid(), stop_file=str(signals.stop.stop_file),
                      started_file=str(signals.started_file), run_dir=run_dir)
    try:
        with signals, outside_torchrun():
            return elastic_launch(launch, entry)(replace(payload, inherited=Inherited.now()))
    except ChildFailedError as err:
        if signals.aborted:
            print(f"interrupted ({signal.Signals(signals.aborted).name}) before training started", file=sys.stderr)
            raise SystemExit(128 + signals.aborted) from None
        print(f"error: {shown(describe_failure(err))}", file=sys.stderr)
        raise SystemExit(1)


def running_under_torchrun() -> bool:
    """True when torchrun started this process; its variables are checked first, so that a stray
    or malformed one is one line here, not a traceback (or a minute's wait) in a worker."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if "RANK" not in os.environ:
        raise InputError("TORCHELASTIC_RUN_ID is set but RANK is not: this process was not started by torchrun; "
                         "unset TORCHELASTIC_RUN_ID to run on this machine alone")
    absent = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": os.environ.get("WORLD_SIZE", ""), "MASTER_PORT": "1"}
    values = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = os.environ.get(name, absent.get(name, ""))
        if not text.strip().isdigit():
            raise InputError(f"torchrun's {name}={text[:20]!r} is not a non-negative integer")
        values[name] = int(text)
    world, local = values["WORLD_SIZE"], values["LOCAL_WORLD_SIZE"]
    if not (world >= 1 and 1 <= local <= world and world % local == 0):
        raise InputError(f"torchrun's WORLD_SIZE={world} and LOCAL_WORLD_SIZE={local} do not describe nodes of "
                         "equal size")
    if not (values["RANK"] < world and values["LOCAL_RANK"] < local):
        raise InputError(f"torchrun's RANK={values['RANK']} / LOCAL_RANK={values['LOCAL_RANK']} is outside "
                         f"WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local}")
    if "MASTER_PORT" in os.environ and not 1 <= values["MASTER_PORT"] <= 65535:
        raise InputError(f"torchrun's MASTER_PORT={values['MASTER_PORT']} is not a port (1-65535)")
    return True


def describe_failure(err) -> str:
    """One line naming the worker that failed first and why.

    A worker killed by a signal is the root cause even if a peer's error (its connection
    closing) was recorded a moment earlier."""
    failures = err.failures

    def summary(f) -> str:
        message = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
        lines = str(message).strip().splitlines()
        last = lines[-1] if lines else f"exit code {f.exitcode}"
        for ours in ("RunError: ", "InputError: ", "CheckpointError: "):  # already a sentence for the user
            if last.startswith(ours):
                return last[len(ours):]
        return last

    ranked = sorted(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp))
    rank, root = ranked[0]
    others = [f"worker {r}: {summary(f)[:120]}" for r, f in ranked[1:]]
    return f"worker {rank} failed: {summary(root)}" + (f" (then {'; '.join(others)})" if others else "")
