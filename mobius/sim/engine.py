"""A discrete-event simulator of tasks on GPUs sharing PCIe root complexes.

Resources, per GPU: a compute stream (tasks start strictly in issue order, like a CUDA stream),
copy streams (a transfer names its stream: the runtime's parameter prefetch, activation and
gradient streams), and a CPU worker thread (AdamW).  A copy stream runs one transfer at a time and
picks, among the issued transfers whose dependencies are done, the one with the best priority (the
runtime's transfer queue); transfers on different streams of one GPU run at the same time.

Bandwidth is a fluid model.  The transfers of one GPU in one direction share its link equally (but
an *urgent* one, which holds the others of its GPU and direction until it is done); the
transfers of one root complex in one direction share its host bandwidth max-min fair, each capped
by its share of its link (PCIe has no priorities between devices).  Where links are as fast as
their root complex (every preset) this is the sharing ``--emulate`` gives the runtime
(:mod:`mobius.runtime.emulation`).  Rates are recomputed whenever a transfer starts or ends.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

EPS = 1e-12

COMPUTE, H2D, D2H, CPU = "compute", "h2d", "d2h", "cpu"
NET = "net"  # an exchange between data-parallel replicas over the node's network (bytes)
# A read from or a write to the box's drives (bytes): each direction shared by every GPU's in flight.
DISK_READ, DISK_WRITE = "disk read", "disk write"
DELAY = "delay"  # a latency: takes its time, holds no resource
SHARED = {NET: "network_bw", DISK_READ: "disk_read_bw", DISK_WRITE: "disk_write_bw"}  # the box's, not a GPU's
TRANSFERS = (H2D, D2H, *SHARED)


@dataclass(slots=True)
class Task:
    id: int
    name: str
    kind: str  # compute | h2d | d2h | cpu
    gpu: int
    work: float  # seconds (compute, cpu) or bytes (h2d, d2h)
    deps: tuple[int, ...]
    priority: int = 0
    stream: str = ""  # transfers: the copy stream it is issued on
    urgent: bool = False  # a transfer its GPU's other transfers of that direction give way to
    start: float = -1.0
    end: float = -1.0
    remaining: float = 0.0
    rate: float = 0.0
    finish: float = 0.0  # a pass's, a thread's or a delay's end, once it starts (a transfer's follows its rate)


@dataclass
class Link:
    gpu_bw: dict[int, float]  # bytes/s per GPU link (each direction)
    rc_of: dict[int, int]
    rc_bw: dict[int, float]  # bytes/s per root complex (each direction)
    network_bw: float = 0.0  # bytes/s of the node's network, shared by its exchanges in flight (if any)
    disk_read_bw: float = 0.0  # bytes/s of the box's drives, all together (if any)
    disk_write_bw: float = 0.0


@dataclass
class SimResult:
    step_s: float
    tasks: list[Task]
    # Of a dispatched step (mobius.sim.dispatched): its device work's part, and what bounds it
    # besides (a host thread's AdamW or the network's exchanges of one step); step_s is the larger.
    device_s: float | None = None
    floor_s: float = 0.0
    compute_s: float = 0.0  # and what its busiest GPU computes a step, over the steps simulated
    bytes_by_gpu: dict = field(default_factory=dict)  # (gpu, dir) -> bytes
    bytes_by_rc: dict = field(default_factory=dict)  # (rc, dir) -> bytes

    def transfers(self) -> list[Task]:
        return [t for t in self.tasks if t.kind in (H2D, D2H) and t.work > 0]

    def achieved_bandwidths(self) -> list[tuple[float, float]]:
        """(bytes, GB/s) of every transfer: the data for a bandwidth CDF (Mobius Fig. 7/11)."""
        return [(t.work, t.work / max(t.end - t.start, EPS) / 1e9) for t in self.transfers()]

    def total_bytes(self, direction: str | None = None) -> float:
        return sum(v for (g, d), v in self.bytes_by_gpu.items() if direction in (None, d))

    def exposed_transfer_s(self) -> float:
        """Transfer time not overlapped by compute, averaged over GPUs (Mobius Fig. 8): the time a
        GPU has a transfer in flight while its compute stream is idle."""
        gpus = sorted({t.gpu for t in self.tasks})
        total = 0.0
        for g in gpus:
            xfer = _union([(t.start, t.end) for t in self.tasks if t.gpu == g and t.kind in (H2D, D2H)])
            comp = _union([(t.start, t.end) for t in self.tasks if t.gpu == g and t.kind == COMPUTE])
            total += _length(xfer) - _length(_intersect(xfer, comp))
        return total / max(1, len(gpus))

    def chrome_trace(self) -> list[dict]:
        """Events in the runtime's trace format (pid = GPU/worker, tid = lane)."""
        lane = {COMPUTE: "compute", H2D: "prefetch", D2H: "offload", CPU: "optimizer"}
        return [{"name": t.name, "ph": "X", "pid": t.gpu, "tid": lane[t.kind], "ts": t.start * 1e6,
                 "dur": (t.end - t.start) * 1e6, "args": {"bytes": t.work} if t.kind in (H2D, D2H) else {}}
                for t in self.tasks if t.end > t.start]


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


class Simulator:
    def __init__(self, link: Link):
        self.link = link
        self.tasks: list[Task] = []

    def add(self, name: str, kind: str, gpu: int, work: float, deps=(), priority: int = 0, stream: str = "",
            urgent: bool = False) -> int:
        tid = len(self.tasks)
        self.tasks.append(Task(tid, name, kind, gpu, float(work), tuple([d for d in deps if d is not None]), priority,
                               stream, urgent))
        return tid

    # ---- bandwidth -------------------------------------------------------------------------
    def _assign_rates(self, active: list[Task]) -> None:
        link = self.link
        sharing: dict[str, list[Task]] = {}
        flows: list[Task] = []
        urgent = set()
        for t in active:
            if t.kind in SHARED:
                sharing.setdefault(t.kind, []).append(t)
            else:
                flows.append(t)
                if t.urgent:
                    urgent.add((t.gpu, t.kind))
        for kind, those in sharing.items():
            for t in those:
                t.rate = getattr(link, SHARED[kind]) / len(those)
        # An urgent transfer holds its GPU's others of its direction (the runtime issues them in
        # pieces, none while it runs: mobius.swap.upload_gate).
        per_gpu: dict[tuple[int, str], int] = {}
        groups: dict[tuple[int, str], list[Task]] = {}
        for t in flows:
            if urgent and not t.urgent and (t.gpu, t.kind) in urgent:
                t.rate = 0.0
                continue
            per_gpu[(t.gpu, t.kind)] = per_gpu.get((t.gpu, t.kind), 0) + 1
            groups.setdefault((link.rc_of[t.gpu], t.kind), []).append(t)
        for (rc, _), group in groups.items():
            # Max-min fair water-filling; a flow is capped by its share of its GPU's link (the
            # narrowest first, ties in the order they run).
            left, n = link.rc_bw[rc], len(group)
            caps = sorted((link.gpu_bw[f.gpu] / per_gpu[(f.gpu, f.kind)], k) for k, f in enumerate(group))
            for k, (cap, i) in enumerate(caps):
                rate = group[i].rate = min(cap, left / (n - k))
                left -= rate

    # ---- run ---------------------------------------------------------------------------------
    def run(self) -> SimResult:
        tasks = self.tasks
        done = [False] * len(tasks)
        # Each task's unfinished dependencies, and who waits on it: readiness is a count, not a scan.
        waiting_on = [len(t.deps) for t in tasks]
        dependents: list[list[int]] = [[] for _ in tasks]
        for t in tasks:
            t.remaining = t.work
            for d in t.deps:
                dependents[d].append(t.id)
        queues: dict[tuple[str, int, str], deque[int]] = defaultdict(deque)  # streams and threads: issue order
        ready: dict[tuple[str, int, str], list[tuple[int, int]]] = defaultdict(list)  # transfers: (priority, id) heaps
        # The running task of each busy resource only: an event looks at what runs, never at every
        # resource (each delay is a resource of its own, so there are as many as tasks).
        busy: dict[tuple[str, int, str], int] = {}
        # The resources whose next start may have changed: nothing else is looked at.  A dict, in the
        # order they changed: a set's order moves with the interpreter's string hashing, and with it
        # which of two transfers starting at one instant gets its share of a link first.
        changed: dict[tuple[str, int, str], None] = {}
        resource = [_resource(t) for t in tasks]
        moves = [t.kind in TRANSFERS for t in tasks]
        for t in tasks:
            key = resource[t.id]
            changed[key] = None
            if key[0] not in TRANSFERS:
                queues[key].append(t.id)
            elif not t.deps:
                heapq.heappush(ready[key], (t.priority, t.id))
        now = 0.0
        finished = 0
        by_gpu: dict = defaultdict(float)
        by_rc: dict = defaultdict(float)
        # The transfers' rates depend only on which transfers run: they are shared out again when
        # one starts or ends, not at every event (many are a pass or an update ending).
        transfers_changed = True

        while finished < len(tasks):
            # Start what can start: a transfer queue its best ready transfer (the runtime's transfer
            # queue), a stream or thread its next task in issue order once that is ready.
            for key in changed:
                if key in busy:
                    continue
                if key[0] in TRANSFERS:
                    pick = heapq.heappop(ready[key])[1] if ready[key] else None
                    transfers_changed |= pick is not None
                else:
                    q = queues[key]
                    pick = q.popleft() if q and not waiting_on[q[0]] else None
                if pick is not None:
                    busy[key] = pick
                    started = tasks[pick]
                    started.start = now
                    started.finish = now + started.work
            changed = {}
            active = [tasks[i] for i in busy.values()]
            if not active:
                stuck = [t.name for t in tasks if not done[t.id]][:5]
                raise RuntimeError(f"simulation deadlock at t={now:.6f}s; waiting: {stuck}")
            if transfers_changed:
                self._assign_rates([t for t in active if moves[t.id]])
                transfers_changed = False
            # Next completion.
            horizon = float("inf")
            for t in active:
                if not moves[t.id]:
                    if t.finish < horizon:
                        horizon = t.finish
                elif t.remaining <= EPS:
                    horizon = now
                elif t.rate > 0 and now + t.remaining / t.rate < horizon:
                    horizon = now + t.remaining / t.rate
            if horizon == float("inf"):
                raise RuntimeError("simulation stalled: transfers with zero bandwidth")
            dt = horizon - now
            now = horizon
            reached = now + EPS
            for t in active:
                if moves[t.id]:
                    t.remaining -= t.rate * dt
                    if t.remaining > max(EPS, 1e-9 * t.work):
                        continue
                    transfers_changed = True
                elif t.finish > reached:
                    continue
                t.end = now
                done[t.id] = True
                finished += 1
                key = resource[t.id]
                del busy[key]
                changed[key] = None
                for w in dependents[t.id]:
                    waiting_on[w] -= 1
                    if not waiting_on[w]:
                        wkey = resource[w]
                        changed[wkey] = None
                        if moves[w]:
                            heapq.heappush(ready[wkey], (tasks[w].priority, w))
                if t.kind in (H2D, D2H):
                    by_gpu[(t.gpu, t.kind)] += t.work
                    by_rc[(self.link.rc_of[t.gpu], t.kind)] += t.work
        return SimResult(step_s=max((t.end for t in tasks), default=0.0), tasks=tasks,
                         bytes_by_gpu=dict(by_gpu), bytes_by_rc=dict(by_rc))


def _resource(t: Task) -> tuple[str, int, str]:
    """The queue a task waits in: its GPU's compute stream, copy stream or CPU thread (a delay
    holds nothing)."""
    return (t.kind, t.gpu if t.kind != DELAY else -1 - t.id, t.stream)


def link_for(topo) -> Link:
    return Link(gpu_bw={g.index: g.link_bandwidth_gbps * 1e9 for g in topo.gpus},
                rc_of={g.index: g.root_complex for g in topo.gpus},
                rc_bw={r.id: r.host_bandwidth_gbps * 1e9 for r in topo.root_complexes})
