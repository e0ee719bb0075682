"""``--topology auto``: read this machine's GPUs through NVML (``nvidia-ml-py``) and sysfs.

* Root complex of a GPU: ``/sys/bus/pci/devices/<bdf>`` is a symlink that resolves under
  ``/sys/devices/pciDDDD:BB/``; that host bridge is the root complex.  Cross-checked with NVML's
  common-ancestor level (two GPUs under one host bridge are never ``NODE``/``SYSTEM`` apart); where
  sysfs is unreadable, the NVML levels alone group the GPUs.
* Order: NVML numbers GPUs by PCI bus id, CUDA by default "fastest first".  Topology indices are
  NVML's; the launcher sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees.
* ``NVML_P2P_CAPS_INDEX_READ`` is a one-element tuple in nvidia-ml-py; the index passed is 0.
* No driver (``NVMLError_LibraryNotFound``) or no GPU: a CPU topology of virtual workers.
* A drive of the disk tier (:func:`drive_name`): the block device under a directory, from
  ``/sys/dev/block/MAJOR:MINOR`` (a partition's disk is its parent), its model, and the host bridge
  it resolves under, as for a GPU.  Its rates are measured, not read (``mobius.rates --drive``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from types import ModuleType

from topology.model import GB, GPU, RootComplex, Topology, cpu_topology

# Achievable host<->device GB/s per PCIe lane by generation (about 80% of the signalling rate).
PCIE_LANE_GBPS = {1: 0.2, 2: 0.4, 3: 0.8, 4: 1.6, 5: 3.2, 6: 6.4}
# Dense fp16/bf16 tensor TFLOPS with fp32 accumulation, by name fragment (first match wins), from
# NVIDIA's datasheets and architecture whitepapers (GeForce cards accumulate fp32 at half their
# fp16-accumulate rate; the 3090 Ti's is the GA102 rate at its 84 SMs and 1.86 GHz boost).
KNOWN_TFLOPS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1),
                ("4090", 165.2), ("3090 Ti", 80.0), ("3090", 71.0), ("A6000", 154.8), ("V100", 125.0),
                ("T4", 65.0), ("A10", 125.0)]
# Dense fp16 tensor TFLOPS with fp16 accumulation where the same whitepapers give more than the
# above (GeForce cards: twice); every other card runs it at its fp32-accumulate figure.
KNOWN_FP16_ACCUMULATE_TFLOPS = [("4090", 330.3), ("3090 Ti", 160.0), ("3090", 142.0)]
DEFAULT_TFLOPS = 50.0


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def sysfs_bdf(nvml_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs spells it: ``0000:3b:00.0``."""
    domain, rest = nvml_bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def root_complex_from_sysfs(bdf: str, sysfs_root: str = "/sys") -> str | None:
    """The ``pciDDDD:BB`` host bridge a device resolves under, or None if sysfs cannot tell."""
    link = Path(sysfs_root) / "bus" / "pci" / "devices" / bdf
    try:
        resolved = os.path.realpath(link)
    except OSError:
        return None
    match = re.search(r"/devices/(pci[0-9a-f]{4}:[0-9a-f]{2})/", resolved + "/")
    return match.group(1) if match and os.path.exists(resolved) else None


def drive_name(device: int, sysfs_root: str = "/sys") -> str | None:
    """The drive of the file system whose device number is ``device`` (``os.stat(dir).st_dev``) as
    people name it: ``nvme0n1 (Samsung SSD 990 PRO 2TB) on pci0000:40``; None where sysfs cannot
    tell (no such entry: a network or overlay file system)."""
    link = Path(sysfs_root) / "dev" / "block" / f"{os.major(device)}:{os.minor(device)}"
    resolved = Path(os.path.realpath(link))
    if not resolved.is_dir():
        return None
    disk = resolved.parent if (resolved / "partition").exists() else resolved
    try:
        model = (disk / "device" / "model").read_text().strip()
    except OSError:
        model = ""
    bridge = re.search(r"/devices/(pci[0-9a-f]{4}:[0-9a-f]{2})/", str(disk) + "/")
    return disk.name + (f" ({model})" if model else "") + (f" on {bridge.group(1)}" if bridge else "")


def tflops_for(name: str) -> float:
    return next((tf for frag, tf in KNOWN_TFLOPS if frag in name), DEFAULT_TFLOPS)


def fp16_accumulate_tflops_for(name: str) -> float | None:
    """A card's fp16-accumulate peak where it exceeds :func:`tflops_for` (None: the same)."""
    return next((tf for frag, tf in KNOWN_FP16_ACCUMULATE_TFLOPS if frag in name), None)


def _level_name(nvml: ModuleType, level: int) -> str:
    table = {nvml.NVML_TOPOLOGY_INTERNAL: "X", nvml.NVML_TOPOLOGY_SINGLE: "PIX",
             nvml.NVML_TOPOLOGY_MULTIPLE: "PXB", nvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
             nvml.NVML_TOPOLOGY_NODE: "NODE", nvml.NVML_TOPOLOGY_SYSTEM: "SYS"}
    return table.get(level, "SYS")


def probe_nvml(nvml: ModuleType, sysfs_root: str = "/sys") -> Topology | None:
    """The GPU topology NVML and sysfs describe, or None when there is no GPU."""
    nvml.nvmlInit()
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        infos = []
        for h in handles:
            bus_id = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
            try:
                gen = nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
                width = nvml.nvmlDeviceGetMaxPcieLinkWidth(h)
            except nvml.NVMLError:
                gen, width = 3, 16
            infos.append({"name": _text(nvml.nvmlDeviceGetName(h)), "bus_id": bus_id,
                          "memory": nvml.nvmlDeviceGetMemoryInfo(h).total, "gen": gen, "width": width})

        # Pairwise: NVML common ancestor, NVLink, P2P.
        levels: dict[str, str] = {}
        level_num: dict[tuple[int, int], int] = {}
        p2p_all = count > 1
        for a in range(count):
            for b in range(a + 1, count):
                lvl = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b])
                level_num[(a, b)] = lvl
                levels[f"{a}-{b}"] = _level_name(nvml, lvl)
                try:
                    status = nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_READ[0]
                                                         if isinstance(nvml.NVML_P2P_CAPS_INDEX_READ, tuple)
                                                         else nvml.NVML_P2P_CAPS_INDEX_READ)
                    p2p_all = p2p_all and status == nvml.NVML_P2P_STATUS_OK
                except nvml.NVMLError:
                    p2p_all = False
        nvlink_pairs, nvlink_count = _nvlinks(nvml, handles, infos)

        rc_of, rc_names = _root_complexes(nvml, infos, level_num, levels, sysfs_root)

        gpus = []
        for i, info in enumerate(infos):
            link_bw = PCIE_LANE_GBPS.get(info["gen"], 0.8) * info["width"]
            gpus.append(GPU(index=i, name=info["name"], memory_gb=info["memory"] / GB, tflops=tflops_for(info["name"]),
                            root_complex=rc_of[i], link_bandwidth_gbps=round(link_bw, 2),
                            extra={"pci_bus_id": info["bus_id"], "pcie_gen": info["gen"], "pcie_width": info["width"]},
                            fp16_accumulate_tflops=fp16_accumulate_tflops_for(info["name"])))
        rcs = [RootComplex(id=r, host_bandwidth_gbps=max(g.link_bandwidth_gbps for g in gpus if g.root_complex == r),
                           extra={"host_bridge": rc_names[r]}) for r in range(len(rc_names))]
        nvlink: list | str = sorted(nvlink_pairs)
        if count > 1 and len(nvlink_pairs) == count * (count - 1) // 2:
            nvlink = "all"
        host_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
        return Topology(name="auto", host_memory_gb=host_gb, root_complexes=rcs, gpus=gpus, nvlink=nvlink,
                        p2p=p2p_all, extra={"levels": levels, "nvlink_count": nvlink_count})
    finally:
        nvml.nvmlShutdown()


def _nvlinks(nvml: ModuleType, handles: list, infos: list[dict]) -> tuple[set[tuple[int, int]], dict[str, int]]:
    """The GPU pairs joined by NVLink, and how many links join each pair (``"a-b"``)."""
    bus_to_index = {sysfs_bdf(info["bus_id"]): i for i, info in enumerate(infos)}
    nvlink_pairs: set[tuple[int, int]] = set()
    nvlink_count: dict[str, int] = {}
    for a, h in enumerate(handles):
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = sysfs_bdf(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
            except nvml.NVMLError:
                break  # links past the device's last one raise
            b = bus_to_index.get(remote)
            if b is not None and b != a:
                pair = (min(a, b), max(a, b))
                nvlink_pairs.add(pair)
                if a < b:
                    key = f"{pair[0]}-{pair[1]}"
                    nvlink_count[key] = nvlink_count.get(key, 0) + 1
    return nvlink_pairs, nvlink_count


def _root_complexes(nvml: ModuleType, infos: list[dict], level_num: dict, levels: dict, sysfs_root: str
                    ) -> tuple[list[int], list[str]]:
    """Each GPU's root complex (an index) and each root complex's name: sysfs first, NVML's
    common-ancestor levels as the cross-check and the fallback."""
    roots = [root_complex_from_sysfs(sysfs_bdf(info["bus_id"]), sysfs_root) for info in infos]
    if all(roots):
        ids = {r: i for i, r in enumerate(dict.fromkeys(roots))}
        rc_of = [ids[r] for r in roots]
        for (a, b), lvl in level_num.items():
            if rc_of[a] == rc_of[b] and lvl >= nvml.NVML_TOPOLOGY_NODE:
                print(f"topology: warning: sysfs puts GPUs {a} and {b} under {roots[a]} but NVML says "
                      f"{levels[f'{a}-{b}']}; trusting sysfs", file=sys.stderr)
        rc_names = list(ids)
    else:
        rc_of = list(range(len(infos)))
        for (a, b), lvl in sorted(level_num.items()):
            if lvl <= nvml.NVML_TOPOLOGY_HOSTBRIDGE:
                rc_of[b] = rc_of[a]
        remap = {r: i for i, r in enumerate(dict.fromkeys(rc_of))}
        rc_of = [remap[r] for r in rc_of]
        rc_names = [f"nvml-group-{i}" for i in range(len(remap))]
    return rc_of, rc_names


def probe(cpu_workers: int = 2, cpu_memory_gb: float = 2.0, nvml: ModuleType | None = None,
          sysfs_root: str = "/sys", quiet: bool = False) -> Topology:
    """This machine's topology; without an NVIDIA driver or GPU, ``cpu_workers`` virtual workers."""
    reason = None
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            reason = "nvidia-ml-py is not installed"
    if nvml is not None:
        try:
            topo = probe_nvml(nvml, sysfs_root)
            if topo is not None:
                return topo
            reason = "NVML reports no GPU"
        except nvml.NVMLError_LibraryNotFound:
            reason = "no NVIDIA driver (NVML library not found)"
        except nvml.NVMLError as err:
            reason = f"NVML failed: {err}"
    if not quiet:
        print(f"topology: {reason}: using {cpu_workers} CPU workers with {cpu_memory_gb:g} GB each "
              "(--cpu-workers, --gpu-mem-gb)")  # information, not an error: stdout
    return cpu_topology(cpu_workers, cpu_memory_gb)
