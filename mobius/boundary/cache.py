"""The on-disk cache under ``~/.cache/mobius`` (or ``$MOBIUS_CACHE``): measured profiles, the
runtime's calibrated costs and plans, one JSON file per entry.

An entry is trusted only when its bytes parse, the SHA-256 it carries matches its payload and the
caller's check accepts the payload (a plan covers each layer once, costs are finite and positive):
an edited or damaged entry is named in one line, set aside as ``NAME.bad`` and rebuilt, never
trained on.  Entries are written atomically under an exclusive lock.  The cache only saves time:
a cache directory that cannot be read or written is said once, and the run goes on without it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from mobius.boundary.checks import read_json
from mobius.boundary.errors import InputError, shown

T = TypeVar("T")

CACHE_DIR: Path | None = None  # None: $MOBIUS_CACHE, else ~/.cache/mobius (read at each use); tests point it elsewhere


def cache_root() -> Path:
    """Where the caches are: read at each use, so that a worker forked from a server started
    earlier (:mod:`mobius.launcher`) sees the environment its launcher gave it."""
    if CACHE_DIR is not None:
        return CACHE_DIR
    return Path(os.environ.get("MOBIUS_CACHE", Path.home() / ".cache" / "mobius"))


MAX_ENTRY_BYTES = 64 * 2**20  # a plan or profile of 2^14 layers is a few MB
ENTRY_FORMAT = 1  # part of every key: entries of another layout are simply not found


class BadEntry(ValueError):
    """A cache entry's payload does not describe what it is cached for."""


def key_of(obj: Any) -> str:
    """The file name of what ``obj`` (JSON-able) describes."""
    return hashlib.sha256(json.dumps([ENTRY_FORMAT, obj], sort_keys=True, default=str).encode()).hexdigest()[:20]


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _read_entry(path: Path) -> Any:
    """The entry's JSON; unreadable for want of permission is the cache's problem, not the entry's."""
    if not os.access(path, os.R_OK):
        raise PermissionError(13, "Permission denied", str(path))
    try:
        return read_json(path, "the entry", MAX_ENTRY_BYTES)
    except InputError as err:
        raise BadEntry(str(err).removeprefix("the entry: ")) from None


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"note: {message}", file=sys.stderr, flush=True)


class Cache:
    """The entries of one kind: ``kind`` names their directory, ``what`` one entry in messages."""

    def __init__(self, kind: str, what: str):
        self.kind, self.what = kind, what

    @property
    def directory(self) -> Path:
        return cache_root() / self.kind

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str, accept: Callable[[Any], T]) -> T | None:
        """The entry's payload as ``accept`` makes it, or None when there is none or it is bad
        (then it is set aside).  ``accept`` raises :class:`BadEntry` (or ``ValueError``,
        ``TypeError``, ``KeyError``) for a payload it cannot use."""
        path = self.path(key)
        try:
            if not path.is_file():
                return None
            entry = _read_entry(path)
            if not isinstance(entry, dict) or set(entry) != {"sha256", "payload"}:
                raise BadEntry("not an entry written by mobius")
            if entry["sha256"] != _digest(entry["payload"]):
                raise BadEntry("its content does not match its digest (edited or damaged)")
            return accept(entry["payload"])
        except PermissionError as err:
            _say_once(f"cannot read the {self.kind} cache ({err.strerror}: {shown(path)}); going on without it")
            return None
        except OSError as err:
            _say_once(f"cannot read the {self.kind} cache ({err.strerror}); going on without it")
            return None
        except (InputError, BadEntry, ValueError, TypeError, KeyError, AttributeError) as err:
            self._set_aside(path, str(err) or type(err).__name__)
            return None

    def put(self, key: str, payload: Any) -> None:
        """Write the entry atomically (a unique temporary file renamed over it) under the entry's lock."""
        path = self.path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Never through a link, never truncated: a lock file replaced by a link to a file of the
            # user's must not touch that file (O_NOFOLLOW refuses it).
            lock = os.open(self.directory / f".{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                if not _locked_within(lock, LOCK_WAIT_S, f"{self.kind} cache entry {shown(path)}"):
                    _say_once(f"another process has held the lock of the {self.kind} cache entry {shown(path)} for "
                              f"{LOCK_WAIT_S:g} s; going on without writing it")
                    return
                tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps({"sha256": _digest(payload), "payload": payload}))
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
            finally:
                os.close(lock)
        except OSError as err:
            _say_once(f"cannot write the {self.kind} cache under {shown(cache_root())} ({err.strerror}); "
                      "going on without it")

    def _set_aside(self, path: Path, reason: str) -> None:
        aside = path.with_name(path.name + ".bad")
        try:
            os.replace(path, aside)
            where = f"set aside as {shown(aside)}"
        except OSError:
            where = "left in place"
        print(f"note: cached {self.what} {shown(path)} is not usable ({reason}); {where}, rebuilding it",
              file=sys.stderr, flush=True)


# A cache entry's lock is held for the milliseconds a write takes: a wait past this is another
# process stuck (or stopped) holding it, and the cache only saves time.
LOCK_WAIT_S = 10.0


def _locked_within(fd: int, seconds: float, what: str) -> bool:
    """``fd``'s exclusive lock taken within ``seconds`` (said once after the first second)."""
    deadline, said = time.monotonic() + seconds, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not said and seconds - left >= 1.0:
            print(f"note: waiting for the lock of the {what}, held by another process (at most {seconds:g} s)",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.05, left))
