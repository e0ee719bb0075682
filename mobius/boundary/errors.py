"""User-facing errors: bad input ends with one line and exit status 2, never a traceback."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def shown(text: object) -> str:
    """``text`` (a path, a message) with control characters escaped, so that a file name holding a
    newline cannot split a one-line message or forge a second ``error:`` line."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))


def first_line(err: BaseException, limit: int = 160) -> str:
    """The first line of ``err``'s message, at most ``limit`` characters, or its type's name when it
    says nothing (a template's ``raise_exception('')``): error formatting must never fail itself."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "") or type(err).__name__
    return shown(text[:limit])


class InputError(Exception):
    """A problem with what the user gave us (arguments, files, memory budgets)."""


class RunError(Exception):
    """The run cannot go on (a non-finite loss, a failed worker): one line, exit status 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception, like Ctrl-C's: ``finally`` blocks and context managers then clean
    up (temporary directories, calibration workers) whatever phase the command is in."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def exits_cleanly(main: Callable[..., T]) -> Callable[..., T]:
    """Wrap a command's ``main`` so an :class:`InputError` prints one line and exits 2, and a
    SIGINT or SIGTERM (outside training, which handles its own) one line and exits 128 + signal."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if sys.excepthook is _failed_while_importing:
            sys.excepthook = sys.__excepthook__  # from here on, what is not ours to report is a bug: a traceback
        ours = threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _interrupted_while_importing)
        previous = signal.signal(signal.SIGTERM, _terminate) if ours else None
        try:
            return main(*args, **kwargs)
        except InputError as err:
            print(f"error: {shown(err)}", file=sys.stderr)
            raise SystemExit(2)
        except RunError as err:
            print(f"error: {shown(err)}", file=sys.stderr)
            raise SystemExit(1)
        except MemoryError:  # a limit (ulimit -v, a cgroup) below what the pre-flight could see
            print("error: out of host memory (MemoryError): free memory, raise the limit or use a smaller "
                  "model, data or batch", file=sys.stderr)
            raise SystemExit(1)
        except KeyboardInterrupt as err:
            signum = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
            print(f"interrupted ({signum.name})", file=sys.stderr)
            raise SystemExit(128 + signum)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    return wrapper


def _interrupted_while_importing(signum, frame) -> None:
    print(f"interrupted ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _failed_while_importing(kind, value, tb) -> None:
    """The environment refused what importing torch needs (``ulimit -f 0``: no temporary file can
    be written; a missing library): one line, exit status 1."""
    print(f"error: cannot start: {shown(value)} ({kind.__name__} while importing)", file=sys.stderr)


def quiet_interrupts_while_importing() -> None:
    """A command module calls this first: Ctrl-C while torch is still importing (seconds) is one
    line and exit 130, like Ctrl-C later, not a traceback (SIGTERM: 143); so is an import the
    environment makes fail.  ``exits_cleanly`` takes over."""
    signal.signal(signal.SIGINT, _interrupted_while_importing)
    signal.signal(signal.SIGTERM, _interrupted_while_importing)
    sys.excepthook = _failed_while_importing
