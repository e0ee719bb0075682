"""A stand-in for the ``pynvml`` module: enough of NVML to describe a machine in a test."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class FakeNVML:
    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVML_P2P_CAPS_INDEX_READ = (0,)  # a tuple, as in nvidia-ml-py
    NVML_P2P_STATUS_OK = 0
    NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_SINGLE, NVML_TOPOLOGY_MULTIPLE = 0, 10, 20
    NVML_TOPOLOGY_HOSTBRIDGE, NVML_TOPOLOGY_NODE, NVML_TOPOLOGY_SYSTEM = 30, 40, 50
    NVML_NVLINK_MAX_LINKS = 12
    NVML_FEATURE_ENABLED = 1

    def __init__(self, gpus: list[dict], missing: bool = False, p2p: bool = False, nvlink_all: bool = False):
        """gpus: dicts with name, bus ("0000:3b:00.0"), rc (host bridge name), mem_gb, gen, width."""
        self.gpus, self.missing, self.p2p, self.nvlink_all = gpus, missing, p2p, nvlink_all
        self.p2p_index_seen = []

    def nvmlInit(self):
        if self.missing:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=int(self.gpus[h]["mem_gb"] * 1e9))

    def nvmlDeviceGetPciInfo(self, h):
        domain, rest = self.gpus[h]["bus"].split(":", 1)
        return SimpleNamespace(busId=f"0000{domain}:{rest}".upper().encode())  # bytes, NVML spelling

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.gpus[h].get("gen", 3)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.gpus[h].get("width", 16)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        ga, gb = self.gpus[a], self.gpus[b]
        if ga["rc"] != gb["rc"]:
            return self.NVML_TOPOLOGY_SYSTEM
        return self.NVML_TOPOLOGY_SINGLE if ga.get("switch") and ga.get("switch") == gb.get("switch") \
            else self.NVML_TOPOLOGY_HOSTBRIDGE

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        self.p2p_index_seen.append(index)
        if isinstance(index, tuple):
            raise TypeError("pass NVML_P2P_CAPS_INDEX_READ[0], not the tuple")
        return 0 if self.p2p else 2

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink_all or link >= len(self.gpus) - 1:
            raise NVMLError("not supported")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        others = [i for i in range(len(self.gpus)) if i != h]
        return self.nvmlDeviceGetPciInfo(others[link])


def make_sysfs(root: Path, gpus: list[dict]) -> str:
    """Symlinks /sys/bus/pci/devices/<bdf> -> /sys/devices/<host bridge>/.../<bdf>, as Linux has."""
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    for g in gpus:
        domain = g["bus"].split(":")[0]
        target = root / "devices" / g["rc"] / f"{domain}:{g['rc'][-2:]}:00.0" / g["bus"]
        target.mkdir(parents=True, exist_ok=True)
        os.symlink(target, devices / g["bus"])
    return str(root)


def consumer_box(groups: list[int], name="NVIDIA GeForce RTX 3090") -> list[dict]:
    """GPUs grouped under host bridges, e.g. [2, 2] -> 2+2."""
    gpus, bus = [], 0x1a
    for rc, size in enumerate(groups):
        for _ in range(size):
            gpus.append({"name": name, "bus": f"0000:{bus:02x}:00.0", "rc": f"pci0000:{0x10 + 0x40 * rc:02x}",
                         "mem_gb": 24, "gen": 4, "width": 16, "switch": f"sw{rc}"})
            bus += 1
    return gpus
