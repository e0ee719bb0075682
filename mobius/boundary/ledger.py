"""Files a process makes in a directory the user named (``--offload-dir``, a drive being timed),
removed only while they are provably ours: never by their name alone.

Each file is created exclusively and its identity (device and inode) is written to the process's
ledger, a hidden file beside it, before the file holds a byte.  The process holds a lock on its
ledger (``flock``) for as long as it lives; the kernel lets go of it when the process dies, however
it dies.  So whoever finds a ledger unlocked knows its files are orphaned (:func:`remove_orphans`:
a run's janitor at its start and end, a later run on the same directory, and the watcher each
ledger starts, which outlives a process killed outright: :mod:`mobius.boundary.janitor`), and removes each one
only if the name still leads to that very file: a file of the user's put there since, renamed
over ours or named like it, is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

PREFIX = ".mobius-ledger-"
HEADER = b"mobius file ledger 1\n"  # a file of this name without it is not a ledger of ours


class FileLedger:
    """The files this process makes in ``directory``, each recorded as it is made."""

    def __init__(self, directory: str | os.PathLike, tag: str):
        # The watcher first: a process killed at any instant after this line has its files removed.
        # (Imported here: the watcher loads this module on its own, with the standard library only.)
        from mobius.boundary.janitor import watcher

        self.directory = Path(directory)
        self.watcher = watcher(str(self.directory), ledgers=True)
        self.path = self.directory / f"{PREFIX}{tag}-{os.getpid()}"
        # The ledger appears under its name locked and with its header, or not at all.
        self.fd = _made(self.path, os.O_APPEND, lambda fd: (fcntl.flock(fd, fcntl.LOCK_EX), os.write(fd, HEADER)))
        self.made: dict[str, tuple[int, int]] = {}  # name -> (device, inode)

    def create(self, name: str) -> int:
        """``name`` in the directory, created exclusively (never a file that was there) and recorded
        before it appears under that name; its descriptor, open for reading and writing."""
        def record(fd: int) -> None:
            st = os.fstat(fd)
            os.write(self.fd, f"{st.st_dev} {st.st_ino} {name}\n".encode())
            self.made[name] = (st.st_dev, st.st_ino)

        try:
            return _made(self.directory / name, 0, record)
        except BaseException:
            self.made.pop(name, None)
            raise

    def remove(self, name: str) -> None:
        """``name`` unlinked if it is still the file this ledger made."""
        _unlink_if_same(self.directory / name, self.made.pop(name, None))

    def close(self) -> None:
        """Every file still recorded removed (as :meth:`remove`), then the ledger itself."""
        from mobius.boundary.janitor import dismiss

        for name in list(self.made):
            self.remove(name)
        _unlink_if_same(self.path, _identity(os.fstat(self.fd)))
        os.close(self.fd)
        dismiss(self.watcher)


def remove_orphans(directory: str | os.PathLike) -> list[str]:
    """The files of every ledger in ``directory`` whose process is gone, each removed if its name
    still leads to the file recorded, and those ledgers; returns the ledgers still held (a process
    of a run that is alive)."""
    held = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for ledger in sorted(Path(directory).glob(PREFIX + "*")):
            try:
                fd = os.open(ledger, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held.append(ledger.name)
                    continue
                text = os.read(fd, 1 << 20)
                if not text.startswith(HEADER):
                    continue  # not ours: left as it is
                for line in text[len(HEADER):].decode(errors="replace").splitlines():
                    device, inode, name = (line.split(" ", 2) + ["", ""])[:3]
                    if device.isdigit() and inode.isdigit() and name and "/" not in name and name not in (".", ".."):
                        _unlink_if_same(Path(directory) / name, (int(device), int(inode)))
                _unlink_if_same(ledger, _identity(os.fstat(fd)))
            finally:
                os.close(fd)
    return held


def _made(path: Path, flags: int, prepare) -> int:
    """A new file at ``path`` (never one that was there), ``prepare``d (given its descriptor)
    before it has a name: made anonymous in its directory (``O_TMPFILE``) and linked into place,
    so a process killed at any instant leaves either nothing or the prepared file.  A file system
    without anonymous files gets it created exclusively under its name, then prepared."""
    try:
        fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR | flags, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here (not Linux, or not this file system)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | flags, 0o600)
        prepare(fd)
        return fd
    try:
        prepare(fd)
        # linkat(2) following /proc's link to the file itself (a directory descriptor given, so
        # Python calls linkat, not link); it never replaces what has the name.
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
        finally:
            os.close(proc)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _unlink_if_same(path: Path, identity: tuple[int, int] | None) -> None:
    """``path`` unlinked if it is the regular file ``identity`` names (not a link, not another)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if identity is not None and stat.S_ISREG(st.st_mode) and _identity(st) == identity:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
