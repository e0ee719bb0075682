"""Start one worker per device, whichever backend, through torch's elastic launcher (torchrun's
machinery, standalone rendezvous on loopback), after every pre-flight check has passed; the
backends (:mod:`mobius.backends`) say what the workers run.

A worker that dies ends the run: the elastic agent stops the others (no restarts) and we exit
non-zero naming the rank and its error; collectives time out after 60 s, so nothing hangs.
"""

from __future__ import annotations

import logging
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

from mobius.data.shared import share
from mobius.errors import InputError, shown
from mobius.janitor import scratch_dir
from mobius.runtime.emulation import create_counters
from mobius.runtime.spec import RunSpec
from mobius.runtime.worker import WorkerPayload, outside_torchrun
from mobius.signals import LauncherSignals


def launch_workers(n: int, entry, payload: WorkerPayload, data: tuple | None) -> dict:
    """:func:`run_workers`; under ``--emulate`` with the emulated links' shared counters, in a
    directory of the launcher's own."""
    spec = payload.spec
    with scratch_dir("mobius-links-") as links:
        if spec.emulation:
            counters = str(Path(links) / "counters")
            create_counters(counters, n)
            payload = replace(payload, spec=replace(spec, emulation=replace(spec.emulation, counters=counters)))
        return run_workers(n, entry, payload, data)


def devices_text(spec: RunSpec) -> str:
    """What the run's workers compute on, in the header's words."""
    return "CUDA GPUs" if spec.cuda else "CPU workers"


def run_workers(n: int, entry, payload: WorkerPayload, data: tuple | None = None) -> dict:
    """Start ``n`` workers running ``entry(payload)`` through the elastic launcher; a failed worker
    ends everything with one line naming it.  ``data`` (training batches, held-out examples) is
    written into the run's directory once and memory-mapped by every worker."""
    # We report a failed or interrupted worker in one line ourselves: the agent's own logging
    # (stack traces of the children, "closing process" warnings) would bury it.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    payload = replace(payload, t_origin=time.perf_counter())
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers GPUs as NVML and the topology do
    # Stages of many sizes come and go on each GPU: with fixed segments the caching allocator held
    # 180 MB reserved but unusable beside 500 MB of tensors under a 760 MB cap (H100, GPT-2 medium).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with scratch_dir("mobius-run-") as run_dir:
        # torch's own files of the launch (each worker's error file) go into it too, so a killed
        # launcher leaves none of them behind either.
        previous, tempfile.tempdir = tempfile.tempdir, run_dir
        try:
            if data is not None:
                payload = replace(payload, data=share(*data, run_dir))
            return _launch(n, entry, payload, run_dir)
        finally:
            tempfile.tempdir = previous


def _launch(n: int, entry, payload: WorkerPayload, run_dir: str) -> dict:
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"mobius-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn", signals_to_handle="",  # SIGINT, SIGTERM, SIGHUP, SIGQUIT: ours
                          logs_specs=DefaultLogsSpecs(log_dir=run_dir))  # the agent's directory goes with ours
    # First SIGINT/SIGTERM: the workers finish the step and save; a second: everything exits now.
    signals = LauncherSignals(run_dir)
    payload = replace(payload, launcher_pid=os.getpid(), stop_file=str(signals.stop.stop_file),
                      started_file=str(signals.started_file), run_dir=run_dir)
    try:
        with signals, outside_torchrun():
            return elastic_launch(launch, entry)(payload)
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
