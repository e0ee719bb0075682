"""Graceful stop: the first SIGINT/SIGTERM finishes the current step, saves and exits 0; a second
one exits at once.

In a pipeline run the launcher owns the decision: it touches a stop file that every worker checks
at the end of each step.  The workers agree through a collective, so all of them stop after the
same step.  A worker's own handler only records the signal (a terminal's Ctrl-C reaches every
process of the group).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path


class StopRequest:
    def __init__(self, stop_file: str | os.PathLike | None = None, announce: bool = True, kill_children: bool = False):
        self.stop_file = Path(stop_file) if stop_file else None
        self.announce = announce
        self.kill_children = kill_children
        self.requested = False

    def install(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

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
