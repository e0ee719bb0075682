"""Per-step metrics (``--metrics``: one JSON line per step, the fields of :class:`StepMetrics`) and a
Chrome trace writer (``--trace``); the reporters that also get the step's scalars are
:mod:`mobius.metrics.reporters`'s."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mobius.boundary.ownership import record_file, sha256_of, write_atomically, writing


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    tokens: int  # the step's tokens, its examples' padding left out
    step_time_s: float
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    peer_bytes: int = 0
    peak_device_bytes: int = 0
    loss_scale: float = 1.0  # fp16 dynamic loss scale after this step
    skipped_steps: int = 0  # fp16 steps skipped for overflow so far
    emulated_step_s: float | None = None  # --emulate: the step time on the emulated GPUs (wall / dilation)
    # Pipeline: the busiest worker's host AdamW seconds in the step (emulated: on the emulated host),
    # and the parameters per second the hosts' AdamW steps updated (all workers' together).
    host_adam_s: float | None = None
    host_adam_params_per_s: float | None = None
    compute_s: float | None = None  # the busiest worker's compute of the step (its micro-batches' passes, pipeline)
    grad_norm: float | None = None  # the step's global gradient norm before clipping (where --max-grad-norm clips)
    eval_loss: float | None = None  # after this step, on the held-out examples (--eval-every, the end)
    eval_perplexity: float | None = None
    # A preference run's metrics (mobius.models.preference.METRICS: TRL's names), over the step's pairs,
    # and over the held-out pairs where this step evaluated.
    preference: dict[str, float] | None = None
    eval_preference: dict[str, float] | None = None


@dataclass
class Evaluation:
    """A held-out evaluation: its loss, and a preference run's metrics (TRL's names,
    :data:`mobius.models.preference.METRICS`) over the held-out pairs."""

    loss: float
    preference: dict[str, float] | None = None


class MetricsWriter:
    """Appends one JSON object per optimizer step; flushed each line so a crash loses nothing.
    Each line is recorded as ours (:func:`mobius.boundary.ownership.record_file`) before it is
    written."""

    def __init__(self, path: str | os.PathLike | None, append: bool = False):
        self.path = path
        self._file = None
        if not path:
            return
        self._hash = hashlib.sha256()
        with writing("the metrics file", path):
            if append and os.path.exists(path):  # continuing our own file (checked before the run)
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        self._hash.update(block)
            self._file = open(path, "ab" if append else "wb")
            record_file(path, self._hash.hexdigest())

    def write(self, m: StepMetrics) -> None:
        if self._file:
            # Steps counted from 1, as the console and every --report-to tracker count them.
            line = (json.dumps({**asdict(m), "step": m.step + 1}) + "\n").encode()
            before = self._hash.hexdigest()
            self._hash.update(line)
            with writing("the metrics file", self.path):
                record_file(self.path, self._hash.hexdigest(), previous=before)
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


class Trace:
    """Chrome-trace events (``X`` complete events), viewable in Perfetto / chrome://tracing.

    ``pid`` is the worker rank, ``tid`` names the lane (compute, prefetch, send, ...).
    """

    def __init__(self, enabled: bool, pid: int = 0):
        self.enabled = enabled
        self.pid = pid
        self.events: list[dict] = []
        self._pending: list[tuple] = []  # device spans, resolved by collect()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def span(self, name: str, lane: str, start: float, end: float, **args) -> None:
        if self.enabled:
            self._add(self.pid, name, lane, start, end, args)

    def _add(self, pid: int, name: str, lane: str, start: float, end: float, args: dict) -> None:
        event = {"name": name, "ph": "X", "pid": pid, "tid": lane,
                 "ts": (start - self._t0) * 1e6, "dur": max(0.0, end - start) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    def device_span(self, name: str, lane: str, begin, end, time_of, **args) -> None:
        """A span of device work between two events of the device layer, timed when the trace is
        collected (``time_of``: the device's clock on the host's), not when it was issued: on
        CUDA the host issues a copy in microseconds and the copy lasts milliseconds."""
        if self.enabled:
            with self._lock:
                self._pending.append((self.pid, name, lane, begin, end, time_of, args))

    def of_pid(self, pid: int) -> "Trace":
        """This trace's events, written under ``pid`` (one process driving several devices: a
        row of lanes per device)."""
        other = copy.copy(self)  # the same event lists and lock
        other.pid = pid
        return other

    def collect(self) -> list[dict]:
        """Every event, the device spans resolved (this waits for their work to finish)."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for pid, name, lane, begin, end, time_of, args in pending:
            self._add(pid, name, lane, time_of(begin), time_of(end), args)
        return self.events

    def set_origin(self, t0: float) -> None:
        self._t0 = t0


def seconds_text(s: float) -> str:
    """A step time as people read it: seconds from 0.1 s, milliseconds below."""
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"


def write_trace(path: str | os.PathLike, events: list[dict]) -> None:
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    with writing("the trace", path):
        previous = sha256_of(Path(path)) if os.path.isfile(path) else None
        record_file(path, hashlib.sha256(text.encode()).hexdigest(), previous)
        write_atomically(path, text)


