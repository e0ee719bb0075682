"""Temporary directories a process makes for its children (a run's stop file and links, the
calibration's results) are removed even when that process is killed (``kill -9`` leaves it no
chance): a small watcher process, in a process group of its own so a terminal's Ctrl-C passes it by,
removes them once its parent is gone, and then exits.  What a library makes through :mod:`tempfile`
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

# The watcher: python -c WATCHER PARENT_PID DIR...; it polls for its parent's death.
WATCHER = """
import os, shutil, sys, time
parent, dirs = int(sys.argv[1]), sys.argv[2:]
while os.getppid() == parent:
    time.sleep(0.2)
for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
"""


@contextlib.contextmanager
def scratch_dir(prefix: str, under: str | None = None):
    """A fresh temporary directory (ours: made here; under ``under``, else the temporary
    directory), removed when the block ends, however this process ends."""
    directory = tempfile.mkdtemp(prefix=prefix, dir=under)
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(os.getpid()), directory],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               process_group=0)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        watcher.kill()
        watcher.wait()


@contextlib.contextmanager
def temporary_files_in(directory: str):
    """Within the block, what :mod:`tempfile` makes in this process goes into ``directory``."""
    previous, tempfile.tempdir = tempfile.tempdir, directory
    try:
        yield
    finally:
        tempfile.tempdir = previous
