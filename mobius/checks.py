"""Typed, range-checked reading of the values users hand us in files (Hugging Face configs,
tokenizer and data records, checkpoint manifests): a wrong type or range is one
:class:`~mobius.errors.InputError` naming the file and the key, never a traceback later on."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mobius.errors import InputError

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
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{source}: not valid JSON ({err})") from None
    except RecursionError:
        raise InputError(f"{source}: JSON nested too deeply") from None


def read_json_object(path: Path) -> dict:
    """A small JSON object file of a model directory (tokenizer_config.json, generation_config.json)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise InputError(f"{path}: cannot read it ({err.strerror})") from None
    return Fields(parse_json(raw, str(path)), str(path)).obj
