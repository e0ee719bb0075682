"""Fault injection for the tests of dead and interrupted workers, kept out of the product: a process
started with this directory on ``PYTHONPATH`` and ``MOBIUS_FAULT`` set patches the worker module as
it is imported (by the run's main process, multiprocessing's fork server or a spawned worker alike).

``MOBIUS_FAULT=RANK:STEP`` SIGKILLs worker RANK as it begins step STEP; ``MOBIUS_FAULT=start`` holds
every worker before training starts (for a signal that comes while the workers start, whose start is
otherwise a fraction of a second)."""

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

FAULT = os.environ.get("MOBIUS_FAULT")
WORKER = "mobius.runtime.worker"
HELD_S = 600


def _patch(worker) -> None:
    timed_step, install_stop = worker.timed_step, worker.install_stop

    def faulty_step(backend, step, *args):
        import torch.distributed as dist  # every worker has joined its group before its first step

        if FAULT == f"{dist.get_rank()}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        return timed_step(backend, step, *args)

    def held_start(*args):
        if FAULT == "start":
            time.sleep(HELD_S)
        return install_stop(*args)

    worker.timed_step, worker.install_stop = faulty_step, held_start


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != WORKER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def run_then_patch(module) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = run_then_patch
        return spec


if FAULT:
    sys.meta_path.insert(0, _PatchOnImport())
