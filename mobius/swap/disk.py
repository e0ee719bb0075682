"""The disk tier of the host store: optimizer state of a worker's stages on NVMe (``--offload-dir``),
as ZeRO-Infinity keeps it, so that a host with less memory than full fine-tuning asks for (16-20
bytes a parameter) trains: AdamW's two moments of every stage the plan names (8 bytes a parameter),
of those it names too, the fp32 master weights (4 more; with 16-bit compute their fp32 gradients
then exist only in an update's buffer), and of those, the compute weights the loads read (2 more
in bf16: each update writes them block by block, each load reads them whole, :meth:`DiskState.read_weights`).

A stage's state is cut into blocks of at most ``block`` parameters; each block's record
``[master |] exp_avg | exp_avg_sq`` (fp32) is striped over the directories of ``--offload-dir``
(one per drive) in equal contiguous parts, the parts of one transfer on as many threads, so that
every drive reads and writes at once.  A stage's update (:meth:`DiskState.update`) streams its
blocks through a pool of ``POOL_BUFFERS`` block buffers: a reader thread reads the next block, the
optimizer thread updates this one (fused AdamW on its slices of each parameter), a writer thread
writes the last.  The reader waits for a free buffer and the writer frees them; a stage's reads
wait for its last writes.  Between updates the optimizer holds nothing and the tier the step
count; the host holds a stage's master weights only while :meth:`present` binds them.

The files are the run's own: created exclusively (never a file of the user's), removed when the
worker closes.  AdamW is elementwise, and a value's trip through a file is exact: a run with its
state on disk computes the same bits as one with it in memory.
"""
from __future__ import annotations

import contextlib
import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from mobius.boundary.errors import InputError, RunError, shown
from mobius.boundary.ledger import FileLedger, remove_orphans
from mobius.metrics import Trace
from mobius.models import build_model
from mobius.runtime.optim import UpdateRule, adamw
from mobius.swap.store import HostStage, Slot, view
from topology import Drive
from topology.probe import drive_name

POOL_BUFFERS = 3  # one being read ahead, one being updated, one being written
# The most parameters updated and moved at once: a pool buffer holds a block's state (up to 16 bytes
# a parameter, 512 MB): few, large sequential requests, and a pool of a few GB whatever the stage.
BLOCK_PARAMS = 2**25
# A stage is cut into this many blocks at least, so that a worker's pool holds less than its largest
# stage's state (on a small model, three whole stages' state would cost more than it saves).
BLOCKS_PER_STAGE = 8
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_BYTES = 4 * len(MOMENTS)  # a trained parameter's moments in its file (fp32)
MASTER_BYTES = 4  # and its master weight, where that waits there too (fp32)
# A drive timed below this share of the rates the plan was given is refused: the plan would be wrong.
DRIVE_SHARE_REQUIRED = 0.5
DRIVE_TIMING_BYTES = 256 * 2**20  # past a drive's write cache, flushed; a fraction of a second on NVMe


def state_file_name(rank: int, stage: int, kind: str = "adam") -> str:
    """A stage's file on one drive: its AdamW records (``adam``) or its compute copy (``weights``)."""
    return f"rank{rank:03d}-stage{stage:04d}.{kind}"


def block_params(largest: int) -> int:
    """The parameters of a block of a worker whose largest stage on the tier updates ``largest``."""
    return min(BLOCK_PARAMS, max(1, -(-largest // BLOCKS_PER_STAGE)))


def stripes(elements: int, drives: int) -> list[tuple[int, int]]:
    """(first element, count) of each drive's part of a stage's ``elements`` moments: contiguous,
    in drive order, sizes differing by at most one element."""
    base, extra = divmod(elements, drives)
    starts = [k * base + min(k, extra) for k in range(drives + 1)]
    return [(starts[k], starts[k + 1] - starts[k]) for k in range(drives)]


@dataclass
class _Block:
    """A run of a stage's updated parameters, updated and moved whole: ``pieces`` (parameter, its
    master flat's first element of the run, count, weight decay), and each drive's part of the
    block's record ``[master |] exp_avg | exp_avg_sq`` (element in the record, count, element in
    that drive's file)."""

    count: int
    pieces: list[tuple[torch.nn.Parameter, int, int, float]]
    parts: list[tuple[int, int, int]]

    def placed(self):
        """Each piece as (parameter, its first element in the block, in the master flat, count, decay)."""
        at = 0
        for p, first, count, decay in self.pieces:
            yield p, at, first, count, decay
            at += count


def _blocks(pieces: list[tuple[torch.nn.Parameter, int, int, float]], fields: int, block: int,
            drives: int) -> list[_Block]:
    """A stage's parameters ``pieces`` (as in :class:`_Block`, whole parameters) cut into blocks
    of at most ``block`` values, each one's record striped over ``drives`` files."""
    out: list[_Block] = []
    current: list = []
    filled = 0
    for p, first, count, decay in pieces:
        while count:
            take = min(count, block - filled)
            current.append((p, first, take, decay))
            first, count, filled = first + take, count - take, filled + take
            if filled == block:
                out.append(_Block(filled, current, []))
                current, filled = [], 0
    if filled:
        out.append(_Block(filled, current, []))
    at = [0] * drives  # each file's next element
    for b in out:
        for k, (start, n) in enumerate(stripes(fields * b.count, drives)):
            b.parts.append((start, n, at[k]))
            at[k] += n
    return out


class DiskState:
    def __init__(self, directories: Sequence[str | os.PathLike], rank: int,
                 through: Callable[[int, bool, Callable[[], None]], None] | None = None, trace: Trace | None = None,
                 masters: Sequence[int] = (), weights: Sequence[int] = (), block: int = BLOCK_PARAMS):
        """``directories``: one on each drive the state is striped over; ``masters``: the stages
        whose fp32 master weights wait there too (the store hands each to :meth:`park` as it is
        built; :meth:`attach` gives the tier every stage whose moments wait there); ``weights``:
        of those, the stages whose compute copy waits there as well (its loads read it through
        :meth:`read_weights`; each update writes it block by block); ``block``: the
        most parameters updated and moved at once; ``through``: how a read or write of ``n`` bytes
        is done (the device layer's ``disk_transfer``, which ``--emulate`` times at the emulated
        drives' rate), else at once; ``trace``: where each read and write is a span, on the lanes
        ``disk read`` and ``disk write``."""
        self.trace = trace or Trace(enabled=False)
        self.directories = [Path(d) for d in directories]
        self.rank, self.block = rank, block
        self.through = through or (lambda nbytes, write, io: io())
        self.masters = set(masters)
        self.weights = set(weights)
        if not self.weights <= self.masters:
            raise ValueError(f"stages {sorted(self.weights - self.masters)} would keep their compute copy on disk "
                             "but their master weights in memory")
        self.hosts: dict[int, HostStage] = {}  # every stage of the tier (parked or attached)
        self.blocks: dict[int, list[_Block]] = {}
        self.slots: dict[int, dict[int, Slot]] = {}  # each stage's trained parameters' places in its master flat
        self.steps: dict[int, int] = {}  # updates applied to each stage (AdamW's step count)
        self.paths: dict[int, list[Path]] = {}
        self.fds: dict[int, list[int]] = {}
        self.weight_paths: dict[int, list[Path]] = {}  # the compute copies' files, of the ``weights`` stages
        self.weight_fds: dict[int, list[int]] = {}
        self.pool: queue.Queue[torch.Tensor] = queue.Queue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mobius-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mobius-disk-write")
        # The parts of one read (or write) move on threads of their own, one per drive.
        drives = len(self.directories)
        self._parts = {call: ThreadPoolExecutor(drives, thread_name_prefix=f"mobius-disk-{what}")
                       for call, what in ((os.preadv, "read-part"), (os.pwritev, "write-part"))} if drives > 1 else {}
        self._writes: dict[int, list[Future]] = {}  # each stage's blocks being written
        self.read_bytes = self.written_bytes = 0
        try:
            self.ledgers = [FileLedger(d, f"rank{rank:03d}") for d in self.directories]
        except OSError as err:
            raise RunError(f"--offload-dir: cannot create its files ({err.strerror})") from None

    def holds(self, s: int) -> bool:
        return s in self.blocks

    def numel(self, s: int) -> int:
        """The parameters the tier updates of stage ``s``."""
        return sum(b.count for b in self.blocks[s])

    def fields(self, s: int) -> int:
        """fp32 values a parameter of stage ``s`` has in its files: ``[master |] exp_avg | exp_avg_sq``."""
        return len(MOMENTS) + (s in self.masters)

    def _add(self, host: HostStage, params: list[torch.nn.Parameter], decay: dict[int, float]) -> None:
        """Stage ``host``'s files (created exclusively: never a file that was there) and blocks."""
        s = host.index
        slots = self.slots[s] = dict(zip(map(id, host.master_params), [sl for sl in host.grad_slots() if sl]))
        pieces = [(p, slots[id(p)].offset, slots[id(p)].numel, decay[id(p)]) for p in params]
        self.blocks[s] = _blocks(pieces, self.fields(s), self.block, len(self.directories))
        self.hosts[s], self.steps[s] = host, 0
        # zeros: no moments yet
        self.paths[s], self.fds[s] = self._create(s, "adam", [4 * sum(b.parts[k][1] for b in self.blocks[s])
                                                               for k in range(len(self.directories))])

    def _create(self, s: int, kind: str, sizes: list[int]) -> tuple[list[Path], list[int]]:
        """Stage ``s``'s files of ``kind`` on every drive, ``sizes`` bytes each, created exclusively
        and recorded in the drive's ledger (:mod:`mobius.boundary.ledger`)."""
        name = state_file_name(self.rank, s, kind)
        paths, fds = [d / name for d in self.directories], []
        for ledger, path, size in zip(self.ledgers, paths, sizes):
            try:
                fds.append(ledger.create(name))
                os.ftruncate(fds[-1], size)
            except OSError as err:
                for fd, made in zip(fds, self.ledgers):
                    os.close(fd)
                    made.remove(name)
                self._close()
                raise RunError(f"--offload-dir {shown(path.parent)}: cannot create its files "
                               f"({err.strerror})") from None
        return paths, fds

    def park(self, host: HostStage) -> None:
        """Stage ``host``'s master weights (just built) to its files; the host keeps none of them.
        Its compute copy must already hold them: the loads read that, or, of a ``weights`` stage,
        its files, which it is written to (the host then keeps none of it either)."""
        params, s = host.master_params, host.index
        self._add(host, params, {id(p): 0.0 for p in params})  # decay: known at attach
        for b in self.blocks[s]:  # the records' first parts: the moments are the files' zeros
            values = torch.empty(b.count)
            self._gather(b, host.master, values)
            self._move(os.pwritev, s, b, values)
        if s in self.weights:
            copy = host.compute_buffers[0]
            self.weight_paths[s], self.weight_fds[s] = self._create(
                s, "weights", [copy.element_size() * n for _, n in stripes(copy.numel(), len(self.directories))])
            self._weights_io(os.pwritev, s, 0, copy)
            host.compute_buffers = [torch.empty(0, dtype=copy.dtype)]
        self._unbind_master(host)

    def attach(self, stages: dict[int, HostStage]) -> None:
        """Every stage whose moments (and, parked, master weights) go through the files, with the
        AdamW that updates them (what it updates of the stage: with replicas, a share)."""
        for s, host in stages.items():
            groups = host.optimizer.param_groups
            decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
            mine = [p for p in host.master_params if id(p) in decay]
            if s in self.hosts:  # parked: its blocks hold every parameter; now with their decay
                self.blocks[s] = [replace(b, pieces=[(p, f, n, decay[id(p)]) for p, f, n, _ in b.pieces])
                                  for b in self.blocks[s]]
            else:
                self._add(host, mine, decay)
        unparked = set(self.masters) & set(self.hosts) - set(stages)
        if unparked:
            raise ValueError(f"parked stages {sorted(unparked)} have no optimizer")
        largest = max((min(self.block, sum(b.count for b in bs)) * (self.fields(s) + self._grads_in_pool(s))
                       for s, bs in self.blocks.items()), default=0)
        for _ in range(POOL_BUFFERS if largest else 0):
            self.pool.put(torch.empty(largest, dtype=torch.float32))

    def _grads_in_pool(self, s: int) -> int:
        """1 where a block's fp32 gradients are made in its buffer (a 16-bit master on disk)."""
        return int(s in self.masters and self.hosts[s].grad_staging.dtype != torch.float32)

    # ---- the update's path -------------------------------------------------------------------
    def update(self, s: int, lr: float, unscale: float | None, clip: float, compute: torch.Tensor | None,
               apply: bool = True, before: bool = False) -> None:
        """Stage ``s``'s AdamW step, block by block: the read of the next block, the update of this
        one (its gradients divided by ``unscale``, then multiplied by ``clip``, as in memory) and
        the write of the last in flight together; a master on disk also refreshes ``compute`` (the
        compute-dtype copy the next loads read) block by block, with its values after the update or,
        ``before``, before it (the weights an optimizer lag of one computes with next, where
        ``compute`` is the only copy).  ``apply`` off (an fp16 step skipped): nothing changes, but a
        master on disk still refreshes ``compute``."""
        host, blocks = self.hosts[s], self.blocks[s]
        if not apply and s not in self.masters:
            return
        group = host.optimizer.param_groups[0]
        for w in self._writes.pop(s, []):  # its last update's blocks on disk before they are read again
            w.result()
        reads = [self._reader.submit(self._read, s, blocks[0])]
        for i, b in enumerate(blocks):
            buffer = reads[i].result()
            if i + 1 < len(blocks):
                reads.append(self._reader.submit(self._read, s, blocks[i + 1]))
            record = buffer[:self.fields(s) * b.count]
            master = record[:b.count] if s in self.masters else None
            if before and master is not None and compute is not None:  # the weights of one update ago
                self._scatter(b, master, compute)
            if apply:
                self._step(s, b, buffer, master, lr, unscale, clip, group)
            writes = self._writes.setdefault(s, [])
            if s in self.weights:  # the compute copy the loads read: this block's part of its files
                if apply:
                    writes.append(self._writer.submit(self._write_block_weights, s, b,
                                                      master.to(host.grad_staging.dtype, copy=True)))
            elif master is not None and compute is not None and not before:
                self._scatter(b, master, compute)
            if apply:
                writes.append(self._writer.submit(self._write, s, b, record, buffer))
            else:
                self.pool.put(buffer)
        if apply:
            self.steps[s] += 1

    def _step(self, s: int, b: _Block, buffer: torch.Tensor, master: torch.Tensor | None, lr: float,
              unscale: float | None, clip: float, group: dict) -> None:
        """AdamW on block ``b``: the moments in its record, the master there or in the host's
        store, the gradients the host's (or made, 16-bit, in the buffer's last part)."""
        host, n = self.hosts[s], b.count
        exp_avg, exp_avg_sq = self._moments(s, b, buffer)
        grads = host.master_grad if not self._grads_in_pool(s) else None
        if grads is None:
            made = buffer[self.fields(s) * n:(self.fields(s) + 1) * n]
            self._gather(b, host.grad_staging, made)
        decays: dict[float, list] = {}
        for p, at, first, count, decay in b.placed():
            weight = master[at:at + count] if master is not None else host.master[first:first + count]
            grad = made[at:at + count] if grads is None else grads[first:first + count]
            if unscale is not None:
                grad.div_(unscale)
            if clip < 1.0:
                grad.mul_(clip)
            param = torch.nn.Parameter(weight, requires_grad=True)  # a view: AdamW writes the block's values
            param.grad = grad
            state = {"step": torch.tensor(float(self.steps[s])), "exp_avg": exp_avg[at:at + count],
                     "exp_avg_sq": exp_avg_sq[at:at + count]}
            decays.setdefault(decay, []).append((param, state))
        optimizer = adamw([{"params": [p for p, _ in ps], "weight_decay": d} for d, ps in decays.items()],
                          UpdateRule(lr=lr, betas=group["betas"], eps=group["eps"]))
        for ps in decays.values():
            for p, state in ps:
                optimizer.state[p] = state
        optimizer.step()

    def _read(self, s: int, b: _Block) -> torch.Tensor:
        buffer = self.pool.get()  # waits for the writer to hand one back
        self._move(os.preadv, s, b, buffer[:self.fields(s) * b.count])
        return buffer

    def _write(self, s: int, b: _Block, record: torch.Tensor, buffer: torch.Tensor) -> None:
        try:
            self._move(os.pwritev, s, b, record)
        finally:
            self.pool.put(buffer)

    def _moments(self, s: int, b: _Block, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``b``'s ``exp_avg`` and ``exp_avg_sq`` in its ``record`` (after the master, if any)."""
        first = (self.fields(s) - len(MOMENTS)) * b.count
        return record[first:first + b.count], record[first + b.count:first + 2 * b.count]

    @staticmethod
    def _gather(b: _Block, flat: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the block's length) from the block's pieces of a stage's master-layout ``flat``."""
        for _, at, first, count, _ in b.placed():
            out[at:at + count].copy_(flat[first:first + count])

    @staticmethod
    def _scatter(b: _Block, values: torch.Tensor, flat: torch.Tensor) -> None:
        """The block's ``values`` into their places in a stage's master-layout ``flat``."""
        for _, at, first, count, _ in b.placed():
            flat[first:first + count].copy_(values[at:at + count])

    @staticmethod
    def _unbind_master(host: HostStage) -> None:
        host.master = torch.empty(0)
        if host.grad_staging.dtype != torch.float32:
            host.master_grad = torch.empty(0)
        for p in host.master_params:
            p.grad = None
            p.data = torch.empty(0)

    def _move(self, call, s: int, b: _Block, record: torch.Tensor) -> None:
        """Block ``b``'s ``record`` (or its first part) read from or written to stage ``s``'s files."""
        self._transfer(call, self.fds[s], self.paths[s], b.parts, record,
                       f"state {s} {'to' if call is os.pwritev else 'from'} disk", "the optimizer's state")

    def _transfer(self, call, fds: list[int], paths: list[Path], parts: list[tuple[int, int, int]],
                  values: torch.Tensor, name: str, what: str) -> None:
        """``values`` read from or written to ``fds``, each drive's part (element in ``values``,
        count, element in that drive's file) on a thread of its own (the calls may move less than
        asked), as a span on the trace."""
        size = values.element_size()
        view_ = memoryview(values.view(torch.uint8).numpy())

        def part(k: int) -> None:
            start, count, offset = parts[k]
            piece, done = view_[size * start: size * (start + count)], 0
            try:
                while done < len(piece):
                    moved = call(fds[k], [piece[done:]], size * offset + done)
                    if moved <= 0:
                        raise OSError(0, "the file ended early")
                    done += moved
            except OSError as err:
                raise RunError(f"--offload-dir {shown(paths[k])}: {'reading' if call is os.preadv else 'writing'} "
                               f"{what} failed ({err.strerror})") from None

        def io() -> None:
            if self._parts:
                list(self._parts[call].map(part, range(len(parts))))
            else:
                part(0)

        write = call is os.pwritev
        t0 = time.perf_counter()
        self.through(len(view_), write, io)
        self.trace.span(name, "disk write" if write else "disk read", t0, time.perf_counter(), bytes=len(view_))
        if write:
            self.written_bytes += len(view_)
        else:
            self.read_bytes += len(view_)

    # ---- the compute copy of a stage whose weights wait on disk -------------------------------
    def _weights_parts(self, s: int, start: int, count: int) -> list[tuple[int, int, int]]:
        """Each drive's part of the run ``[start, start + count)`` of stage ``s``'s compute copy
        (striped like a record: one contiguous part of the whole copy a drive), as in :meth:`_transfer`."""
        out = []
        for first, n in stripes(self.numel(s), len(self.directories)):
            a, b = max(start, first), min(start + count, first + n)
            out.append((a - start, b - a, a - first) if b > a else (0, 0, 0))
        return out

    def _weights_io(self, call, s: int, start: int, values: torch.Tensor) -> None:
        write = call is os.pwritev
        self._transfer(call, self.weight_fds[s], self.weight_paths[s],
                       self._weights_parts(s, start, values.numel()), values,
                       f"weights {s} {'to' if write else 'from'} disk", "the stage's weights")

    def read_weights(self, s: int, out: torch.Tensor) -> None:
        """Stage ``s``'s compute copy into ``out`` (the loads' staging buffer), once the writes of
        its last update are done."""
        for w in list(self._writes.get(s, ())):
            w.result()
        self._weights_io(os.preadv, s, 0, out[:self.numel(s)])

    def _write_block_weights(self, s: int, b: _Block, values: torch.Tensor) -> None:
        # A parked stage's blocks hold every parameter in order: a block is one run of the copy.
        self._weights_io(os.pwritev, s, b.pieces[0][1], values)

    # ---- checkpoints and the final weights ----------------------------------------------------
    def finish_writes(self) -> None:
        """Every write issued so far done (before the files are read whole)."""
        writes, self._writes = self._writes, {}
        for w in [w for ws in writes.values() for w in ws]:
            w.result()

    def loaded(self, s: int) -> None:
        """Stage ``s``'s state in tensors of its own: the master weights of a parked stage bound to
        its parameters, the moments and step count in its AdamW's state (a checkpoint reads them, a
        restore writes into them; :meth:`unload` sends them back, :meth:`forget` drops them)."""
        if not self.holds(s):
            return
        self.finish_writes()
        host, optimizer = self.hosts[s], self.hosts[s].optimizer
        if s in self.masters:
            host.master = torch.empty(sum(sl.numel for sl in self.slots[s].values()))
            for p in host.master_params:
                p.data = view(host.master, self.slots[s][id(p)])
        if self.steps[s] == 0:
            return  # no moments yet
        moments = {id(p): (torch.empty(p.shape), torch.empty(p.shape)) for p in host.master_params}
        for b in self.blocks[s]:
            record = torch.empty(self.fields(s) * b.count)
            self._move(os.preadv, s, b, record)
            if s in self.masters:
                self._scatter(b, record[:b.count], host.master)
            for p, at, first, count, _ in b.placed():
                start = first - self.slots[s][id(p)].offset  # where the piece lies in p's own values
                for moment, stored in zip(moments[id(p)], self._moments(s, b, record)):
                    moment.view(-1)[start:start + count].copy_(stored[at:at + count])
        for p in [q for g in optimizer.param_groups for q in g["params"]]:
            optimizer.state[p] = {"step": torch.tensor(float(self.steps[s])), "exp_avg": moments[id(p)][0],
                                  "exp_avg_sq": moments[id(p)][1]}

    def forget(self, s: int) -> None:
        """Drop what :meth:`loaded` bound (the files hold the same)."""
        if not self.holds(s):
            return
        self.hosts[s].optimizer.state.clear()
        if s in self.masters:
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
        """Stage ``s``'s state as it is bound now (a checkpoint's, restored into what :meth:`loaded`
        bound) written to its files; then :meth:`forget`."""
        if not self.holds(s):
            return
        host, optimizer = self.hosts[s], self.hosts[s].optimizer
        by_id = {id(p): optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]}
        made = [st for st in by_id.values() if all(k in st for k in MOMENTS)]
        self.steps[s] = int(made[0]["step"]) if made else 0
        for b in self.blocks[s]:
            record = torch.zeros(self.fields(s) * b.count)
            if s in self.masters:
                self._gather(b, host.master, record[:b.count])
            for p, at, first, count, _ in b.placed():
                start, st = first - self.slots[s][id(p)].offset, by_id[id(p)]
                for key, stored in zip(MOMENTS, self._moments(s, b, record)):
                    if key in st:
                        stored[at:at + count].copy_(st[key].reshape(-1)[start:start + count])
            self._move(os.pwritev, s, b, record)
        if s in self.weights:  # the compute copy of the master as restored
            self._weights_io(os.pwritev, s, 0, host.master.to(host.grad_staging.dtype))
        self.forget(s)

    def close(self) -> None:
        """The files removed (they are the run's, and only the run's): writes not begun are dropped
        (nothing reads them again: a checkpoint reads the state before, through :meth:`loaded`),
        those under way finish."""
        self._close()

    def _close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True, cancel_futures=True)
        for pool in self._parts.values():
            pool.shutdown(wait=True)
        for fds in (self.fds, self.weight_fds):
            for s in fds:
                for fd in fds[s]:
                    os.close(fd)
        self.fds, self.weight_fds = {}, {}
        for ledger in self.ledgers:  # each file removed while it is still the one made
            ledger.close()
        self.ledgers = []


def measure_drive(directory: str | os.PathLike, nbytes: int, block: int = 64 * 2**20) -> tuple[float, float]:
    """(read, write) GB/s of the drive under ``directory``, sequential, as the disk tier uses it:
    ``nbytes`` written in ``block``-sized requests and flushed to the drive (``fsync``), then read
    back with its pages dropped from the page cache first, through a file of our own (created
    exclusively, removed after)."""
    name = f".mobius-drive-{os.getpid()}"
    buffer = memoryview(torch.randn(block // 4).numpy()).cast("B")
    remove_orphans(directory)  # a timing file left by a process that was killed
    fs = os.statvfs(directory)
    free = fs.f_bavail * fs.f_frsize
    if nbytes > free // 2:  # the timing file never takes the drive's last bytes (nor half of what is left)
        raise InputError(f"{shown(directory)}: timing the drive writes a {nbytes / 1e9:.2f} GB file there, but its "
                         f"file system has {free / 1e9:.2f} GB free; free some space, or time less "
                         "(mobius.rates --drive-gb)")
    try:
        ledger = FileLedger(directory, "drive")
        fd = ledger.create(name)
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
        ledger.close()
    return nbytes / read_s / 1e9, nbytes / write_s / 1e9


def shares_a_file_system(directories) -> bool:
    """Whether two of ``directories`` are on one file system (then on one drive, not one each)."""
    return len({os.stat(d).st_dev for d in directories}) < len(directories)


def check_offload_dir(cfg, model_config, topo) -> None:
    """``--offload-dir`` before training: one directory on each drive the state is striped over
    (no two on one file system), each one's file system holding its part of the moments of every
    trained parameter, and with ``--host-mem-gb`` of their master and compute weights (the most
    the tier writes there).  Each drive is timed (:func:`measure_drive`, a fraction of a second):
    where the plan is given its rates (the topology's drives, ``--drive-gbps``;
    :func:`mobius.planning.prepare.resolve_topology` pairs them with the directories in order), one
    that reads or writes at less than half of them is refused (the plan would be wrong); where it
    is not, ``topo`` takes the drive as timed, named as sysfs names it, for the plan to use.
    Under ``--emulate`` the stated rates are what the run is charged: nothing to time."""
    directories = cfg.offload_dir
    if not directories:
        return
    if shares_a_file_system(directories):
        raise InputError(f"--offload-dir {','.join(map(shown, directories))}: two of these directories are on one "
                         "file system; name one directory on each drive (they are read and written at once)")
    # The most the tier can write there (the plan, made later, may keep the master and compute
    # weights in memory; the precision may not be decided yet: the compute weights counted fp32).
    per_param = MOMENT_BYTES + (MASTER_BYTES + 4 if cfg.host_mem_gb is not None else 0)
    need = per_param * sum(p.numel() for p in build_model(model_config, device="meta").parameters()
                           if p.requires_grad) / len(directories)
    for directory in directories:
        fs = os.statvfs(directory)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise InputError(f"--offload-dir {shown(directory)}: the optimizer's state takes up to {need / 1e9:.2f} GB "
                             f"there, but its file system has {free / 1e9:.2f} GB free")
    if topo is None or cfg.emulation.enabled:
        return
    for k, (directory, drive) in enumerate(zip(directories, topo.drives)):
        read, write = measure_drive(directory, DRIVE_TIMING_BYTES)
        if drive.assumed:  # not stated: the plan takes what it does here, by the name sysfs gives it
            topo.drives[k] = Drive(drive_name(os.stat(directory).st_dev) or f"drive{k}", max(round(read, 1), 0.1),
                                   max(round(write, 1), 0.1))
            continue
        if read < DRIVE_SHARE_REQUIRED * drive.read_gbps or write < DRIVE_SHARE_REQUIRED * drive.write_gbps:
            raise InputError(f"--offload-dir {shown(directory)}: its drive reads {read:.2f} GB/s and writes "
                             f"{write:.2f} GB/s here, but the plan was given {drive.read_gbps:g} and "
                             f"{drive.write_gbps:g} GB/s (the topology's drives or --drive-gbps): state what it does "
                             "(python -m mobius.rates --drive DIR --write FILE) or use a faster drive")
