"""The topology model and its JSON file format (see ``topology/README.md``).

A topology is a set of GPUs, each under one CPU root complex whose host bandwidth the GPUs under
it share, plus which pairs have NVLink and whether GPU peer-to-peer works.  Bandwidths are GB/s,
memory is GB (10^9 bytes).  Unknown keys are kept (``extra``) and ignored; a missing or mistyped
required key is an error naming the file and the key.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 10**9
# The disk tier's drive where a topology states none: a PCIe 4.0 NVMe's sequential rate, assumed.
ASSUMED_DRIVE_GBPS = 3.5


class TopologyError(ValueError):
    """A topology file or preset that cannot be used; the message names the source and key."""


@dataclass
class RootComplex:
    id: int
    host_bandwidth_gbps: float
    extra: dict = field(default_factory=dict)


@dataclass
class GPU:
    index: int
    name: str
    memory_gb: float
    tflops: float  # dense fp16/bf16 tensor-core peak, fp32 accumulation (the vendor's figure)
    root_complex: int
    link_bandwidth_gbps: float
    extra: dict = field(default_factory=dict)
    # Dense fp16 tensor-core peak with fp16 accumulation, where it is higher (GeForce cards run it at
    # twice their fp32-accumulate rate; A100, H100 and H200 at the same): None, the same as tflops.
    fp16_accumulate_tflops: float | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)

    def peak_tflops(self, fp16_accumulation: bool = False) -> float:
        """The dense tensor-core peak a run computes at: with fp16 accumulation, its own figure."""
        return (self.fp16_accumulate_tflops or self.tflops) if fp16_accumulation else self.tflops


@dataclass(frozen=True)
class Network:
    """A node's link to the other nodes of a multi-node run (:mod:`topology.networks`)."""

    name: str
    bandwidth_gbps: float  # GB/s each way
    latency_us: float


@dataclass(frozen=True)
class Drive:
    """A drive the disk tier can keep state on (``--offload-dir``): its sequential bandwidths."""

    name: str
    read_gbps: float
    write_gbps: float
    assumed: bool = False  # not stated: a run's directory on a drive of ASSUMED_DRIVE_GBPS (never saved)


@dataclass
class Topology:
    name: str
    host_memory_gb: float
    root_complexes: list[RootComplex]
    gpus: list[GPU]
    nvlink: list[tuple[int, int]] | str = field(default_factory=list)  # pairs, or "all"
    p2p: bool = False
    virtual: bool = False  # CPU workers standing in for GPUs
    extra: dict = field(default_factory=dict)
    # The host's achievable memory bandwidth (GB/s, what ``a += b`` on every core reaches): it bounds
    # the host AdamW every worker's optimizer runs.  None: not known (the planner assumes a rate).
    host_memory_bandwidth_gbps: float | None = None
    network: Network | None = None  # to the other nodes; None: not stated (a single box)
    drives: list[Drive] = field(default_factory=list)  # for the disk tier; none stated: none planned

    def drive_gbps(self) -> tuple[float, float]:
        """(read, write) GB/s of the drives together (a run's: stated, or assumed under each
        ``--offload-dir`` directory by :func:`mobius.planning.prepare.resolve_topology`)."""
        return sum(d.read_gbps for d in self.drives), sum(d.write_gbps for d in self.drives)

    # ---- queries -------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.gpus)

    def shape(self) -> str:
        """What a node must share with the others of a multi-node run: its GPUs and how they sit
        under root complexes (not their PCI addresses or serials)."""
        gpus = ", ".join(f"{g.name} {g.memory_gb:g} GB on root complex {g.root_complex}" for g in self.gpus)
        return f"{self.n} {'CPU workers' if self.virtual else 'GPUs'} ({gpus})"

    def root_complex_of(self, gpu: int) -> int:
        return self.gpus[gpu].root_complex

    def rc(self, rc_id: int) -> RootComplex:
        return next(r for r in self.root_complexes if r.id == rc_id)

    def groups(self) -> dict[int, list[int]]:
        """Root complex id -> the GPU indices under it."""
        out: dict[int, list[int]] = {r.id: [] for r in self.root_complexes}
        for g in self.gpus:
            out[g.root_complex].append(g.index)
        return out

    def nvlinked(self, a: int, b: int) -> bool:
        if a == b:
            return False
        if self.nvlink == "all":
            return True
        return (a, b) in self.nvlink or (b, a) in self.nvlink

    def fully_connected(self) -> bool:
        """NVLink (or working P2P) between every pair of GPUs."""
        pairs = [(a, b) for a in range(self.n) for b in range(a + 1, self.n)]
        return self.n > 1 and (self.p2p or all(self.nvlinked(a, b) for a, b in pairs))

    def choose_backend(self) -> tuple[str, str]:
        """The backend ``auto`` picks, and why (Mobius §4.8: with NVLink, sharded DP wins)."""
        if self.virtual:
            return "pipeline", f"{self.n} CPU workers stand in for GPUs (no NVIDIA GPU found): rehearse the pipeline"
        if self.fully_connected():
            pairs = [(a, b) for a in range(self.n) for b in range(a + 1, self.n)]
            how = "NVLink" if all(self.nvlinked(a, b) for a, b in pairs) else "peer-to-peer"
            return "chunked", f"{how} between every pair of the {self.n} GPUs: chunked data parallelism"
        return "pipeline", "GPUs talk only through host memory (no NVLink/P2P between every pair): Mobius pipeline"

    def link_level(self, a: int, b: int) -> str:
        """Connection label as ``nvidia-smi topo -m`` prints it (from what the topology knows)."""
        if a == b:
            return "X"
        if self.nvlinked(a, b):
            count = self.extra.get("nvlink_count", {}).get(f"{min(a, b)}-{max(a, b)}")
            return f"NV{count or 1}"
        ga, gb = self.gpus[a], self.gpus[b]
        if ga.root_complex != gb.root_complex:
            return "SYS"
        level = self.extra.get("levels", {}).get(f"{min(a, b)}-{max(a, b)}")
        return level or "PHB"

    def host_bandwidth_share(self, gpu: int, concurrent: int) -> float:
        """GB/s one GPU gets when ``concurrent`` GPUs of its root complex copy at once."""
        g = self.gpus[gpu]
        rc_bw = self.rc(g.root_complex).host_bandwidth_gbps
        return min(g.link_bandwidth_gbps, rc_bw / max(1, concurrent))

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "host": {"memory_gb": self.host_memory_gb, **({"memory_bandwidth_gbps": self.host_memory_bandwidth_gbps}
                                                          if self.host_memory_bandwidth_gbps else {})},
            "root_complexes": [{"id": r.id, "host_bandwidth_gbps": r.host_bandwidth_gbps, **r.extra}
                               for r in self.root_complexes],
            "gpus": [{"index": g.index, "name": g.name, "memory_gb": g.memory_gb, "tflops": g.tflops,
                      **({"tflops_fp16_accumulate": g.fp16_accumulate_tflops} if g.fp16_accumulate_tflops else {}),
                      "root_complex": g.root_complex, "link_bandwidth_gbps": g.link_bandwidth_gbps, **g.extra}
                     for g in self.gpus],
            "nvlink": self.nvlink if self.nvlink == "all" else [list(p) for p in self.nvlink],
            "p2p": self.p2p,
        }
        if self.virtual:
            d["virtual"] = True
        if self.network is not None:
            d["network"] = {"name": self.network.name, "bandwidth_gbps": self.network.bandwidth_gbps,
                            "latency_us": self.network.latency_us}
        if any(not v.assumed for v in self.drives):
            d["drives"] = [{"name": v.name, "read_gbps": v.read_gbps, "write_gbps": v.write_gbps} for v in self.drives
                           if not v.assumed]
        d.update(self.extra)
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Write through an exclusively created temporary file beside ``path`` (never a user's
        file) and rename it into place."""
        import tempfile

        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.resolve().parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=2) + "\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


# ---- parsing with errors that name the key ----------------------------------------------------

def _get(obj: dict, key: str, kind: type | tuple, where: str, source: str, default: Any = ...) -> Any:
    if not isinstance(obj, dict):
        raise TopologyError(f"{source}: {where or 'top level'} must be an object")
    if key not in obj:
        if default is not ...:
            return default
        raise TopologyError(f"{source}: missing required key {where + '.' if where else ''}{key}")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if ok and isinstance(value, float) and not math.isfinite(value):
        raise TopologyError(f"{source}: key {where + '.' if where else ''}{key} must be a finite number, got {value!r}")
    if not ok:
        names = "/".join("number" if k in (int, float) else k.__name__ for k in kinds)
        raise TopologyError(f"{source}: key {where + '.' if where else ''}{key} must be {names}, got {value!r}")
    return value


NUMBER = (int, float)


def topology_from_dict(d: dict, source: str = "<topology>") -> Topology:
    """A topology from its file's dict, every key checked (``source`` names the file in messages)."""
    name = _get(d, "name", str, "", source)
    host = _get(d, "host", dict, "", source)
    host_mem = _get(host, "memory_gb", NUMBER, "host", source)
    if host_mem <= 0:
        raise TopologyError(f"{source}: key host.memory_gb must be positive, got {host_mem!r}")
    host_bw = _get(host, "memory_bandwidth_gbps", NUMBER, "host", source, default=None)
    if host_bw is not None and host_bw <= 0:
        raise TopologyError(f"{source}: key host.memory_bandwidth_gbps must be positive, got {host_bw!r}")
    rcs = _root_complexes(d, source)
    gpus = _gpus(d, source, {r.id for r in rcs})
    top_known = ("name", "host", "root_complexes", "gpus", "nvlink", "p2p", "virtual", "network", "drives")
    return Topology(name=name, host_memory_gb=float(host_mem), root_complexes=rcs, gpus=gpus,
                    nvlink=_nvlink(d, source, len(gpus)), p2p=_get(d, "p2p", bool, "", source, default=False),
                    virtual=_get(d, "virtual", bool, "", source, default=False),
                    extra={k: v for k, v in d.items() if k not in top_known},
                    host_memory_bandwidth_gbps=None if host_bw is None else float(host_bw),
                    network=_network(d, source), drives=_drives(d, source))


def _root_complexes(d: dict, source: str) -> list[RootComplex]:
    rcs = []
    for i, r in enumerate(_get(d, "root_complexes", list, "", source)):
        where = f"root_complexes[{i}]"
        rcs.append(RootComplex(
            id=_get(r, "id", int, where, source),
            host_bandwidth_gbps=float(_get(r, "host_bandwidth_gbps", NUMBER, where, source)),
            extra={k: v for k, v in r.items() if k not in ("id", "host_bandwidth_gbps")},
        ))
    for i, r in enumerate(rcs):
        if r.host_bandwidth_gbps <= 0:
            raise TopologyError(f"{source}: key root_complexes[{i}].host_bandwidth_gbps must be positive")
    if len({r.id for r in rcs}) != len(rcs):
        raise TopologyError(f"{source}: root_complexes: duplicate id")
    return rcs


def _gpus(d: dict, source: str, rc_ids: set[int]) -> list[GPU]:
    gpus = []
    known = ("index", "name", "memory_gb", "tflops", "tflops_fp16_accumulate", "root_complex", "link_bandwidth_gbps")
    for i, g in enumerate(_get(d, "gpus", list, "", source)):
        where = f"gpus[{i}]"
        gpu = GPU(
            index=_get(g, "index", int, where, source),
            name=_get(g, "name", str, where, source),
            memory_gb=float(_get(g, "memory_gb", NUMBER, where, source)),
            tflops=float(_get(g, "tflops", NUMBER, where, source)),
            root_complex=_get(g, "root_complex", int, where, source),
            link_bandwidth_gbps=float(_get(g, "link_bandwidth_gbps", NUMBER, where, source)),
            extra={k: v for k, v in g.items() if k not in known},
            fp16_accumulate_tflops=_get(g, "tflops_fp16_accumulate", NUMBER, where, source, default=None),
        )
        if gpu.fp16_accumulate_tflops is not None and gpu.fp16_accumulate_tflops <= 0:
            raise TopologyError(f"{source}: key {where}.tflops_fp16_accumulate must be positive")
        if gpu.root_complex not in rc_ids:
            raise TopologyError(f"{source}: key {where}.root_complex names unknown root complex {gpu.root_complex}")
        if gpu.memory_gb <= 0 or gpu.tflops <= 0 or gpu.link_bandwidth_gbps <= 0:
            raise TopologyError(f"{source}: {where}: memory_gb, tflops and link_bandwidth_gbps must be positive")
        gpus.append(gpu)
    if not gpus:
        raise TopologyError(f"{source}: key gpus is empty")
    if sorted(g.index for g in gpus) != list(range(len(gpus))):
        raise TopologyError(f"{source}: key gpus[].index must number the GPUs 0..{len(gpus) - 1}")
    return sorted(gpus, key=lambda g: g.index)


def _nvlink(d: dict, source: str, n_gpus: int) -> list[tuple[int, int]] | str:
    nvlink_raw = _get(d, "nvlink", (list, str), "", source, default=[])
    if isinstance(nvlink_raw, str):
        if nvlink_raw != "all":
            raise TopologyError(f"{source}: key nvlink must be a list of index pairs or \"all\", got {nvlink_raw!r}")
        return "all"
    nvlink = []
    for p in nvlink_raw:
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and 0 <= x < n_gpus for x in p)):
            raise TopologyError(f"{source}: key nvlink: {p!r} is not a pair of GPU indices")
        nvlink.append((p[0], p[1]))
    return nvlink


def _network(d: dict, source: str) -> Network | None:
    net = _get(d, "network", dict, "", source, default=None)
    if net is None:
        return None
    network = Network(_get(net, "name", str, "network", source, default="network"),
                      float(_get(net, "bandwidth_gbps", NUMBER, "network", source)),
                      float(_get(net, "latency_us", NUMBER, "network", source, default=10.0)))
    if network.bandwidth_gbps <= 0 or network.latency_us < 0:
        raise TopologyError(f"{source}: key network: bandwidth_gbps must be positive and latency_us not negative")
    return network


def _drives(d: dict, source: str) -> list[Drive]:
    drives = []
    for k, raw in enumerate(_get(d, "drives", list, "", source, default=[])):
        if not isinstance(raw, dict):
            raise TopologyError(f"{source}: key drives[{k}] must be an object")
        drive = Drive(_get(raw, "name", str, "drives[]", source, default=f"drive{k}"),
                      float(_get(raw, "read_gbps", NUMBER, "drives[]", source)),
                      float(_get(raw, "write_gbps", NUMBER, "drives[]", source)))
        if not (0 < drive.read_gbps < 1e4 and 0 < drive.write_gbps < 1e4):
            raise TopologyError(f"{source}: key drives[{k}]: read_gbps and write_gbps must be positive GB/s")
        drives.append(drive)
    return drives


def load_topology_file(path: str | os.PathLike) -> Topology:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as err:
        raise TopologyError(f"{path}: cannot read topology file: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TopologyError(f"{path}: not a topology file (not UTF-8 text)") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as err:
        raise TopologyError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    except RecursionError:
        raise TopologyError(f"{path}: not a topology file (JSON nested too deeply)") from None
    return topology_from_dict(d, str(path))


# ---- CPU workers standing in for GPUs ------------------------------------------------------------

CPU_WORKER_MEMORY_GB = 2.0
# Notional numbers for a CPU worker: what the analytic cost model assumes for it.
CPU_WORKER_TFLOPS = 0.05
CPU_COPY_GBPS = 5.0


def cpu_topology(workers: int = 2, memory_gb: float = CPU_WORKER_MEMORY_GB, host_memory_gb: float | None = None) -> Topology:
    """Virtual workers (CPU processes over gloo) standing in for GPUs, under one root complex.

    ``memory_gb`` is each worker's device budget, which the runtime enforces by its own accounting.
    """
    if host_memory_gb is None:
        try:
            host_memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        except (ValueError, OSError, AttributeError):
            host_memory_gb = 16.0
    gpus = [GPU(i, "cpu-worker", memory_gb, CPU_WORKER_TFLOPS, 0, CPU_COPY_GBPS) for i in range(workers)]
    return Topology(name=f"cpu{workers}", host_memory_gb=host_memory_gb,
                    root_complexes=[RootComplex(0, CPU_COPY_GBPS)], gpus=gpus, virtual=True)
