"""Typed, range-checked reading of the values users hand us in files (Hugging Face configs,
tokenizer and data records, checkpoint manifests): a wrong type or range is one
:class:`~mobius.boundary.errors.InputError` naming the file and the key, never a traceback later on."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from mobius.boundary.errors import InputError, shown

REQUIRED = object()
_KINDS = {"int": "an integer", "number": "a finite number", "bool": "true or false", "str": "a string",
          "dict": "an object", "list": "a list"}


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"bool": bool, "str": str, "dict": dict, "list": list}[kind])


class Fields:
    """The keys of one JSON object from ``source`` (a path and option, for the messages)."""

    def __init__(self, obj: Any, source: str):
        if not isinstance(obj, dict):
            raise InputError(f"{source}: must be a JSON object, got {type(obj).__name__}")
        self.obj = obj
        self.source = source

    def __contains__(self, key: str) -> bool:
        return key in self.obj and self.obj[key] is not None

    def get(self, key: str, kind: str, default: Any = REQUIRED, minimum: float | None = None) -> Any:
        """``obj[key]`` of ``kind`` (``int``, ``number``, ``bool``, ``str``, ``dict``, ``list``);
        a missing or null key gives ``default``, or an error when there is none."""
        value = self.obj.get(key)
        if value is None:
            if default is REQUIRED:
                raise InputError(f"{self.source} lacks {key!r}")
            return default
        if not _is(value, kind):
            raise InputError(f"{self.source}: {key!r} must be {_KINDS[kind]}, got {value!r}")
        if minimum is not None and value < minimum:
            raise InputError(f"{self.source}: {key!r} must be at least {minimum:g}, got {value!r}")
        return float(value) if kind == "number" else value


def parse_json(text: str | bytes, source: str) -> Any:
    """JSON from a user's file or line; malformed or absurdly nested input is one line naming ``source``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")  # JSON is UTF-8 (RFC 8259); a byte-order mark is not content
        except UnicodeDecodeError as err:
            raise InputError(f"{source}: is not UTF-8 text (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{source}: not valid JSON ({err})") from None
    except RecursionError:
        raise InputError(f"{source}: JSON nested too deeply") from None


MAX_JSON_BYTES = 256 * 2**20  # the largest JSON file we read (a tokenizer.json is a few MB)


def read_json(path: str | os.PathLike, source: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The one reader of every JSON file, the user's or ours (configs, manifests, markers, cache
    entries): a regular file (a FIFO or a device is never opened for a blocking read), at most
    ``max_bytes``, valid and not absurdly nested, else one :class:`InputError` naming ``source``."""
    source = source or shown(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InputError(f"{source}: not a regular file")
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise InputError(f"{source}: cannot read it ({err.strerror})") from None
    if len(raw) > max_bytes:
        raise InputError(f"{source}: larger than {max_bytes} bytes")
    return parse_json(raw, source)


def read_json_object(path: Path) -> dict:
    """A small JSON object file of a model directory (tokenizer_config.json, generation_config.json)."""
    return Fields(read_json(path), shown(path)).obj
