import json
import subprocess
import sys

import pytest

from fake_nvml import FakeNVML, consumer_box, make_sysfs
from mobius.mapping import contention, cross_map, sequential_map, transfer_priority
from topology import TopologyError, load_preset, load_topology_file, preset_names
from topology.probe import probe


def test_probe_2_plus_2_from_sysfs(tmp_path):
    gpus = consumer_box([2, 2])
    nvml = FakeNVML(gpus)
    topo = probe(nvml=nvml, sysfs_root=make_sysfs(tmp_path, gpus))
    assert topo.n == 4 and not topo.virtual
    assert topo.groups() == {0: [0, 1], 1: [2, 3]}
    assert topo.root_complexes[0].extra["host_bridge"] == "pci0000:10"
    assert topo.gpus[0].memory_gb == 24 and topo.gpus[0].link_bandwidth_gbps == pytest.approx(25.6)
    assert topo.gpus[0].extra["pci_bus_id"].startswith("00000000:1A")
    assert not topo.p2p and nvml.p2p_index_seen and all(i == 0 for i in nvml.p2p_index_seen)
    assert topo.choose_backend()[0] == "pipeline"
    assert topo.link_level(0, 1) == "PIX" and topo.link_level(0, 2) == "SYS"


def test_probe_8_gpus_4_plus_4_without_sysfs_uses_nvml_levels(tmp_path):
    topo = probe(nvml=FakeNVML(consumer_box([4, 4])), sysfs_root=str(tmp_path / "nosys"))
    assert topo.groups() == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_probe_nvlink_dgx_chooses_chunked(tmp_path):
    gpus = [{"name": "NVIDIA A100-SXM4-40GB", "bus": f"0000:{b:02x}:00.0", "rc": f"pci0000:{b:02x}",
             "mem_gb": 40, "gen": 4, "width": 16} for b in (0x07, 0x0f, 0x47, 0x4e, 0x87, 0x90, 0xb7, 0xbd)]
    topo = probe(nvml=FakeNVML(gpus, p2p=True, nvlink_all=True), sysfs_root=make_sysfs(tmp_path, gpus))
    assert topo.nvlink == "all" and topo.p2p and topo.gpus[0].tflops == 312
    assert topo.choose_backend()[0] == "chunked" and topo.link_level(0, 5).startswith("NV")


def test_probe_p2p_disabled_consumer_box_chooses_pipeline(tmp_path):
    gpus = consumer_box([1, 1, 1, 1], name="NVIDIA GeForce RTX 4090")
    topo = probe(nvml=FakeNVML(gpus, p2p=False), sysfs_root=make_sysfs(tmp_path, gpus))
    assert len(topo.root_complexes) == 4 and not topo.p2p
    assert topo.choose_backend() == ("pipeline", topo.choose_backend()[1]) and "host memory" in topo.choose_backend()[1]


def test_probe_without_nvml_gives_cpu_workers(capsys):
    topo = probe(cpu_workers=3, cpu_memory_gb=1.5, nvml=FakeNVML([], missing=True))
    assert topo.virtual and topo.n == 3 and topo.gpus[0].memory_gb == 1.5
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no NVIDIA driver" in out[0]


@pytest.mark.parametrize("mutate,key", [
    (lambda d: d["gpus"][0].pop("memory_gb"), "gpus[0].memory_gb"),
    (lambda d: d.pop("root_complexes"), "root_complexes"),
    (lambda d: d["gpus"][1].__setitem__("tflops", "fast"), "gpus[1].tflops"),
    (lambda d: d["gpus"][2].__setitem__("root_complex", 7), "gpus[2].root_complex"),
    (lambda d: d["host"].pop("memory_gb"), "host.memory_gb"),
    (lambda d: d["gpus"][0].__setitem__("tflops_fp16_accumulate", -1), "gpus[0].tflops_fp16_accumulate"),
])
def test_malformed_files_name_the_key(tmp_path, mutate, key):
    d = load_preset("topo2+2").to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(TopologyError) as err:
        load_topology_file(path)
    assert str(path) in str(err.value) and key in str(err.value)
    # and the command line turns it into one line, exit 2
    r = subprocess.run([sys.executable, "-m", "topology", "--topology", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and key in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_presets_load_and_round_trip(tmp_path):
    for name in preset_names():
        topo = load_preset(name)
        topo.save(tmp_path / "t.json")
        again = load_topology_file(tmp_path / "t.json")
        assert again.to_dict() == topo.to_dict()
    assert load_preset("8x3090-4+4").n == 8 and load_preset("dgx-a100").choose_backend()[0] == "chunked"
    assert load_preset("p3.8xlarge").gpus[0].memory_gb == 16


def test_each_gpu_carries_its_peak_with_fp16_accumulation_and_a_run_plans_at_the_one_it_uses(capsys):
    from mobius.boundary.errors import InputError
    from mobius.config import RunConfig
    from mobius.planning.prepare import resolve_topology
    from topology.probe import fp16_accumulate_tflops_for, tflops_for

    assert (tflops_for("NVIDIA GeForce RTX 4090"), fp16_accumulate_tflops_for("NVIDIA GeForce RTX 4090")) == (165.2, 330.3)
    assert (tflops_for("NVIDIA GeForce RTX 3090"), fp16_accumulate_tflops_for("NVIDIA GeForce RTX 3090")) == (71.0, 142.0)
    assert fp16_accumulate_tflops_for("NVIDIA H200") is None  # the same as its fp32-accumulate peak
    gpu = load_preset("8x4090-4+4").gpus[0]
    assert (gpu.peak_tflops(), gpu.peak_tflops(fp16_accumulation=True)) == (165.2, 330.3)
    assert load_preset("dgx-a100").gpus[0].peak_tflops(fp16_accumulation=True) == 312.0
    topo = resolve_topology(RunConfig.of(topology="8x4090-4+4", precision="fp16", fp16_accumulation=True))
    assert {g.tflops for g in topo.gpus} == {330.3} and "fp16 accumulation: 330.3 TFLOPS" in topo.name
    assert {g.tflops for g in resolve_topology(RunConfig.of(topology="8x4090-4+4", precision="fp16")).gpus} == {165.2}
    with pytest.raises(InputError, match="needs --precision fp16, not bf16"):
        RunConfig.of(topology="8x4090-4+4", precision="bf16", fp16_accumulation=True)
    with pytest.raises(InputError, match="these are CPU workers"):
        resolve_topology(RunConfig.of(topology="cpu", precision="fp16", fp16_accumulation=True))


def test_cross_mapping_topo2_2_separates_every_adjacent_pair():
    topo = load_preset("topo2+2")
    m = cross_map(topo, 8)
    rcs = [topo.root_complex_of(m.gpu_of_stage(s)) for s in range(8)]
    assert all(rcs[s] != rcs[s + 1] for s in range(7))
    assert sorted(m.order) == [0, 1, 2, 3]


def test_cross_mapping_8_gpus_beats_sequential():
    topo = load_preset("8x3090-4+4")
    cross = cross_map(topo, 16)
    seq = sequential_map(topo, 16)
    assert cross.contention < seq.contention
    assert cross.contention == pytest.approx(contention(topo, cross.order, 16))


def test_exhaustive_search_is_optimal_over_all_orders():
    import itertools
    topo = load_preset("topo1+3")
    best = min(contention(topo, order, 9) for order in itertools.permutations(range(4)))
    assert cross_map(topo, 9).contention == pytest.approx(best)


def test_heuristic_beyond_8_gpus_beats_sequential():
    from topology.model import GPU, RootComplex, Topology
    gpus = [GPU(i, "g", 24, 40, i // 5, 13.1) for i in range(10)]
    topo = Topology("10", 512, [RootComplex(0, 13.1), RootComplex(1, 13.1)], gpus)
    m = cross_map(topo, 20)
    assert m.method == "cross-heuristic" and m.contention < sequential_map(topo, 20).contention


def test_transfer_priority_earlier_stage_first():
    assert transfer_priority(1, 8, "forward") < transfer_priority(5, 8, "forward")
    assert transfer_priority(5, 8, "backward") < transfer_priority(1, 8, "backward")


def test_python_m_topology_on_this_machine_prints_cpu_and_pipeline():
    r = subprocess.run([sys.executable, "-m", "topology"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "CPU workers" in r.stdout and "backend: pipeline" in r.stdout


def test_a_drive_is_named_from_sysfs_with_its_model_and_host_bridge(tmp_path):
    """The block device under a directory: a partition's disk, its model, the host bridge it sits
    under; a device sysfs does not know (an overlay file system) has no name."""
    import os

    from topology.probe import drive_name

    disk = tmp_path / "devices" / "pci0000:40" / "0000:40:01.1" / "0000:41:00.0" / "nvme" / "nvme0" / "nvme0n1"
    (disk / "nvme0n1p2").mkdir(parents=True)
    (disk / "nvme0n1p2" / "partition").write_text("2\n")
    (disk / "device").mkdir()
    (disk / "device" / "model").write_text("Samsung SSD 990 PRO 2TB          \n")
    (tmp_path / "dev" / "block").mkdir(parents=True)
    (tmp_path / "dev" / "block" / "259:2").symlink_to(disk / "nvme0n1p2")
    (tmp_path / "dev" / "block" / "259:0").symlink_to(disk)
    expected = "nvme0n1 (Samsung SSD 990 PRO 2TB) on pci0000:40"
    assert drive_name(os.makedev(259, 2), str(tmp_path)) == expected
    assert drive_name(os.makedev(259, 0), str(tmp_path)) == expected
    assert drive_name(os.makedev(0, 77), str(tmp_path)) is None
