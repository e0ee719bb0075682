"""The disk tier of the host store: AdamW's two moments of a worker's stages on NVMe
(``--offload-dir``), as ZeRO-Infinity keeps optimizer state, so that a host with less memory than
full fine-tuning asks for (16 bytes a parameter) trains with 8 bytes a parameter fewer.

Each stage's moments, ``[exp_avg | exp_avg_sq]`` in fp32, are striped over the directories of
``--offload-dir`` (one per drive): one contiguous part of equal size in a file in each, written and
read whole (one large sequential request each), the parts of one transfer on as many threads, so
that every drive reads and writes at once.  Between updates the optimizer holds only AdamW's step count:
:meth:`DiskState.page_in` binds the moments to a buffer of a small pool just before the stage's
update, :meth:`DiskState.page_out` writes them back and returns the buffer.  The read of a
stage's moments starts as soon as its gradients leave the device (:meth:`read_ahead`), on a reader
thread, and the write after its update runs on a writer thread: the read of the next stage, this
stage's update and the last stage's write are in flight together.  The pool bounds the host memory
the tier takes (``POOL_BUFFERS`` buffers of the largest stage's moments); the reader waits for a
free buffer, the writer frees them, and reads and updates come in the same order, so the pool
cannot deadlock.

The files are the run's own: created exclusively (never a file of the user's), removed when the
worker closes.  AdamW is elementwise, and a moment's trip through a file is exact: a run with its
moments on disk computes the same bits as one with them in memory.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from mobius.boundary.errors import InputError, RunError, shown
from mobius.metrics import Trace
from mobius.models import build_model
from mobius.swap.store import HostStage, view

POOL_BUFFERS = 3  # one being read ahead, one being updated, one being written
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_BYTES = 4 * len(MOMENTS)  # a trained parameter's moments in its file (fp32)
MASTER_BYTES = 4  # and its master weight, where that waits there too (fp32)
# A drive timed below this share of the rates the plan was given is refused: the plan would be wrong.
DRIVE_SHARE_REQUIRED = 0.5
DRIVE_TIMING_BYTES = 256 * 2**20  # past a drive's write cache, flushed; a fraction of a second on NVMe


def stripes(elements: int, drives: int) -> list[tuple[int, int]]:
    """(first element, count) of each drive's part of a stage's ``elements`` moments: contiguous,
    in drive order, sizes differing by at most one element."""
    base, extra = divmod(elements, drives)
    starts = [k * base + min(k, extra) for k in range(drives + 1)]
    return [(starts[k], starts[k + 1] - starts[k]) for k in range(drives)]


class DiskState:
    def __init__(self, directories: Sequence[str | os.PathLike], rank: int,
                 optimizers: dict[int, torch.optim.Optimizer] | None = None,
                 through: Callable[[int, bool, Callable[[], None]], None] | None = None, trace: Trace | None = None,
                 masters: Sequence[int] = ()):
        """``directories``: one on each drive the state is striped over; ``optimizers``: each
        stage's AdamW (the stages whose moments go to disk; more may be given by :meth:`attach`);
        ``masters``: the stages whose fp32 master weights wait there too (the store hands each to
        :meth:`park` as it is built); ``through``: how a read or write of ``n`` bytes is done (the
        device layer's ``disk_transfer``, which ``--emulate`` times at the emulated drives' rate),
        else at once; ``trace``: where each read and write is a span, on the lanes ``disk read``
        and ``disk write``."""
        self.trace = trace or Trace(enabled=False)
        self.directories = [Path(d) for d in directories]
        self.rank = rank
        self.through = through or (lambda nbytes, write, io: io())
        self.masters = set(masters)
        self.hosts: dict[int, HostStage] = {}  # the parked stages
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.params: dict[int, list[torch.Tensor]] = {}
        self.numel: dict[int, int] = {}  # trained parameters of each stage
        self.stripes: dict[int, list[tuple[int, int]]] = {}
        self.paths: dict[int, list[Path]] = {}
        self.fds: dict[int, list[int]] = {}
        self.written: dict[int, bool] = {}  # AdamW has made the moments (first update done)
        self.pool: queue.Queue[torch.Tensor] = queue.Queue()
        self._pool_elements = 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mobius-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mobius-disk-write")
        # The parts of one read (or write) move on threads of their own, one per drive.
        drives = len(self.directories)
        self._parts = {call: ThreadPoolExecutor(drives, thread_name_prefix=f"mobius-disk-{what}")
                       for call, what in ((os.preadv, "read-part"), (os.pwritev, "write-part"))} if drives > 1 else {}
        self._reads: dict[int, Future] = {}
        self._writes: dict[int, Future] = {}
        self.read_bytes = self.written_bytes = 0
        if optimizers:
            self.attach(optimizers)

    def holds(self, s: int) -> bool:
        return s in self.optimizers

    def fields(self, s: int) -> int:
        """fp32 values a trained parameter of stage ``s`` has in its files: ``[master |] exp_avg | exp_avg_sq``."""
        return len(MOMENTS) + (s in self.masters)

    def _open(self, s: int, numel: int) -> None:
        """Stage ``s``'s files, one per drive, created exclusively (never a file that was there)."""
        self.numel[s] = numel
        self.stripes[s] = stripes(self.fields(s) * numel, len(self.directories))
        self.paths[s] = [d / f"rank{self.rank:03d}-stage{s:04d}.adam" for d in self.directories]
        self.fds[s] = []
        self.written[s] = False
        for path, (_, count) in zip(self.paths[s], self.stripes[s]):
            try:
                self.fds[s].append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                os.ftruncate(self.fds[s][-1], 4 * count)
            except OSError as err:
                self.close()
                raise RunError(f"--offload-dir {shown(path.parent)}: cannot create its files "
                               f"({err.strerror})") from None

    def park(self, host: HostStage) -> None:
        """Stage ``host``'s master weights (just built) to its files; the host keeps none of them.
        Its compute copy must already hold them: the loads read that."""
        s = host.index
        self._open(s, host.master.numel())
        self._transfer(os.pwritev, s, host.master)
        self.written_bytes += host.master.numel() * 4
        self.hosts[s] = host
        self._unbind_master(host)

    def attach(self, optimizers: dict[int, torch.optim.Optimizer]) -> None:
        """The stages whose moments (and, parked, master weights) go through the files: each
        one's AdamW.  Every parked stage must be among them."""
        for s, opt in optimizers.items():
            self.optimizers[s] = opt
            self.params[s] = [p for g in opt.param_groups for p in g["params"]]
            if s not in self.fds:
                self._open(s, sum(p.numel() for p in self.params[s]))
        if set(self.hosts) - set(self.optimizers):
            raise ValueError(f"parked stages {sorted(set(self.hosts) - set(self.optimizers))} have no optimizer")
        grads = {s: self.numel[s] for s, h in self.hosts.items() if h.grad_staging.dtype != torch.float32}
        largest = max((self.fields(s) * n + grads.get(s, 0) for s, n in self.numel.items()), default=0)
        if largest > self._pool_elements:  # before any update: the pool is made once, at its final size
            while not self.pool.empty():
                self.pool.get()
            self._pool_elements = largest
            for _ in range(POOL_BUFFERS):
                self.pool.put(torch.empty(largest, dtype=torch.float32))

    # ---- the update's path -------------------------------------------------------------------
    def read_ahead(self, s: int) -> None:
        """Start reading stage ``s``'s state (its update is coming)."""
        if self.holds(s) and s not in self._reads:
            self._reads[s] = self._reader.submit(self._read, s)

    def _read(self, s: int) -> torch.Tensor:
        if s in self._writes:  # its last update's state must be on disk first
            self._writes.pop(s).result()
        buffer = self.pool.get()  # waits for the writer to hand one back
        if self.written[s] or s in self.hosts:
            flat = buffer[:self.fields(s) * self.numel[s]]
            t0 = time.perf_counter()
            self._transfer(os.preadv, s, flat)
            self.trace.span(f"state {s} from disk", "disk read", t0, time.perf_counter(), bytes=flat.numel() * 4)
            self.read_bytes += flat.numel() * 4
        return buffer

    def page_in(self, s: int) -> torch.Tensor:
        """Stage ``s``'s state bound for its update (views of a pool buffer): the master weights
        of a parked stage, with their gradients (as they came home) attached, and AdamW's
        moments (before the first update there are none: AdamW makes them); returns the buffer,
        for :meth:`page_out`."""
        self.read_ahead(s)
        buffer = self._reads.pop(s).result()
        if s in self.hosts:
            self._bind_master(s, buffer)
        if self.written[s]:
            self._bind(s, buffer)
        return buffer

    def page_out(self, s: int, buffer: torch.Tensor) -> None:
        """After stage ``s``'s update (and its compute copy's refresh): its state (in ``buffer``,
        or where AdamW made the moments on its first update) leaves for the disk; the optimizer
        keeps only its step count, the host no master weights."""
        state = self.optimizers[s].state
        made = all(key in state.get(p, {}) for p in self.params[s] for key in MOMENTS)
        flat = buffer[:self.fields(s) * self.numel[s]]
        if made:
            offset = self.numel[s] if s in self.hosts else 0
            for key in MOMENTS:
                for p in self.params[s]:
                    part = flat[offset: offset + p.numel()]
                    moment = state[p].pop(key)
                    if moment.data_ptr() != part.data_ptr():
                        part.copy_(moment.reshape(-1))
                    offset += p.numel()
            self.written[s] = True
        if s in self.hosts:
            self._unbind_master(self.hosts[s])
        if not made and s not in self.hosts:
            self.pool.put(buffer)  # no update has made them yet (an fp16 step skipped before the first)
            return
        self._writes[s] = self._writer.submit(self._write, s, flat, buffer)

    def _write(self, s: int, flat: torch.Tensor, buffer: torch.Tensor) -> None:
        try:
            t0 = time.perf_counter()
            self._transfer(os.pwritev, s, flat)
            self.trace.span(f"state {s} to disk", "disk write", t0, time.perf_counter(), bytes=flat.numel() * 4)
            self.written_bytes += flat.numel() * 4
        finally:
            self.pool.put(buffer)

    def _bind(self, s: int, flat: torch.Tensor) -> None:
        state, offset = self.optimizers[s].state, self.numel[s] if s in self.hosts else 0
        for key in MOMENTS:
            for p in self.params[s]:
                state[p][key] = flat[offset: offset + p.numel()].view(p.shape)
                offset += p.numel()

    def _bind_master(self, s: int, flat: torch.Tensor) -> None:
        """The parked stage's master weights as views of ``flat``'s first part (the store's
        layout), and their gradients: the staging buffer itself (fp32), or (16-bit) an fp32 copy
        of it in the buffer's last part."""
        host, n = self.hosts[s], self.numel[s]
        host.master = flat[:n]
        if host.grad_staging.dtype != torch.float32:
            host.master_grad = flat[self.fields(s) * n:(self.fields(s) + 1) * n]
            host.master_grad.copy_(host.grad_staging)
        for p, slot in zip(host.master_params, [sl for sl in host.grad_slots() if sl is not None]):
            p.data = view(host.master, slot)
        host.attach_master_grads()

    @staticmethod
    def _unbind_master(host: HostStage) -> None:
        host.master = torch.empty(0)
        if host.grad_staging.dtype != torch.float32:
            host.master_grad = torch.empty(0)
        for p in host.master_params:
            p.grad = None
            p.data = torch.empty(0)

    def _transfer(self, call, s: int, flat: torch.Tensor) -> None:
        """``flat`` read from or written to stage ``s``'s files from their start, each drive's part on
        a thread of its own (the calls may move less than asked)."""
        view_ = memoryview(flat.numpy()).cast("B")

        def part(k: int) -> None:
            start, count = self.stripes[s][k]
            piece, done = view_[4 * start: 4 * min(start + count, flat.numel())], 0
            try:
                while done < len(piece):
                    moved = call(self.fds[s][k], [piece[done:]], done)
                    if moved <= 0:
                        raise OSError(0, "the file ended early")
                    done += moved
            except OSError as err:
                raise RunError(f"--offload-dir {shown(self.paths[s][k])}: "
                               f"{'reading' if call is os.preadv else 'writing'} the optimizer's state failed "
                               f"({err.strerror})") from None

        def io() -> None:
            if self._parts:
                list(self._parts[call].map(part, range(len(self.directories))))
            else:
                part(0)

        self.through(len(view_), call is os.pwritev, io)

    # ---- checkpoints and the final weights ----------------------------------------------------
    def loaded(self, s: int) -> None:
        """Stage ``s``'s state bound again in tensors of its own: the master weights of a parked
        stage, the moments in AdamW's state (a checkpoint reads them, a restore writes them;
        :meth:`unload` sends them back, :meth:`forget` drops them)."""
        if not self.holds(s) or (not self.written[s] and s not in self.hosts):
            return
        if s in self._writes:
            self._writes.pop(s).result()
        flat = torch.empty(self.fields(s) * self.numel[s], dtype=torch.float32)
        self._transfer(os.preadv, s, flat)
        if s in self.hosts:
            host = self.hosts[s]
            host.master = flat[:self.numel[s]]
            for p, slot in zip(host.master_params, [sl for sl in host.grad_slots() if sl is not None]):
                p.data = view(host.master, slot)
        if self.written[s]:
            self._bind(s, flat)

    def forget(self, s: int) -> None:
        """Drop what :meth:`loaded` bound (the files hold the same)."""
        if not self.holds(s):
            return
        if self.written[s]:
            for st in self.optimizers[s].state.values():
                for key in MOMENTS:
                    st.pop(key, None)
        if s in self.hosts:
            self._unbind_master(self.hosts[s])

    @contextlib.contextmanager
    def present(self, s: int):
        """Stage ``s``'s state in memory while the block runs (:meth:`loaded`, then :meth:`forget`)."""
        self.loaded(s)
        try:
            yield
        finally:
            self.forget(s)

    def unload(self, s: int) -> None:
        """Stage ``s``'s state, as it is bound now (a checkpoint's, restored into what
        :meth:`loaded` bound), written to disk; the optimizer keeps only its step count."""
        if not self.holds(s):
            return
        made = any(k in st for st in self.optimizers[s].state.values() for k in MOMENTS)
        if not made and s not in self.hosts:
            return
        buffer = self.pool.get()
        if s in self.hosts:
            buffer[:self.numel[s]].copy_(self.hosts[s].master)
        if not made and self.written[s]:  # the restore had no moments: the file's stay as they were
            self._transfer(os.pwritev, s, buffer[:self.numel[s]])
            self._unbind_master(self.hosts[s])
            self.pool.put(buffer)
            return
        self.page_out(s, buffer)
        self._writes[s].result()

    def close(self) -> None:
        """Every write finished; the files removed (they are the run's, and only the run's)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        for pool in self._parts.values():
            pool.shutdown(wait=True)
        for s, fds in self.fds.items():
            for fd, path in zip(fds, self.paths[s]):
                os.close(fd)
                path.unlink(missing_ok=True)
        self.fds = {}


def measure_drive(directory: str | os.PathLike, nbytes: int, block: int = 64 * 2**20) -> tuple[float, float]:
    """(read, write) GB/s of the drive under ``directory``, sequential, as the disk tier uses it:
    ``nbytes`` written in ``block``-sized requests and flushed to the drive (``fsync``), then read
    back with its pages dropped from the page cache first, through a file of our own (created
    exclusively, removed after)."""
    path = Path(directory) / f".mobius-drive-{os.getpid()}"
    buffer = memoryview(torch.randn(block // 4).numpy()).cast("B")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise RunError(f"{shown(directory)}: cannot write a file there to time the drive ({err.strerror})") from None
    try:
        t0 = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwritev(fd, [buffer[:min(block, nbytes - offset)]], offset)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.preadv(fd, [buffer[:min(block, nbytes - offset)]], offset)
        read_s = time.perf_counter() - t0
    except OSError as err:
        raise RunError(f"{shown(directory)}: timing the drive failed ({err.strerror})") from None
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return nbytes / read_s / 1e9, nbytes / write_s / 1e9


def shares_a_file_system(directories) -> bool:
    """Whether two of ``directories`` are on one file system (then on one drive, not one each)."""
    return len({os.stat(d).st_dev for d in directories}) < len(directories)


def check_offload_dir(cfg, model_config, topo) -> None:
    """``--offload-dir`` before training: one directory on each drive the moments are striped over
    (no two on one file system), each one's file system holding its part of the moments of every
    trained parameter (the most the tier writes there).  Where the plan is given a drive's rates
    (the topology's drives, ``--drive-gbps``; :func:`mobius.planning.prepare.resolve_topology`
    pairs them with the directories in order), the drive is timed (:func:`measure_drive`) and one
    that reads or writes at less than half of them is refused: the plan would be wrong.  Under
    ``--emulate`` the stated rates are what the run is charged: nothing to time."""
    directories = cfg.pipeline.offload_dir
    if not directories:
        return
    if shares_a_file_system(directories):
        raise InputError(f"--offload-dir {','.join(map(shown, directories))}: two of these directories are on one "
                         "file system; name one directory on each drive (they are read and written at once)")
    need = MOMENT_BYTES * sum(p.numel() for p in build_model(model_config, device="meta").parameters()
                              if p.requires_grad) / len(directories)
    for directory in directories:
        fs = os.statvfs(directory)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise InputError(f"--offload-dir {shown(directory)}: AdamW's moments take up to {need / 1e9:.2f} GB "
                             f"there, but its file system has {free / 1e9:.2f} GB free")
    if topo is None or cfg.emulation.enabled:
        return
    for directory, drive in zip(directories, topo.drives):
        if drive.assumed:
            continue
        read, write = measure_drive(directory, DRIVE_TIMING_BYTES)
        if read < DRIVE_SHARE_REQUIRED * drive.read_gbps or write < DRIVE_SHARE_REQUIRED * drive.write_gbps:
            raise InputError(f"--offload-dir {shown(directory)}: its drive reads {read:.2f} GB/s and writes "
                             f"{write:.2f} GB/s here, but the plan was given {drive.read_gbps:g} and "
                             f"{drive.write_gbps:g} GB/s (the topology's drives or --drive-gbps): state what it does "
                             "(python -m mobius.rates --drive DIR --write FILE) or use a faster drive")
