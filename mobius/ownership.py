"""We only delete or replace what we provably wrote.

Every directory Mobius creates (a checkpoint, an export, and the staging and previous-version
siblings they are swapped through) carries :data:`MARKER`, a small JSON file saying what it is and
which files we put there.  A directory without it belongs to the user: it is never removed or
replaced, and the run refuses *before* training with one line naming it.  Staging siblings have
hidden names no user would pick (``.NAME.mobius-partial``), and a directory of ours that holds a
file we did not write (a note the user dropped into an export) is treated as the user's.

The same pre-flight refuses output paths that coincide with an input or with each other
(``--metrics`` onto the data file, ``--export`` onto the model being read, ``--save X --export X``),
and existing metrics or trace files that are not ones we wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from mobius.errors import InputError, RunError

MARKER = ".mobius-owned.json"


def sibling(target: str | os.PathLike, role: str) -> Path:
    """Where ``target`` is staged (``partial``) or parked while it is replaced (``previous``)."""
    t = Path(target).resolve()
    return t.with_name(f".{t.name}.mobius-{role}")


def mark(directory: Path, kind: str) -> None:
    """Declare ``directory`` ours; the file list is completed by :func:`seal` when it is finished."""
    (directory / MARKER).write_text(json.dumps({"kind": kind, "files": None}))


def seal(directory: Path) -> None:
    """Record every file now in ``directory`` as ours (called once it is complete)."""
    kind = owner_kind(directory)
    files = sorted(f.name for f in directory.iterdir() if f.name != MARKER)
    (directory / MARKER).write_text(json.dumps({"kind": kind, "files": files}))


def _marker(directory: Path) -> dict | None:
    try:
        d = json.loads((directory / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("kind"), str) else None


def owner_kind(directory: str | os.PathLike) -> str | None:
    """The kind of directory we wrote there, or None when it is not provably ours."""
    d = _marker(Path(directory))
    return d["kind"] if d else None


def foreign_files(directory: str | os.PathLike) -> list[str]:
    """Files in a directory of ours that we did not write (all of them when it is not ours)."""
    directory = Path(directory)
    d = _marker(directory)
    present = sorted(f.name for f in directory.iterdir() if f.name != MARKER)
    if d is None:
        return present
    ours = d["files"]
    if ours is None:  # unsealed: a staging directory we were still filling
        return [f for f in present if not (directory / f).is_file()]
    return [f for f in present if f not in ours]


def is_removable(directory: str | os.PathLike, kind: str) -> bool:
    """True when ``directory`` is a ``kind`` directory of ours holding only files we wrote."""
    directory = Path(directory)
    return owner_kind(directory) == kind and not foreign_files(directory)


def check_removable(directory: str | os.PathLike, kind: str, option: str) -> None:
    """Pre-flight for a path we would replace: absent, empty, or provably ours."""
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
    extra = foreign_files(d)
    if extra:
        raise InputError(f"{option}: {d} holds files Mobius did not write ({', '.join(extra[:3])}"
                         f"{', ...' if len(extra) > 3 else ''}); refusing to replace it")


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


def swap_into_place(staging: Path, final: str | os.PathLike, kind: str) -> None:
    """Rename the complete ``staging`` to ``final``; a previous ``final`` (ours) is parked beside
    it until the new one is in place, so a crash at any instant leaves one complete version."""
    seal(staging)
    final = Path(final).resolve()
    previous = sibling(final, "previous")
    if final.exists():
        remove(previous, kind)  # a stale parked copy: ``final`` is the good one
        if any(final.iterdir()):
            os.replace(final, previous)
        else:
            final.rmdir()
    os.replace(staging, final)
    remove(previous, kind)


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


def check_output_file(option: str, path: str | None, looks_ours) -> None:
    """An output file must be creatable, and an existing one must be one we wrote
    (``looks_ours(first_bytes) -> bool``), since it will be replaced or appended to."""
    if path is None:
        return
    p = Path(path)
    parent = p.resolve().parent
    if p.is_dir():
        raise InputError(f"{option} {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise InputError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{option} {path}: not writable")
    if p.exists():
        try:
            with open(p, "rb") as f:
                head = f.read(4096)
        except OSError as err:
            raise InputError(f"{option} {path}: cannot read it to check it is ours: {err.strerror}") from None
        if head and not looks_ours(head):
            raise InputError(f"{option} {path}: exists and is not a file Mobius wrote; refusing to overwrite it")


def check_output_dir_parent(option: str, path: str) -> None:
    p = Path(path)
    parent = p.resolve().parent
    if not parent.is_dir():
        raise InputError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option} {path}: not writable")
    if p.exists() and not p.is_dir():
        raise InputError(f"{option} {path}: exists and is not a directory; refusing to replace it")


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
