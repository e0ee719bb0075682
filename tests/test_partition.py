import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mobius.backends import resolve, resolve_for_plan
from mobius.boundary.errors import InputError
from mobius.models import get_config
from mobius.partition.baselines import BASELINES, balanced_bounds, uniform_bounds
from mobius.partition.cost import Machine, check_layers_fit, evaluate
from mobius.partition.exhaustive import exhaustive_optimum
from mobius.partition.mip import solve_partition
from mobius.partition.profile import LayerProfile, Profile, analytic_profile, measure_profile

GAP = 1e-3  # the MIP's default relative gap


def random_profile(rng: random.Random, n_layers: int) -> Profile:
    layers = []
    for i in range(n_layers):
        # Some runs of identical layers, some heterogeneous ones, as in real models.
        if layers and rng.random() < 0.4:
            prev = layers[-1]
            layers.append(LayerProfile(**{**prev.__dict__, "name": f"l{i}"}))
            continue
        layers.append(LayerProfile(
            f"l{i}", "x", i, fwd_s=rng.uniform(0.01, 0.05), bwd_s=rng.uniform(0.02, 0.1),
            param_bytes=int(rng.uniform(0.2, 1.0) * 1e9), out_bytes=int(rng.uniform(0.01, 0.3) * 1e9),
            fwd_work_bytes=int(rng.uniform(0.05, 0.2) * 1e9), bwd_work_bytes=int(rng.uniform(0.1, 0.4) * 1e9)))
    layers[-1].out_bytes = 0
    return Profile("random", 1, 1, "fp16", "synthetic", layers)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_mip_equals_exhaustive_optimum(seed):
    rng = random.Random(seed)
    n_layers = rng.randint(8, 13)
    n_gpus = rng.choice([1, 2, 4])
    profile = random_profile(rng, n_layers)
    memory = tuple(int(rng.uniform(2.6, 8.0) * 1e9) for _ in range(n_gpus))
    bandwidth = tuple(rng.uniform(5e9, 15e9) for _ in range(n_gpus))
    machine = Machine(bandwidth, memory)
    if seed % 2:  # what the runtime revealed: the MIP must encode it as evaluate does
        rc_of = [rng.randint(0, 1) for _ in range(n_gpus)]
        machine = Machine(bandwidth, memory, prefetch=rng.random() < 0.7, handoff_s=rng.uniform(0, 0.01),
                          micro_batch_s=rng.uniform(0, 0.01), stage_switch_s=rng.uniform(0, 0.05),
                          adam_params_per_s=rng.uniform(2e9, 2e10),
                          optimizer_lag=rng.randint(0, 1), link=tuple(b * 1.2 for b in bandwidth),
                          first_wave_peers=tuple(tuple(i for i in range(n_gpus) if rc_of[i] == rc_of[k])
                                                 for k in range(n_gpus)),
                          rc_bandwidth=tuple(rng.uniform(8e9, 20e9) for _ in range(n_gpus)),
                          **{f: tuple(b * rng.uniform(0.3, 1.0) for b in bandwidth)
                             for f in ("upload", "upload_backward", "d2h_forward", "d2h_backward")})
    micro_batches = rng.choice([1, 2, 4])
    # Without recomputation every micro-batch's activations stay until backward (the slot's memory
    # must hold them all), and the last layer holds its weight-gradient sum once (the LM head's).
    recompute = seed % 4 != 3
    if not recompute:
        profile.layers[-1].held_bytes = int(rng.uniform(0.1, 0.5) * 1e9)
        machine = replace(machine, memory=tuple(int(m * rng.uniform(1.5, 3.0)) for m in memory))
    best, _ = exhaustive_optimum(profile, machine, micro_batches, recompute)
    result = solve_partition(profile, machine, micro_batches, recompute, effort=10**6, gap=GAP)
    if best == float("inf"):  # no partition fits
        assert not result.bounds
        return
    assert result.status == "Optimal"
    assert result.objective_s == pytest.approx(best, rel=GAP)
    assert result.objective_s >= best * (1 - 1e-9)  # the exhaustive optimum is a true lower bound


@pytest.fixture
def public_pulp_only(monkeypatch):
    """The MIP built with a PuLP that has only the public API (tests/pulp_public_api.py)."""
    import pulp_public_api

    from mobius.partition import highs, mip

    monkeypatch.setattr(mip, "pulp", pulp_public_api)
    monkeypatch.setattr(highs, "pulp", pulp_public_api)


@pytest.mark.parametrize("seed", [0, 1, 3, 6, 11])
def test_the_mip_needs_only_pulps_public_api(seed, public_pulp_only):
    test_mip_equals_exhaustive_optimum(seed)


@pytest.mark.slow
def test_the_warm_start_reaches_highs_and_bounds_the_answer(public_pulp_only, monkeypatch):
    """The partition given as the warm start is handed to HiGHS (its integer variables, through
    ``setSolution``) and the answer is never worse than it."""
    import highspy

    from mobius.partition import highs
    from mobius.partition.mip import _integer_start

    starts = []

    class Recording(highspy.Highs):
        def setSolution(self, n, index, value):
            starts.append((n, list(index), list(value)))
            return super().setSolution(n, index, value)

    monkeypatch.setattr(highs.highspy, "Highs", Recording)
    profile = random_profile(random.Random(4), 12)
    machine = Machine((10e9,) * 2, (6e9,) * 2)
    worst = BASELINES["max"](profile, machine, 2)
    result = solve_partition(profile, machine, 2, effort=10**6, warm_start=worst)
    expected = _integer_start(worst, profile.runs(), profile.n)
    assert len(starts) == 1 and starts[0][0] == len(expected) and sorted(starts[0][2]) == sorted(expected.values())
    assert result.objective_s <= evaluate(profile, worst, machine, 2).step_s
    assert result.objective_s == pytest.approx(exhaustive_optimum(profile, machine, 2)[0], rel=GAP)


@pytest.mark.slow
def test_mip_never_worse_than_baselines_and_beats_max_stage():
    prof = analytic_profile("mobius-8b", get_config("mobius-8b"), 2, 512, 40.0)
    machine = Machine((13.1e9,) * 4, (24 * 10**9,) * 4)
    bounds = {k: f(prof, machine, 4) for k, f in BASELINES.items()}
    times = {k: evaluate(prof, b, machine, 4).step_s for k, b in bounds.items()}
    # As the planner does: the best baseline is HiGHS's first incumbent, so a solve stopped early
    # never returns worse.
    r = solve_partition(prof, machine, 4, warm_start=bounds[min(times, key=times.get)])
    assert r.objective_s <= min(times.values()) * (1 + 1e-9)
    assert r.objective_s < times["max"]


def test_balanced_bounds_minimise_the_largest_part():
    bounds = balanced_bounds([1, 1, 1, 5, 1, 1], 3)
    assert bounds == [(0, 3), (3, 4), (4, 6)]


@pytest.mark.slow
def test_layer_similarity_profiles_mobius_3b_with_three_layers(tmp_path):
    prof = measure_profile("mobius-3b", get_config("mobius-3b"), micro_batch=1, seq_len=8, repeats=1)
    assert prof.n == 66 and prof.distinct_measured == 3
    assert prof.runs() == [(0, 1), (1, 65), (65, 66)]
    assert prof.layers[1].param_bytes == 4 * (12 * 2048**2 + 2 * 2048)  # fp32, two LayerNorm weights
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof


def test_the_host_optimizer_rate_is_measured_with_each_workers_share_of_the_cores(monkeypatch):
    """Whatever computes the layers, AdamW runs on the host: its rate is measured, with the
    threads of one of ``host_workers`` workers (on GPUs, one process per GPU)."""
    import mobius.partition.profile as profile

    threads = []
    real = profile.measure_adam_rate

    def spy(workers, **kw):
        threads.append(workers)
        return real(workers, numel=2**16, repeats=1)

    monkeypatch.setattr(profile, "measure_adam_rate", spy)
    prof = measure_profile("tiny", get_config("tiny"), micro_batch=1, seq_len=8, repeats=1, workers=1, host_workers=4)
    assert threads == [4] and prof.host.adam_params_per_s > 0
    assert prof.host.adam_params_per_s != profile.ANALYTIC_ADAM_PARAMS_PER_S


def test_layer_too_big_for_the_gpu_names_layer_bytes_and_budget():
    prof = analytic_profile("mobius-51b", get_config("mobius-51b"), 1, 512, 40.0)
    with pytest.raises(InputError, match=r"layer layers\.0 \(embedding\) needs .* GB .* budget is 1.00 GB"):
        check_layers_fit(prof, Machine((13e9,), (10**9,)))


@pytest.mark.slow
def test_plan_command_rejects_bad_input_with_one_line():
    r = subprocess.run([sys.executable, "-m", "mobius.plan", "--model", "mobius-51b", "--topology", "topo4",
                        "--gpu-mem-gb", "1", "--no-cache"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "budget" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mobius.plan", "--model", "mobius-51b", "--topology", "topo4",
                        "--micro-batch-size", "1", "--seq-len", "512", "--json", "--no-cache", "--mip-effort", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json
    plan = json.loads(r.stdout)
    assert plan["bounds"][0][0] == 0 and plan["bounds"][-1][1] == 52 and plan["predicted_step_s"] > 0


def test_a_cached_profile_holds_still_until_what_it_was_measured_on_changes(tmp_path, monkeypatch, capsys):
    """A measured profile is used again however the machine's load varies (a busy moment must not
    become the plan), and measured again, saying so, when the machine or our code changed.  The
    runtime's own costs go with every measured profile; its per-micro-batch and per-switch work is
    measured once per machine (its measurement is tested in tests/test_calibrate.py)."""
    from mobius.planning import prepare
    from topology import cpu_topology

    calibrations, measured = [], []

    def calibrate(workers):
        calibrations.append(workers)
        return {"micro_batch_s": 1e-4, "stage_switch_s": 2e-4, "handoff_s": 3e-4}

    real_measure = prepare.measure_profile

    def measure(*args, **kwargs):
        measured.append(args[0])
        return real_measure(*args, **kwargs)

    monkeypatch.setattr("mobius.boundary.cache.CACHE_DIR", tmp_path)
    monkeypatch.setattr(prepare, "measure_runtime_costs", calibrate)
    monkeypatch.setattr(prepare, "measure_profile", measure)
    config, topo = get_config("tiny"), cpu_topology(2)
    first = prepare.get_profile("tiny", config, topo, 2, 32, "fp32")
    assert first.extra["workers"] == 2 and first.host.adam_params_per_s > 0
    assert (first.host.micro_batch_s, first.host.stage_switch_s) == (1e-4, 2e-4) and first.host.handoff_s >= 3e-4
    assert "profiling: measuring tiny's layers on this machine's cpu" in capsys.readouterr().out
    assert prepare.get_profile("tiny", config, topo, 2, 32, "fp32") == first and measured == ["tiny"]
    assert "profiling" not in capsys.readouterr().out
    here = prepare.measured_on()
    monkeypatch.setattr(prepare, "measured_on", lambda: {**here, "cpu": "another processor"})
    prepare.get_profile("tiny", config, topo, 2, 32, "fp32")
    assert measured == ["tiny", "tiny"] and calibrations == [2, 2]
    assert "profiling: measuring tiny's layers" in capsys.readouterr().out


def test_gpus_are_budgeted_without_the_cuda_reserve_once():
    """What the CUDA context and libraries take is kept out of every GPU's budget, once however
    often the topology is resolved (mobius.plan and mobius.train on GPUs both reserve)."""
    from mobius.planning.prepare import reserve_cuda_memory
    from mobius.runtime.device import CUDA_RESERVE_BYTES
    from topology.presets import load_preset

    topo = load_preset("8x3090-4+4")
    card = [g.memory_gb for g in topo.gpus]
    reserved = reserve_cuda_memory(topo)
    assert reserve_cuda_memory(reserved) is reserved  # taken once
    assert [g.memory_gb for g in reserved.gpus] == pytest.approx([c - CUDA_RESERVE_BYTES / 1e9 for c in card])
    assert [g.memory_gb for g in topo.gpus] == card  # the topology it was given is left as it was


def test_every_worker_gets_a_stage_even_where_one_stage_would_be_fastest(tmp_path, monkeypatch):
    """With hand-offs that cost more than the layers (a tiny model on CPU workers), one stage would
    be the fastest partition; a pipeline of two workers still gets two stages or more."""
    from dataclasses import replace

    from mobius.planning import planner
    from topology import cpu_topology

    monkeypatch.setattr("mobius.boundary.cache.CACHE_DIR", tmp_path)
    config, topo = get_config("tiny"), cpu_topology(2)
    profile = analytic_profile("tiny", config, 2, 16, 0.05, "fp32")
    profile.host = replace(profile.host, handoff_s=10.0, micro_batch_s=1.0)
    one = Machine((5e9,), (10**9,), handoff_s=10.0, micro_batch_s=1.0)
    one_stage, two_stages = (evaluate(profile, b, one, 2).step_s for b in ([(0, profile.n)],
                                                                           uniform_bounds(profile.n, 2)))
    assert one_stage < two_stages
    plan = planner.make_plan("tiny", config, topo, 2, 2, 16, "fp32", profile=profile)
    assert len(plan.bounds) >= 2 and plan.partitioner == "mip"
    # Every stage but the head's recomputes: the header says how much of the compute floor that is.
    assert plan.recomputation_s == pytest.approx(2 * sum(la.fwd_s for la in profile.layers[:plan.bounds[-1][0]]) / 2)
    assert f"of which recomputation {plan.recomputation_s:.3g} s" in plan.bound_summary()
    # Bound by the host's AdamW: the lag is suggested only to a plan without it.
    from mobius.runtime.spec import Lane

    for lag, suggested in ((0, True), (1, False)):
        host_bound = replace(plan, optimizer_lag=lag, lane_floor_s={Lane.HOST_ADAM: 9.0, Lane.COMPUTE: 1.0})
        assert ("--optimizer-lag 1" in host_bound.bound_summary()) is suggested
        assert host_bound.bound_summary().endswith("more tokens per step amortise it")
    machine = Machine((5e9, 5e9), (10**9, 10**9), handoff_s=10.0, micro_batch_s=1.0)
    assert len(exhaustive_optimum(profile, machine, 2)[1]) == 2


def test_host_traffic_and_the_first_principles_floor_by_hand():
    """Two 1-layer stages on one slot: loads 2 x S (forward) + S (the first again for backward),
    one boundary's activation and its gradient down and up for each micro-batch (plus the input
    again when recomputing), the gradients down; each lane's floor is its work over its capacity."""
    from mobius.partition.cost import StageCost, host_traffic_bytes, recomputation_s, step_bounds

    a, s, g = 100, 1000, 4000  # boundary activation, stage bytes, gradient bytes (fp32: 1000 params)
    stages = [StageCost(0, 1, s, 1.0, 2.0, a, 0, 0, 0, g), StageCost(1, 2, s, 1.0, 2.0, 0, a, 0, 0, g)]
    assert host_traffic_bytes(stages, 3, 1) == 3 * s + 3 * (2 * a + 2 * a) + 2 * g
    # Recomputing, the first stage's input (the tokens: none) goes up again; the head never recomputes.
    recomputed = [replace(stages[0], recomputed=True), stages[1]]
    assert host_traffic_bytes(recomputed, 3, 1) == host_traffic_bytes(stages, 3, 1)
    three = [stages[0], replace(stages[1], out_bytes=a, recomputed=True), replace(stages[1], start=2, end=3)]
    assert host_traffic_bytes(three, 3, 1) == 5 * s + 3 * (4 * a + 4 * a + a) + 3 * g
    floor = step_bounds(stages, 3, 1, pcie_bps=100.0, adam_params_per_s=500.0, element_bytes=4)
    assert floor == {"compute": 3 * (3.0 + 3.0), "PCIe": (3 * s + 12 * a + 2 * g) / 100.0, "host AdamW": 2000 / 500.0}
    # The first stage recomputing: its forward again, three micro-batches over two GPUs.
    assert recomputation_s(stages, 3, 2) == 0.0 and recomputation_s(recomputed, 3, 2) == 3 * 1.0 / 2


def test_within_one_percent_the_plan_moving_fewest_bytes_wins():
    from mobius.planning.planner import _least_traffic_among_fastest

    prof = analytic_profile("tiny", get_config("tiny"), 2, 32, 1.0, "fp32")
    many, few = uniform_bounds(prof.n, 6), uniform_bounds(prof.n, 2)
    found = {"mip": many, "max": few}
    assert _least_traffic_among_fastest(found, {"mip": 1.000, "max": 1.009}, prof, 4, 2, True) == (few, "max")
    assert _least_traffic_among_fastest(found, {"mip": 1.000, "max": 1.02}, prof, 4, 2, True) == (many, "mip")


def test_presets_carry_tensor_core_peaks_and_the_host_bandwidth_sets_the_adam_rate(tmp_path):
    from mobius.partition.profile import ADAM_BYTES_PER_PARAM, analytic_efficiency, host_adam_rate
    from mobius.planning.prepare import get_profile
    from mobius.runtime.optim import HostUpdatePath
    from topology import load_preset, load_topology_file

    assert load_preset("4x4090").gpus[0].tflops == 165.2 and load_preset("8x3090-4+4").gpus[0].tflops == 80.0
    box = load_preset("4x4090")
    assert box.host_memory_bandwidth_gbps == 154.0
    prof = get_profile("tiny", get_config("tiny"), box, 2, 32, "bf16", "analytic", path=HostUpdatePath(False, False))
    # the host's bandwidth over AdamW's 28 bytes a parameter, and in bf16 converted ahead and
    # refreshed after, the conversions' 12 more
    assert prof.host.adam_params_per_s == pytest.approx(154e9 / (ADAM_BYTES_PER_PARAM + 12) / 4)
    assert host_adam_rate(None, 4) == 1e9  # unknown bandwidth: the assumed rate
    # the H100's measured points: plain PyTorch at 1,024 tokens a micro-batch (its AdamW taken out), the
    # pipeline's layers at 4,096
    assert analytic_efficiency("NVIDIA H100 80GB HBM3", 1024) == pytest.approx((0.199, "measured on H100"), abs=1e-3)
    assert analytic_efficiency("NVIDIA H100 80GB HBM3", 4096)[0] == pytest.approx(0.41, abs=1e-3)
    assert analytic_efficiency("RTX 4090", 4096) == (0.5, "assumed")
    box.save(tmp_path / "box.json")
    assert load_topology_file(tmp_path / "box.json").host_memory_bandwidth_gbps == 154.0


def test_a_tampered_cache_entry_is_named_set_aside_and_rebuilt(tmp_path, monkeypatch, capsys):
    """Whatever an entry of the plan or calibration cache holds (an edited plan that puts a layer in
    two stages with its digest recomputed, bytes changed under the digest, JSON nested a million deep,
    a NaN cost), it is never used: one line names it, it is set aside, and it is made again."""
    import json
    from pathlib import Path

    from mobius.boundary.cache import _digest
    from mobius.planning import planner
    from topology import cpu_topology

    monkeypatch.setattr("mobius.boundary.cache.CACHE_DIR", tmp_path)
    config, topo = get_config("tiny"), cpu_topology(2)
    profile = analytic_profile("tiny", config, 2, 16, 0.05, "fp32")
    plan = planner.make_plan("tiny", config, topo, 2, 2, 16, "fp32", profile=profile)
    (entry,) = (tmp_path / "plans").glob("*.json")
    payload = json.loads(entry.read_text())["payload"]
    assert payload["bounds"] == [list(b) for b in plan.bounds] and len(plan.bounds) >= 2
    overlapping = dict(payload, bounds=[[0, plan.bounds[0][1] + 1]] + [list(b) for b in plan.bounds[1:]])
    tampered = {"do not cover layers": json.dumps({"sha256": _digest(overlapping), "payload": overlapping}),
                "does not match its digest": entry.read_text().replace('"recompute": true', '"recompute": false'),
                "nested too deeply": "[" * 10**6 + "]" * 10**6}
    for reason, text in tampered.items():
        entry.write_text(text)
        capsys.readouterr()
        again = planner.make_plan("tiny", config, topo, 2, 2, 16, "fp32", profile=profile)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert (again.bounds, again.predicted_step_s) == (plan.bounds, plan.predicted_step_s)
        assert line.startswith(f"note: cached plan {entry} is not usable (") and reason in line and line.endswith(
            f"; set aside as {entry}.bad, rebuilding it"), line
        assert Path(f"{entry}.bad").read_text() == text
        assert json.loads(entry.read_text())["payload"]["bounds"] == payload["bounds"]  # made again

    from mobius.planning import prepare

    monkeypatch.setattr(prepare, "measure_runtime_costs", lambda workers: {"micro_batch_s": 1e-4,
                                                                            "stage_switch_s": 2e-4, "handoff_s": 3e-4})
    prepare.runtime_costs(profile, "cpu", 2)
    (calibration,) = (tmp_path / "runtime").glob("*.json")
    prepare.RUNTIME_COSTS.put(calibration.stem, {"micro_batch_s": float("nan"), "stage_switch_s": 1e300,
                                                  "handoff_s": -1})
    costs = prepare.runtime_costs(profile, "cpu", 2)
    assert costs["micro_batch_s"] == 1e-4
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("note: cached runtime calibration ") and "(micro_batch_s is nan, not a time)" in line

    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("the user's")
    monkeypatch.setattr("mobius.boundary.cache.CACHE_DIR", not_a_directory)
    assert planner.make_plan("tiny", config, topo, 2, 2, 16, "fp32", profile=profile).bounds == plan.bounds
    assert capsys.readouterr().err.strip().splitlines() == [
        f"note: cannot write the plans cache under {not_a_directory} (Not a directory); going on without it"]
    assert not_a_directory.read_text() == "the user's"


def test_mobius_plan_prints_the_plan_mobius_train_runs(capsys):
    """One planning surface: every option that changes the plan in mobius.train (here
    --optimizer-lag and LoRA) is an option of mobius.plan, planned through the same call."""
    import json

    from mobius.config import parse_train_args
    from mobius.plan import main as plan_main
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.runtime.inputs import check_model_input

    options = ["--model", "tiny", "--topology", "cpu", "--seq-len", "32", "--optimizer-lag", "1", "--lora-rank", "8"]
    plan_main(options + ["--json"])
    printed = json.loads(capsys.readouterr().out)
    cfg = parse_train_args(options + ["--backend", "pipeline"])
    _, trained = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    assert (printed["bounds"], printed["predicted_step_s"], printed["recompute"]) == ([list(b) for b in trained.bounds],
                                                                trained.predicted_step_s, trained.recompute)
    plan_main(options[:-4] + ["--json"])  # without the lag and the adapters: another plan
    assert json.loads(capsys.readouterr().out)["predicted_step_s"] != printed["predicted_step_s"]
    # With --json, standard output is the JSON alone, whatever probing the machine says on the way.
    plan_main(["--model", "tiny", "--topology", "auto", "--seq-len", "32", "--json"])
    assert json.loads(capsys.readouterr().out)["model"] == "tiny"


def test_a_cached_profile_is_checked_for_range_not_for_positivity():
    """A frozen layer's backward measures zero (LoRA's embedding): such a profile is used again, or
    plans would move every run; a negative, NaN or absurd time, or a fractional size, is not."""
    profile = analytic_profile("tiny", get_config("tiny"), 2, 16, 0.05, "fp32")
    profile.layers[0].bwd_s = 0.0
    assert profile.checked(profile.n) is profile
    for key, bad in (("bwd_s", -1.0), ("fwd_s", float("nan")), ("fwd_s", 1e300), ("out_bytes", 2.5)):
        broken = Profile.from_dict(profile.to_dict())
        setattr(broken.layers[1], key, bad)
        with pytest.raises(ValueError, match=f"layers.1: {key} is"):
            broken.checked(broken.n)
    with pytest.raises(ValueError, match="it has 6 layers, the model 7"):
        profile.checked(7)


@pytest.mark.slow
@pytest.mark.parametrize("per_root_complex,setting", [(2, ["--host-adam-gbps", "5"]), (3, ["--gpu-mem-gb", "8"]),
                                                      (4, ["--gpu-mem-gb", "8"])])
def test_the_mip_plan_is_never_slower_than_a_baselines(tmp_path, per_root_complex, setting):
    """On boxes of two root complexes with 2, 3 and 4 GPUs each, with a slow host or little GPU
    memory (where the MIP's own answer, chosen before resident stages and its own mapping, lost to
    min, balanced or uniform by up to 1.6x): --partitioner mip plans no slower than any of them,
    each timed as the plan --partitioner would make of it."""
    from mobius.config import parse_train_args
    from mobius.planning.pipeline import run_plan
    from mobius.runtime.inputs import check_model_input

    box = json.loads((Path(__file__).parents[1] / "topology" / "presets" / "topo2+2.json").read_text())
    gpu = box["gpus"][0]
    box["gpus"] = [dict(gpu, index=i, root_complex=i // per_root_complex) for i in range(2 * per_root_complex)]
    path = tmp_path / "box.json"
    path.write_text(json.dumps(box))

    def plan(partitioner):
        cfg = parse_train_args(["--model", "mobius-3b", "--topology", str(path), "--partitioner", partitioner,
                                "--recompute", "off", *setting])
        return run_plan(resolve_for_plan(cfg), check_model_input(cfg), effort=4, use_cache=False,
                       with_baselines=True)

    mip = plan("mip")
    assert {"min", "balanced", "uniform"} <= set(mip.baselines)
    # (by the cost model, which the search compares plans by; the step a plan states is its simulation)
    assert mip.modelled_step_s <= min(mip.baselines.values()) * (1 + 1e-9), mip.baselines
    assert plan("balanced").modelled_step_s == pytest.approx(mip.baselines["balanced"], rel=1e-9)


def test_the_host_update_is_charged_at_what_it_moves():
    """In 16 bits a host update that converts each gradient to fp32 and refreshes the 16-bit copy
    in AdamW's pass moves AdamW's 28 bytes a parameter; converted ahead 36, and refreshed after too
    (replicas) 40; fp32 converts nothing.  A plan's profile charges its run's path."""
    from mobius.config import RunConfig
    from mobius.partition.profile import host_update_rate
    from mobius.planning.pipeline import update_path
    from mobius.planning.prepare import get_profile, resolve_topology
    from mobius.runtime.optim import HostUpdatePath

    one_pass, ahead, replicated = HostUpdatePath(True, True), HostUpdatePath(False, True), HostUpdatePath(False, False)
    assert host_update_rate(1e9, "fp32", replicated) == host_update_rate(1e9, "bf16", one_pass) == 1e9
    assert host_update_rate(1e9, "bf16", ahead) == pytest.approx(1e9 * 28 / 36, rel=1e-12)
    assert host_update_rate(1e9, "bf16", replicated) == pytest.approx(0.7e9, rel=1e-12)
    topo = resolve_topology(RunConfig.of(topology="4x4090"))

    def rate(precision: str, **kw) -> float:
        path = update_path(RunConfig.of(topology="4x4090", **kw), precision, kw.get("data_parallel", 1))
        return get_profile("small", get_config("small"), topo, 1, 128, precision, "analytic",
                           path=path).host.adam_params_per_s
    one = rate("bf16")
    assert one == rate("fp32")
    # clipping's norm read in the pass's staging with the lag; before the decision, the squares in
    # fp32 first (fp16: unscaled in place before that too)
    assert rate("bf16", max_grad_norm=1.0, optimizer_lag=1) == pytest.approx(one * 28 / 30, rel=1e-12)
    assert rate("bf16", max_grad_norm=1.0) == pytest.approx(one * 28 / 40, rel=1e-12)
    assert rate("fp16") == pytest.approx(one * 28 / 48, rel=1e-12)
    # and a split piece's update (the dispatched head's parts) at what its path moves for them
    fp16_lagged = get_profile("small", get_config("small"), topo, 1, 128, "fp16", "analytic",
                              path=update_path(RunConfig.of(topology="4x4090", optimizer_lag=1), "fp16", 1)).host
    assert [fp16_lagged.split_update_factor(parts) for parts in (1, 4)] == pytest.approx([1.0, (40 + 3 * 10) / 30])


@pytest.mark.slow
def test_a_solve_stops_at_its_effort():
    """HiGHS is interrupted at its ``effort``-th limit check, and says so; a larger effort never
    answers worse from the same incumbent."""
    prof = analytic_profile("mobius-8b", get_config("mobius-8b"), 2, 512, 40.0)
    machine = Machine((13.1e9,) * 4, (24 * 10**9,) * 4)
    start = balanced_bounds([l.fwd_s + l.bwd_s for l in prof.layers], 8)
    one = solve_partition(prof, machine, 4, effort=1, warm_start=start)
    assert one.status == "Effort limit reached (1: 1 limit checks, 0 nodes)"
    more = solve_partition(prof, machine, 4, effort=5, warm_start=start)
    assert more.objective_s <= one.objective_s * (1 + 1e-9)


def test_the_search_nodes_count_toward_the_effort(monkeypatch):
    """Past the root HiGHS checks its limits only between batches of nodes: the nodes count toward
    the effort, so a solve whose nodes are made dear stops at the first check after its first node,
    where the same solve otherwise runs on to the optimum."""
    import pulp

    from mobius.partition import highs

    rnd = random.Random(1)
    prob = pulp.LpProblem("knapsack", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{i}", cat="Binary") for i in range(60)]
    for _ in range(3):
        w = [rnd.randint(1000, 2000) for _ in x]
        prob += pulp.lpSum(a * b for a, b in zip(w, x)) <= sum(w) // 2
    prob += -pulp.lpSum(rnd.randint(1000, 2000) * b for b in x)
    whole = highs.solve(prob, {}, 10**6, 0.0, 60.0)
    assert whole.status == "Optimal" and whole.nodes > 1
    monkeypatch.setattr(highs, "NODES_PER_CHECK", 1e-9)
    cut = highs.solve(prob, {}, 10**6, 0.0, 60.0)
    assert cut.status.startswith("Effort limit reached") and 1 <= cut.nodes < whole.nodes
    assert cut.checks <= whole.checks


@pytest.mark.slow
def test_one_command_gives_one_plan_on_a_quiet_or_a_busy_machine():
    """The MIP stops at a count of its own progress, not at seconds: the same plan (the disk-tier
    case whose stage count once changed with the machine's load) with both cores kept busy."""
    from mobius.config import RunConfig
    from mobius.planning.pipeline import run_plan
    from mobius.planning.planner import host_bytes_needed

    config = get_config("small")
    cfg = RunConfig.of(model="small", topology="4x4090", micro_batch_size=1, micro_batches=8, seq_len=256,
                       precision="bf16", progress=False, device_optimizer="off", offload_dir="unused",
                       drive_gbps=("2",), host_mem_gb=host_bytes_needed(config, "bf16") / 1e9 * 0.75)

    def planned() -> dict:
        plan = run_plan(resolve_for_plan(cfg), config, use_cache=False).to_dict()
        plan["solver"].pop("solve_s")  # (how long it took is the one thing the load may change)
        return plan

    quiet = planned()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = planned()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert quiet["solver"]["status"].startswith("Effort limit reached") or quiet["solver"]["status"] == "Optimal"
    assert json.dumps(busy, sort_keys=True) == json.dumps(quiet, sort_keys=True)


@pytest.mark.slow
def test_a_plan_of_swapping_stages_is_never_below_its_pcie_floor(tmp_path):
    """Qwen3-235B-A22B's layers (48 of its 94) under LoRA on 8x4090-4+4: every stage that does not
    fit swaps its experts each step, and the root complexes' links are saturated.  The step is
    predicted at or above the PCIe floor it prints (it once came out at 0.85x: each link's duty
    was taken at its own link's speed, as if it had its root complex to itself)."""
    from published_models import CONFIGS

    from mobius.config import RunConfig
    from mobius.planning.pipeline import run_plan
    from mobius.runtime.inputs import model_config_for
    from mobius.runtime.spec import Lane

    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["Qwen3-235B-A22B"], "num_hidden_layers": 48}))
    cfg = RunConfig.of(model=str(tmp_path), topology="8x4090-4+4", micro_batch_size=1, micro_batches=4, seq_len=2048,
                       lora_rank=16, progress=False)
    plan = run_plan(resolve_for_plan(cfg), model_config_for(cfg), profile_how="analytic", effort=4,
                   use_cache=False)
    assert max(plan.lane_floor_s, key=plan.lane_floor_s.get) is Lane.PCIE
    assert plan.predicted_step_s >= plan.lane_floor_s[Lane.PCIE]
