"""``python -m mobius.rates``: the rates a plan is made from, measured here, one table, kept for
the next plan on this machine and written into a topology file for plans made elsewhere."""

import json
import statistics

import pytest

from mobius.partition.profile import analytic_efficiency
from mobius.rates import RATES, checked


@pytest.mark.slow
def test_the_rates_are_measured_once_printed_kept_for_the_next_plan_and_written(tmp_path, capsys):
    from mobius.models import PRESETS
    from mobius.planning.prepare import get_profile, this_host_key
    from mobius.rates import main
    from mobius.runtime.plan_check import HOST_RATES
    from topology import cpu_topology, load_topology_file

    args = ["--topology", "cpu", "--cpu-workers", "2", "--model", "tiny", "--micro-batch-size", "1", "--seq-len", "16",
            "--workers", "1,2"]
    keys = [this_host_key(w) for w in (1, 2)]
    (tmp_path / "nvme").mkdir()
    try:
        main(args + ["--write", str(tmp_path / "box.json"), "--drive", str(tmp_path / "nvme"), "--drive-gb", "0.01"])
        out = capsys.readouterr().out
        assert "measuring on this CPU" in out
        rows = {line.split("  ")[0]: line for line in out.splitlines()}
        assert {"host AdamW, 1 worker", "host AdamW, 2 workers at once", "tiny block fwd+bwd, CPU",
                "device AdamW, CPU"} <= set(rows), out
        (entry,) = [p for p in RATES.directory.glob("*.json")]
        rates = json.loads(entry.read_text())["payload"]
        two = statistics.median(rates["host_adam"]["2"])
        assert HOST_RATES.get(keys[1], lambda d: d["adam_params_per_s"]) == two  # what the next plan reads
        assert get_profile("tiny", PRESETS["tiny"], cpu_topology(2), 1, 16, "fp32").host.adam_params_per_s == two
        written = load_topology_file(tmp_path / "box.json")
        assert written.host_memory_bandwidth_gbps == pytest.approx(two * 28 * 2 / 1e9, rel=1e-3)
        (drive,) = written.drives  # timed through a file of its own, gone again
        assert drive.read_gbps > 0 and drive.write_gbps > 0 and f"under {tmp_path / 'nvme'}: read" in out
        assert f"drive 0, {drive.name}, under" in out  # named as sysfs names it (this VM: vda on pci0000:00)
        assert list((tmp_path / "nvme").iterdir()) == []

        capsys.readouterr()
        main(args)  # the second time, from the cache
        assert "measuring on" not in capsys.readouterr().out
    finally:
        for key in keys:
            HOST_RATES.path(key).unlink(missing_ok=True)


def test_a_cached_entry_must_hold_rates_only():
    good = {"host_adam": {"1": [1e9, 1.1e9]}, "devices": {"cpu": {"gemm_tflops": 0.1}}}
    assert checked(good) is good
    for bad in ({"host_adam": {"1": [-1.0]}, "devices": {"cpu": {"gemm_tflops": 0.1}}},
                {"host_adam": {"1": [float("nan")]}, "devices": {"cpu": {}}},
                {"host_adam": {"1": [True]}, "devices": {"cpu": {"gemm_tflops": 0.1}}},
                {"host_adam": {}, "devices": {}}):
        with pytest.raises(ValueError):
            checked(bad)


def test_a_block_measured_on_the_gpu_anchors_its_efficiency_curve(tmp_path):
    """The curve keeps its shape and passes through what ``mobius.rates`` measured; a topology file
    whose measurement is not one is refused in one line."""
    from mobius.boundary.errors import InputError
    from mobius.planning.prepare import block_efficiency
    from topology import load_preset

    assert analytic_efficiency("RTX 4090", 4096, (4096, 0.3)) == pytest.approx((0.3, "measured on this GPU at 4096 "
                                                                                 "tokens"))
    low, _ = analytic_efficiency("RTX 4090", 1024, (4096, 0.3))
    assert 0.1 < low < 0.3
    h100_at_4096 = analytic_efficiency("H100 80GB HBM3", 4096)[0]
    assert analytic_efficiency("H100 80GB HBM3", 4096, (4096, h100_at_4096 / 2))[0] == pytest.approx(h100_at_4096 / 2)
    box = load_preset("4x4090")
    box.gpus[0].extra["block_efficiency"] = {"tokens": 4096, "fraction": 0.3}
    assert block_efficiency(box, box.gpus[0]) == (4096, 0.3)
    for bad in ({"tokens": 0, "fraction": 0.3}, {"tokens": 4096, "fraction": 3.0}, [1, 2], {"tokens": "4096"}):
        box.gpus[0].extra["block_efficiency"] = bad
        with pytest.raises(InputError, match="block_efficiency must be"):
            block_efficiency(box, box.gpus[0])


def test_bad_options_are_one_line_and_exit_2(capsys):
    from mobius.rates import main

    for args, said in ((["--workers", "0"], "--workers counts must be between 1 and 256"),
                       (["--workers", "a,b"], "--workers must be comma-separated counts"),
                       (["--model", "tiny", "--seq-len", "100000"], "exceeds tiny's context"),
                       (["--drive", "/nonexistent/nvme"], "--drive /nonexistent/nvme is not a directory"),
                       (["--drive", "/", "--drive", "/"], "two --drive directories are on one file system")):
        with pytest.raises(SystemExit) as exit_:
            main(args + ["--topology", "cpu"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


def test_a_measured_device_adam_rate_plans_the_resident_stages(tmp_path):
    """``mobius.rates --write`` records each GPU's AdamW rate; an analytic profile for that topology
    uses it (the slowest GPU's) instead of the assumed one, and a value that is no rate is refused."""
    from mobius.boundary.errors import InputError
    from mobius.models import PRESETS
    from mobius.partition.profile import GPU_ADAM_PARAMS_PER_S, measure_device_adam_rate
    from mobius.planning.prepare import get_profile
    from topology import load_preset

    box = load_preset("4x4090")
    assert get_profile("tiny", PRESETS["tiny"], box, 1, 16, "bf16", "analytic").host.device_adam_params_per_s == \
        GPU_ADAM_PARAMS_PER_S
    for g, rate in zip(box.gpus, (3e10, 2e10, 3e10, 3e10)):
        g.extra["adam_params_per_s"] = rate
    assert get_profile("tiny", PRESETS["tiny"], box, 1, 16, "bf16", "analytic").host.device_adam_params_per_s == 2e10
    box.gpus[0].extra["adam_params_per_s"] = "fast"
    with pytest.raises(InputError, match="adam_params_per_s must be a positive number"):
        get_profile("tiny", PRESETS["tiny"], box, 1, 16, "bf16", "analytic")
    import torch

    assert measure_device_adam_rate(torch.device("cpu"), numel=2**16, repeats=1) > 0
