"""We only delete or replace what we provably wrote.

Ownership is by content.  Every directory Mobius creates (a checkpoint, an export, and the staging
and previous-version siblings they are swapped through) carries :data:`MARKER`, a small JSON file
saying what it is and the SHA-256 of every file we put there.  A directory without it belongs to
the user: it is never removed or replaced, and the run refuses *before* training with one line
naming it.  A file whose bytes no longer match what we recorded (the user saved over an export),
or one we did not write at all (a note dropped into it), makes the directory the user's.  Staging
siblings have hidden names no user would pick (``.NAME.mobius-partial``).  Once a run has started,
a save or an export replaces only the files it lists as ours: anything the user puts into the
directory meanwhile is carried into the new version, and said once.

Output files (metrics, traces) are ours only when a hidden record beside them
(``.NAME.mobius-owned.json``) holds the SHA-256 of their current bytes: a file that merely looks
like one of ours is the user's.

The same pre-flight refuses output paths that coincide with an input or with each other
(``--metrics`` onto the data file, ``--export`` onto the model being read, ``--save X --export X``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

from mobius.boundary.checks import read_json
from mobius.boundary.errors import InputError, RunError, shown
from mobius.boundary.ledger import remove_orphans

MARKER = ".mobius-owned.json"
LOCK_TAG = b"mobius output lock\n"  # what a lock file of ours holds (an empty one: an older Mobius's)


def sibling(target: str | os.PathLike, role: str) -> Path:
    """Where ``target`` is staged (``partial``) or parked while it is replaced (``previous``)."""
    t = Path(target).resolve()
    return t.with_name(f".{t.name}.mobius-{role}")


def mark(directory: Path, kind: str) -> None:
    """Declare ``directory`` ours; the file list is completed by :func:`seal` when it is finished."""
    (directory / MARKER).write_text(json.dumps({"kind": kind, "files": None}))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def seal(directory: Path, known_digests: dict[str, str] | None = None) -> None:
    """Record every file now in ``directory`` as ours, by content (called once it is complete);
    ``known_digests``: SHA-256s just computed for the same bytes (a checkpoint's manifest)."""
    kind = owner_kind(directory)
    known = known_digests or {}
    entries = [f for f in sorted(directory.iterdir()) if f.name != MARKER]
    files = {f.name: known.get(f.name) or sha256_of(f) for f in entries}
    # Size and modification time beside each digest: what a save checks before removing the previous
    # version's files, without reading them again (the bytes were hashed when they were written).
    stats = {f.name: _stat_of(f) for f in entries}
    (directory / MARKER).write_text(json.dumps({"kind": kind, "files": files, "stat": stats}))


def _stat_of(path: Path) -> list[int]:
    st = path.lstat()
    return [st.st_size, st.st_mtime_ns]


def _marker(directory: Path) -> dict | None:
    try:
        d = read_json(directory / MARKER)
    except InputError:
        return None
    if not (isinstance(d, dict) and isinstance(d.get("kind"), str)):
        return None
    files = d.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        return None  # a marker of another shape (an older Mobius listed names only): not provably ours
    return d


def _unchanged(path: Path, digest: str) -> bool:
    """``path`` is a regular file (not a link) whose bytes still hash to ``digest``."""
    try:
        return path.is_file() and not path.is_symlink() and sha256_of(path) == digest
    except OSError:
        return False


def owner_kind(directory: str | os.PathLike) -> str | None:
    """The kind of directory we wrote there, or None when it is not provably ours."""
    d = _marker(Path(directory))
    return d["kind"] if d else None


def foreign_files(directory: str | os.PathLike, content: bool = True) -> list[str]:
    """Files in a directory of ours that we did not write or that changed since (all of them when
    it is not ours); without ``content``, by name only (a checkpoint about to be resumed, whose
    every byte the resume verifies against its manifest)."""
    directory = Path(directory)
    d = _marker(directory)
    present = sorted(f.name for f in directory.iterdir() if f.name != MARKER)
    if d is None:
        return present
    ours = d["files"]
    if ours is None:  # unsealed: a hidden staging directory we were still filling
        return [f for f in present if not (directory / f).is_file() or (directory / f).is_symlink()]
    return [f for f in present if f not in ours or (content and not _unchanged(directory / f, ours[f]))]


def is_removable(directory: str | os.PathLike, kind: str) -> bool:
    """True when ``directory`` is a ``kind`` directory of ours holding only files we wrote."""
    directory = Path(directory)
    return owner_kind(directory) == kind and not foreign_files(directory)


def check_removable(directory: str | os.PathLike, kind: str, option: str, content: bool = True) -> None:
    """Pre-flight for a path we would replace: absent, empty, or provably ours (``content``: see
    :func:`foreign_files`)."""
    d = Path(directory)
    if not d.exists() and not d.is_symlink():
        return
    if d.is_symlink() or not d.is_dir():
        raise InputError(f"{option}: {d} exists and is not a directory Mobius wrote; refusing to replace it")
    if not any(d.iterdir()):
        return
    if owner_kind(d) != kind:
        raise InputError(f"{option}: {d} exists and was not written by Mobius (no {MARKER}); "
                         "refusing to replace it: move it away or choose another path")
    extra = foreign_files(d, content)
    if extra:
        raise InputError(f"{option}: {d} holds files Mobius did not write or that changed since "
                         f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); refusing to replace it")


def remove(directory: str | os.PathLike, kind: str) -> None:
    """Remove ``directory`` if it is ours (or empty); anything else is left alone and reported."""
    d = Path(directory)
    if not d.exists():
        return
    if d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        return
    if not is_removable(d, kind):
        raise InputError(f"{d} was not written by Mobius; refusing to remove it")
    shutil.rmtree(d)


def fresh_dir(directory: str | os.PathLike, kind: str) -> Path:
    """An empty directory of ours at ``directory``, replacing only a leftover of ours."""
    d = Path(directory)
    remove(d, kind)
    d.mkdir(parents=True)
    mark(d, kind)
    return d


def swap_into_place(staging: Path, final: str | os.PathLike, kind: str,
                    known_digests: dict[str, str] | None = None) -> None:
    """Rename the complete ``staging`` to ``final``; a previous ``final`` (ours) is parked beside
    it until the new one is in place, so a crash at any instant leaves one complete version."""
    seal(staging, known_digests)
    final = Path(final).resolve()
    previous = sibling(final, "previous")
    if final.exists():
        if previous.exists():  # a stale parked copy (``final`` is the good one): ours go, the rest moves in
            _clear_previous(previous, final)
        if any(final.iterdir()):
            os.replace(final, previous)
        else:
            final.rmdir()
    os.replace(staging, final)
    if previous.exists():  # what ``final`` held a moment ago: ours, and whatever the user put there since
        _clear_previous(previous, final)


def _clear_previous(previous: Path, final: Path) -> None:
    """Remove from ``previous`` the files it lists as ours and move everything else (a note the user
    wrote into the directory while the run trained) into ``final``, saying so: nothing is removed
    that we did not write.  A name ``final`` already holds keeps the user's file beside ours."""
    marker = _marker(previous) or {}
    listed, stats = marker.get("files") or {}, marker.get("stat") or {}
    for name, digest in listed.items():
        path = previous / name
        try:
            same = _stat_of(path) == stats[name] if name in stats else _unchanged(path, digest)
        except OSError:
            continue
        if same and path.is_file() and not path.is_symlink():
            path.unlink()
    (previous / MARKER).unlink(missing_ok=True)
    kept = []
    for _ in range(2):  # a second pass for what appeared during the first
        for entry in sorted(previous.iterdir()):
            target, n = final / entry.name, 1
            while target.exists() or target.is_symlink():
                target, n = final / f"{entry.name}.user-{n}", n + 1
            os.replace(entry, target)
            kept.append(target.name)
    with contextlib.suppress(OSError):  # written into at this very instant: left for the next save to move
        previous.rmdir()
    new = [name for name in kept if (final, name) not in _announced]  # each file said once a run
    _announced.update((final, name) for name in new)
    if new:
        print(f"note: {final}: kept {len(new)} file(s) Mobius did not write ({', '.join(new[:3])}"
              f"{', ...' if len(new) > 3 else ''})", file=sys.stderr, flush=True)


_announced: set[tuple[Path, str]] = set()


# ---- one run per output ----------------------------------------------------------------------------

@contextlib.contextmanager
def made_parents(outputs: dict[str, str | None]):
    """The missing parent directories of each output (``option -> path``), made for as long as the
    run lasts (``--metrics runs/m.jsonl`` with no ``runs/``).  They are ours: when the run ends,
    each one we made that is empty (the run wrote nothing there, or was refused before it did) is
    removed again; a directory holding anything stays.  Where one cannot be made it is said in one
    line, before anything else happens."""
    made: list[Path] = []
    try:
        for option, path in outputs.items():
            if not path:
                continue
            missing = []
            parent = Path(path).absolute().parent
            while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
                missing.append(parent)
                parent = parent.parent
            if not missing:
                continue
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise InputError(f"{option} {path}: cannot make its directory {missing[-1]} ({parent} is not a "
                                 "writable directory)")
            for d in reversed(missing):
                try:
                    d.mkdir()
                except OSError as err:
                    raise InputError(f"{option} {path}: cannot make its directory {d} ({err.strerror})") from None
                made.append(d)
        yield
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()  # only an empty directory: nothing of anyone's is ever removed


@contextlib.contextmanager
def output_locks(outputs: dict[str, str | None]):
    """An exclusive lock on each output (``option -> path``) for as long as the run lasts: a second
    run given the same ``--save``, ``--export``, metrics file, ... is refused in one line before it
    trains.  The lock is a hidden sibling we create (``.NAME.mobius-lock``), locked with ``flock``:
    the kernel releases it when the process dies, however it dies."""
    held: list[tuple[int, Path]] = []
    try:
        for option, path in outputs.items():
            if not path or not Path(path).resolve().parent.is_dir():
                continue  # the pre-flight says what is wrong with it
            lock = sibling(path, "lock")
            if any(lock == mine for _, mine in held):
                continue  # two options naming one path: the pre-flight refuses the overlap
            try:  # never through a link (a dangling one would create a file elsewhere)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                raise InputError(f"{option} {path}: cannot create its lock {lock}: {err.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.pread(fd, len(LOCK_TAG) + 1, 0) not in (b"", LOCK_TAG):
                os.close(fd)
                raise InputError(f"{option} {path}: {lock} exists and is not a lock Mobius made; refusing to "
                                 "use or remove it: move it away")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise InputError(f"{option} {path}: another run is writing it (it holds {lock}); "
                                 "refusing to start a second one") from None
            os.pwrite(fd, LOCK_TAG, 0)
            held.append((fd, lock))
        yield
    finally:
        for fd, lock in reversed(held):
            with contextlib.suppress(OSError):
                os.unlink(lock)  # ours (made or proven ours above), while still held: a run waiting for it
            os.close(fd)         # finds it gone and makes its own


# ---- inputs and outputs must not coincide ------------------------------------------------------

def _inside(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies under it."""
    return a == b or b in a.parents


def check_paths(inputs: dict[str, str | None], outputs: dict[str, tuple[str | None, str]]) -> None:
    """``inputs``: option -> path read; ``outputs``: option -> (path, "file" | "dir").

    No output may be an input, contain one or lie inside one, and no two outputs may overlap.
    ``--save`` may equal ``--resume`` (continuing a run in place)."""
    ins = {k: Path(v).resolve() for k, v in inputs.items() if v}
    outs = {k: (Path(v).resolve(), kind) for k, (v, kind) in outputs.items() if v}
    for o, (op, okind) in outs.items():
        for i, ip in ins.items():
            if o == "--save" and i == "--resume" and op == ip:
                continue
            if _inside(op, ip) or (okind == "dir" and _inside(ip, op)):
                raise InputError(f"{o} {op} overlaps {i} {ip}: an output must not replace or sit inside what "
                                 "the run reads")
    names = list(outs)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            (pa, ka), (pb, kb) = outs[names[a]], outs[names[b]]
            if pa == pb or (ka == "dir" and _inside(pb, pa)) or (kb == "dir" and _inside(pa, pb)):
                raise InputError(f"{names[a]} {pa} and {names[b]} {pb} overlap: give each output its own path")


def record_of(path: str | os.PathLike) -> Path:
    """The hidden record beside an output file that says it is ours."""
    p = Path(path).resolve()
    return p.with_name(f".{p.name}.mobius-owned.json")


def record_file(path: str | os.PathLike, digest: str, previous: str | None = None) -> None:
    """Declare the file at ``path`` ours with the bytes of ``digest``.  Written *before* the file
    changes, with the digest of its bytes until then (``previous``), so a crash between the two
    writes leaves a file that is still provably ours."""
    digests = [digest] + ([previous] if previous and previous != digest else [])
    write_atomically(record_of(path), json.dumps({"kind": "output-file", "sha256": digests}))


def is_our_file(path: str | os.PathLike) -> bool:
    """The file's current bytes are ones we recorded when we wrote it."""
    try:
        d = read_json(record_of(path))
    except InputError:
        return False
    digests = d.get("sha256") if isinstance(d, dict) else None
    if not (isinstance(digests, list) and all(isinstance(x, str) for x in digests)):
        return False
    try:
        p = Path(path)
        return p.is_file() and not p.is_symlink() and sha256_of(p) in digests
    except OSError:
        return False


def check_output_file(option: str, path: str | None) -> None:
    """An output file must be creatable, and an existing one must be one we wrote, byte for byte
    (:func:`is_our_file`), since it will be replaced or appended to."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{option} {path}: is a directory; give a file name")
    _check_parent(option, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError(f"{option} {path}: not writable")
    if (p.exists() or p.is_symlink()) and not is_our_file(p):
        raise InputError(f"{option} {path}: exists and is not a file Mobius wrote (or it changed since); "
                         "refusing to overwrite it")


def check_swapped_dir(option: str, target: str, kind: str, replaced: bool) -> None:
    """Pre-flight for a directory written whole beside ``target`` and swapped into place
    (:func:`swap_into_place`): its parent is a writable directory, it is not a file, and its
    staging and parked siblings hold nothing we did not write as ``kind``; ``replaced``: nor does
    ``target`` (a caller that may replace another kind of content checks ``target`` itself)."""
    _check_parent(option, target)
    if Path(target).exists() and not Path(target).is_dir():
        raise InputError(f"{option} {target}: exists and is not a directory; refusing to replace it")
    for path in ((Path(target),) if replaced else ()) + (sibling(target, "partial"), sibling(target, "previous")):
        check_removable(path, kind, option)


def _check_parent(option: str, path: str) -> None:
    """The directory an output goes into is one, and writable."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{option} {path}: {parent} is not a directory" if parent.exists() else
                         f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option} {path}: not writable")


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike, note: str = ""):
    """An output that cannot be written (disk full, permissions) is one line naming the path and
    what to do, not a traceback.  ``note`` says what survives (e.g. the previous checkpoint)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as err:
        why = f"{err.strerror} ({err.filename or path})" if isinstance(err, OSError) and err.strerror else str(err)
        raise RunError(f"writing {what} {path} failed: {why}; {note + '; ' if note else ''}"
                       "free space or fix permissions and run again") from None


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``path`` through a uniquely named temporary file beside it (created exclusively, so
    it can never be a file of the user's) and rename it into place."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".mobius-partial", dir=path.resolve().parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output_file(option: str, path: str | os.PathLike, text: str) -> None:
    """Write the output file ``path`` (checked by :func:`check_output_file` before the work that
    made ``text``): created only where nothing is there now, replaced only where what is there is
    still a file we wrote; recorded as ours before it lands.  A file that appeared, or changed, in
    the meantime is left as it is and the write refused in one line."""
    import tempfile

    path = Path(path)
    data = text.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".mobius-partial", dir=path.resolve().parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        exists = path.exists() or path.is_symlink()
        if exists and not is_our_file(path):
            raise InputError(f"{option} {path}: a file that is not ours appeared there (or ours changed) while it "
                             "was being made; left as it is, nothing written")
        record_file(path, hashlib.sha256(data).hexdigest(), previous=sha256_of(path) if exists else None)
        if exists:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # created only if still absent, atomically
            except FileExistsError:
                raise InputError(f"{option} {path}: a file appeared there while it was being made; left as it "
                                 "is, nothing written") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def working_dir(option: str, path: str | os.PathLike | None):
    """A directory the run fills with files of its own while it lasts (``--offload-dir``): it must
    be absent (made here, removed at the end) or empty (left empty at the end), never a directory
    that holds a file of the user's.  The run's processes record every file they make there in
    their ledgers (:mod:`mobius.boundary.ledger`) and remove them; what a process that died first
    left is removed here, at the end, and by the next run on the directory, at its start: each file
    its ledger recorded, while its name still leads to it.  What remains is not ours."""
    if path is None:
        yield
        return
    where = Path(path)
    if where.is_symlink() or (where.exists() and not where.is_dir()):
        raise InputError(f"{option} {shown(where)} is not a directory")
    if where.is_dir():
        held = remove_orphans(where)  # what a run killed before it could clean up left
        if held:
            raise InputError(f"{option} {shown(where)} is in use by a running Mobius process ({held[0]})")
        if any(where.iterdir()):
            raise InputError(f"{option} {shown(where)} holds files Mobius did not write: give an empty or new "
                             "directory")
    made = not where.exists()
    try:
        where.mkdir(exist_ok=True)
        probe = where / f".mobius-probe-{os.getpid()}"  # a name of ours: can the run write here?
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as err:
        if made:
            with contextlib.suppress(OSError):
                where.rmdir()
        raise InputError(f"{option} {shown(where)}: cannot write there ({err.strerror})") from None
    try:
        yield
    finally:
        remove_orphans(where)
        if made:
            with contextlib.suppress(OSError):
                where.rmdir()  # empty again; anything left in it is not ours to remove
