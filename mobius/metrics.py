"""Per-step metrics (``--metrics``: one JSON line per step, the fields of :class:`StepMetrics`;
``--tensorboard``) and a Chrome trace writer (``--trace``)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mobius.ownership import record_file, sha256_of, write_atomically, writing


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    tokens: int
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


class MetricsWriter:
    """Appends one JSON object per optimizer step; flushed each line so a crash loses nothing.
    Each line is recorded as ours (:func:`mobius.ownership.record_file`) before it is written."""

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
            line = (json.dumps(asdict(m)) + "\n").encode()
            before = self._hash.hexdigest()
            self._hash.update(line)
            with writing("the metrics file", self.path):
                record_file(self.path, self._hash.hexdigest(), previous=before)
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


class TensorBoardLog:
    """``--tensorboard DIR``: the step's scalars as TensorBoard events (torch's ``SummaryWriter``).
    It adds a new event file beside whatever the directory holds and never replaces one."""

    def __init__(self, directory: str | os.PathLike | None):
        self.writer = None
        self.failed = False  # a write failed (disk full): said once, in the training loop's error line
        if directory:
            from torch.utils.tensorboard import SummaryWriter  # needs the 'tensorboard' package

            with writing("--tensorboard", directory):
                self.writer = SummaryWriter(str(directory))
            _quiet_writer_threads()

    def write(self, m: StepMetrics) -> None:
        if self.writer is None or self.failed:
            return
        done = m.step + 1
        scalars = {"train/loss": m.loss, "train/lr": m.lr, "perf/step_time_s": m.step_time_s,
                   "perf/tokens_per_s": m.tokens / max(m.step_time_s, 1e-9),
                   "perf/peak_device_mib": m.peak_device_bytes / 2**20}
        if m.emulated_step_s is not None:
            scalars["perf/emulated_step_s"] = m.emulated_step_s
        if m.eval_loss is not None:
            scalars.update({"eval/loss": m.eval_loss, "eval/perplexity": m.eval_perplexity})
        if m.grad_norm is not None:
            scalars["train/grad_norm"] = m.grad_norm
        self.failed = True  # until the write is through: the error below is said once
        with writing("--tensorboard", self.writer.log_dir):
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, done)
            self.writer.flush()
        self.failed = False

    def close(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.close()
        except OSError:
            if not self.failed:  # a failure not yet said: say it
                with writing("--tensorboard", self.writer.log_dir):
                    raise


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk) and Python prints its
    traceback; the same failure reaches the training loop at the next flush, which says it in one
    line.  Exceptions of those threads are not printed a second time; every other thread's are."""
    if getattr(threading.excepthook, "mobius_quiet", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.mobius_quiet = True
    threading.excepthook = hook


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
        if not self.enabled:
            return
        event = {"name": name, "ph": "X", "pid": self.pid, "tid": lane,
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
                self._pending.append((name, lane, begin, end, time_of, args))

    def collect(self) -> list[dict]:
        """Every event, the device spans resolved (this waits for their work to finish)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for name, lane, begin, end, time_of, args in pending:
            self.span(name, lane, time_of(begin), time_of(end), **args)
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


