"""Temporary directories a process makes for its children (a run's stop file and links, the
calibration's results), and the files a process makes in a directory the user named
(:mod:`mobius.boundary.ledger`), are removed even when that process is killed (``kill -9`` leaves
it no chance): a small watcher process, in a process group of its own so a terminal's Ctrl-C passes
it by, removes them once its parent is gone, and then exits.  What a library makes through :mod:`tempfile`
for our children (torch's error file per worker, multiprocessing's socket directory) is made in one
of them (:func:`temporary_files_in`): a child failing after its launcher was killed cannot leave a
file in the user's temporary directory either."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

# The watcher: python -c WATCHER PARENT_PID LEDGER_MODULE|- DIR...; it polls for its parent's
# death, then removes each DIR, or (given the path of mobius/boundary/ledger.py, which needs only
# the standard library) the orphaned files of the ledgers in each DIR.
WATCHER = """
import os, sys, time
parent, ledger, dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
while os.getppid() == parent:
    time.sleep(0.2)
if ledger == "-":
    import shutil
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
else:
    import importlib.util
    spec = importlib.util.spec_from_file_location("ledger", ledger)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for d in dirs:
        module.remove_orphans(d)
"""


def watcher(*directories: str, ledgers: bool = False) -> subprocess.Popen:
    """A process that, once this one is gone however it went, removes ``directories`` (with
    ``ledgers``: the orphaned files of the ledgers in them, :mod:`mobius.boundary.ledger`); in a
    process group of its own, so a terminal's Ctrl-C passes it by.  Stop it with :func:`dismiss`."""
    ledger = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ledger.py") if ledgers else "-"
    return subprocess.Popen([sys.executable, "-c", WATCHER, str(os.getpid()), ledger, *directories],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            process_group=0)


def dismiss(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


@contextlib.contextmanager
def scratch_dir(prefix: str, under: str | None = None):
    """A fresh temporary directory (ours: made here; under ``under``, else the temporary
    directory), removed when the block ends, however this process ends."""
    directory = tempfile.mkdtemp(prefix=prefix, dir=under)
    watching = watcher(directory)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        dismiss(watching)


@contextlib.contextmanager
def temporary_files_in(directory: str):
    """Within the block, what :mod:`tempfile` makes in this process goes into ``directory``."""
    previous, tempfile.tempdir = tempfile.tempdir, directory
    try:
        yield
    finally:
        tempfile.tempdir = previous
