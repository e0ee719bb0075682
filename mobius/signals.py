"""Graceful stop: the first SIGINT/SIGTERM finishes the current step, saves and exits 0; a second
one exits at once.

In a pipeline run the launcher owns the decision: it touches a stop file that every worker checks
at the end of each step.  The workers agree through a collective, so all of them stop after the
same step.  A worker's own handler only records the signal (a terminal's Ctrl-C reaches every
process of the group).

Before training has started there is nothing to save: a signal then kills the workers and exits
130 with one line.  The launcher blocks the signals while it spawns the workers, so they start
with them blocked (a signal mask is inherited; the fork server they are forked from starts with
them blocked too) and see one only once their handler is installed: no half-started worker ever
prints a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import sys
import threading
import warnings
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

# SIGHUP (the terminal closed) and SIGQUIT are handled as SIGTERM: the step finishes and is saved,
# instead of torch's agent raising its SignalException through the launcher.
SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


_tracker_watched = False


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (once) before any process is spawned.  It ignores
    SIGINT and SIGTERM by itself; a closing terminal's SIGHUP (and SIGQUIT) reach the whole process
    group, so it is started ignoring those too (the setting survives its exec), or it would die of
    them and print a traceback for every shared-memory block it then loses track of.  A tracker
    killed all the same is replaced by a quiet one (:func:`watch_resource_tracker`)."""
    global _tracker_watched
    # (A worker killed mid-run leaves a semaphore the tracker cleans up; its warning about that
    # would follow our one-line report.)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        resource_tracker.ensure_running()
    finally:
        for sig, handler in ignored.items():
            signal.signal(sig, handler)
    if not _tracker_watched:
        _tracker_watched = True
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # the watcher never takes our signals
        try:
            threading.Thread(target=watch_resource_tracker, name="mobius-resource-tracker", daemon=True).start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def watch_resource_tracker() -> None:
    """Replace the resource tracker as soon as it dies (a user's ``pkill python``, say).  Left
    dead, it is relaunched by the next semaphore finalized (torch's agent finalizes its own as the
    workers end) and the new tracker, which never saw the run's semaphores registered, prints a
    ``KeyError`` traceback for each one it is told to forget.  Its pipe's write end, which we hold,
    reports an error once no tracker holds the read end."""
    while True:
        poller = select.poll()
        poller.register(resource_tracker.getfd(), 0)  # errors and hang-ups are always reported
        poller.poll()
        quiet_resource_tracker()


def quiet_resource_tracker() -> None:
    """Relaunch the resource tracker if it died, with its stderr on /dev/null (see
    :func:`watch_resource_tracker`); while it is alive this does nothing.  A worker calls it as it
    ends, before its own semaphores are finalized."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    # A new tracker inherits our stderr and our signal mask: it writes nowhere, and a terminal's
    # hang-up (which it leaves blocked) does not end it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        os.dup2(devnull, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "process died unexpectedly, relaunching"
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(saved)
        os.close(devnull)


def start_fork_server() -> None:
    """Start multiprocessing's fork server (once) with our signals blocked: the server and every
    worker forked from it start with them blocked (a signal mask survives fork and exec), so neither
    a terminal's Ctrl-C reaches a worker before its handler is installed nor its hang-up ends the
    server under the running workers."""
    start_resource_tracker()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def signals_deferred():
    """Our signals, arriving within the block, handled as it ends (by the handlers in place before
    it): what the block starts is registered for cleanup before a signal can interrupt its start.
    Blocking them would not do: a thread that does not block them (one of torch's) would take them
    and the main thread would still run their handler inside the block.  Off the main thread, where
    no handler runs, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


class StopRequest:
    def __init__(self, stop_file: str | os.PathLike | None = None, announce: bool = True, kill_children: bool = False):
        self.stop_file = Path(stop_file) if stop_file else None
        self.announce = announce
        self.kill_children = kill_children
        self.requested = False

    def install(self) -> "StopRequest":
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # blocked since the launcher spawned us
        return self

    def __enter__(self) -> "StopRequest":
        """For a run inside a longer-lived process (the single backend in the command's process,
        a test): the handlers are the run's only while it lasts."""
        return self.install()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if self.kill_children:
                for child in multiprocessing.active_children():
                    child.kill()
            if self.announce:
                print(f"\n{signal.Signals(signum).name} again: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        if self.stop_file is not None:
            self.stop_file.touch()
        if self.announce:
            print(f"\n{signal.Signals(signum).name}: finishing the current step, then saving "
                  "(send it again to exit at once)", file=sys.stderr, flush=True)

    def check(self) -> bool:
        return self.requested or (self.stop_file is not None and self.stop_file.exists())


class LauncherSignals:
    """The launcher's signals while workers run: handled in a thread of their own (``sigwait``)
    with SIGINT/SIGTERM blocked everywhere else, so the workers it spawns inherit the block.
    ``started_file`` exists once a worker is about to train."""

    def __init__(self, run_dir: str | os.PathLike):
        self.stop = StopRequest(Path(run_dir) / "stop", kill_children=True)
        self.started_file = Path(run_dir) / "started"
        self.aborted = 0  # the signal that ended the run before training started
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mobius-signals", daemon=True)

    def __enter__(self) -> "LauncherSignals":
        # multiprocessing's resource tracker, when it first starts, unblocks these signals in the
        # calling thread: start it before blocking them.
        start_resource_tracker()
        # Threads started earlier (a solver's) may still take a signal: then the handler runs here.
        self._previous = {sig: signal.signal(sig, lambda signum, frame: self._on_signal(signum)) for sig in SIGNALS}
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _loop(self) -> None:
        while not self._done.is_set():
            info = signal.sigtimedwait(SIGNALS, 0.2)
            if info is not None:
                self._on_signal(info.si_signo)

    def _on_signal(self, signum: int) -> None:
        if self.aborted or not self.started_file.exists():
            # Nothing to save yet: end the workers; the launcher then exits with one line.  Workers
            # the agent has not spawned yet find the stop file and stop after their first step, as
            # they would mid-training (else they would train every step of a stopped run).
            self.aborted = self.aborted or signum
            self.stop.stop_file.touch()
            for child in multiprocessing.active_children():
                child.kill()
            return
        self.stop._handle(signum, None)
