"""User-facing errors: bad input ends with one line and exit status 2, never a traceback."""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

T = TypeVar("T")


class InputError(Exception):
    """A problem with what the user gave us (arguments, files, memory budgets)."""


class RunError(Exception):
    """The run cannot go on (a non-finite loss, a failed worker): one line, exit status 1."""


def exits_cleanly(main: Callable[..., T]) -> Callable[..., T]:
    """Wrap a command's ``main`` so an :class:`InputError` prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2)
        except RunError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(1)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130)

    return wrapper
