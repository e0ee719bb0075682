"""A run compares its first steps with its plan, names a lane that is off, and keeps the host's
measured AdamW rate for the next plan on this machine."""

import dataclasses

import pytest

from mobius.backends import resolve
from mobius.metrics import StepMetrics
from mobius.runtime.plan_check import MIN_PARAMS_KEPT, PlanCheck, predicted_compute_s
from mobius.runtime.spec import Plan, StagePlan, StepPrediction


def plan_of(params_per_worker: int, rate: float, step_s: float = 1.0) -> Plan:
    """Two workers, two stages each, one of worker 0's stages resident (updated on its GPU)."""
    stages = [StagePlan(j, (j, j + 1), j % 2, 0, 1.0, 1.0, 0, 0, 0, 0, grad_bytes=4 * params_per_worker // 2)
              for j in range(4)]
    return Plan(model="m", topology="t", micro_batch_size=1, micro_batches=1, seq_len=1, precision="fp32",
                recompute=False, partitioner="mip", bounds=[(j, j + 1) for j in range(4)], order=[0, 1], contention=0.0,
                predicted_step_s=step_s, stages=stages, resident=[0], host_costs={"adam_params_per_s": rate})


def steps(adam_s: float, rate: float, step_s: float = 1.0, n: int = 4,
          compute_s: float | None = None) -> list[StepMetrics]:
    return [StepMetrics(step=k, loss=1.0, lr=1.0, tokens=1, step_time_s=step_s, host_adam_s=adam_s,
                        host_adam_params_per_s=rate, compute_s=compute_s) for k in range(n)]


def test_the_busiest_workers_swapping_stages_make_the_host_lane():
    plan = plan_of(8 * 10**6, rate=1e9)
    assert plan.host_adam_s() == pytest.approx(8e-3)  # worker 1: both stages; worker 0: one resident


def test_a_lane_off_by_more_than_a_fifth_is_named_once_and_its_rate_kept():
    kept = []
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)  # predicted: 4 * 2**22 / 1e8 = 0.168 s
    check = PlanCheck(plan, kept.append)
    history = steps(adam_s=0.042, rate=4e8)
    assert check.after(history[:3]) == []  # the warm-up step and two: not yet
    lines = check.after(history)
    assert lines == ["plan check: host AdamW 41.94 ms measured, 0.17 s predicted (400 M parameters/s measured, "
                     "100 M planned); the next plan for this host uses the measured rate"]
    assert kept == [4e8]
    assert check.after(history + steps(0.042, 4e8)) == []  # once per run


def test_under_the_lag_the_host_lane_is_its_parameters_at_the_measured_rate_not_a_steps_window():
    """With ``--optimizer-lag 1`` a step's updates run during the next one, so a step's window
    holds a varying number of a worker's updates (here one and a half, three, one, three): at the
    planned rate nothing is off, and at four times it the lane is a quarter of the prediction."""
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)  # predicted: 0.168 s, two updates of 0.084 s
    windows = [0.126, 0.252, 0.084, 0.252]

    def history(rate):
        return [StepMetrics(step=k, loss=1.0, lr=1.0, tokens=1, step_time_s=1.0, host_adam_s=s * 1e8 / rate,
                            host_adam_params_per_s=rate) for k, s in enumerate(windows)]

    assert PlanCheck(plan, lambda r: None).after(history(1e8)) == []
    (line,) = PlanCheck(plan, lambda r: None).after(history(4e8))
    assert line.startswith("plan check: host AdamW 41.94 ms measured, 0.17 s predicted (400 M parameters/s")


def test_within_a_fifth_nothing_is_said_and_small_updates_keep_no_rate():
    kept = []
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)
    assert PlanCheck(plan, kept.append).after(steps(adam_s=0.16, rate=1.05e8, step_s=1.1)) == []
    small = plan_of(1000, rate=1e8)  # a tiny model: the calls' fixed costs, not the bytes
    (line,) = PlanCheck(small, kept.append).after(steps(adam_s=1e-3, rate=1e6))
    assert line.endswith("too few parameters a step to take it for the host's rate") and kept == []
    (line,) = PlanCheck(plan, kept.append).after(steps(adam_s=0.16, rate=1e8, step_s=2.0))
    assert line == "plan check: step 2.00 s measured, 1.00 s predicted (2.00x)" and kept == []
    # A plan is of the steps that do not clip: measured steps that did are named.
    clipping = [dataclasses.replace(m, grad_norm=norm) for m, norm in zip(steps(0.16, 1e8, 2.0), (5, 5, 0.5, 5))]
    (line,) = PlanCheck(plan, kept.append, max_grad_norm=1.0).after(clipping)
    assert line.endswith("(2.00x); 2 of those 3 steps clipped (the plan is of steps that do not: one that clips "
                         "waits for its norm or redoes its updates)")


def test_where_updates_start_before_the_norm_each_step_is_checked_against_its_own_prediction():
    """A plan whose host updates start before clipping's norm states the step that clips (its updates
    taken back and redone) and the step after it (waiting for its norm).  The check predicts each measured step by whether it and the one before
    clipped, and compares the medians."""
    plan = dataclasses.replace(plan_of(MIN_PARAMS_KEPT * 4, rate=1e8), waiting_step_s=1.5, clipped_step_s=1.668)
    assert [plan.steps().step_of(now, before) for now, before in ((False, False), (True, False), (False, True), (True, True))] \
        == [1.0, 1.668, 1.5, 1.5]
    assert plan.steps().clipping_text() == ("the updates start before the step's norm; predicted, a step that clips 1668.0 ms "
                                    "(its updates redone), the step after it 1500.0 ms (waiting for its norm)")
    assert "\nclipping: the updates start" in plan.render()

    def run(norms, step_s):
        return [dataclasses.replace(m, grad_norm=n, step_time_s=s)
                for m, n, s in zip(steps(0.168, 1e8, n=4), norms, step_s)]

    # The warm-up step clipped: the first measured step waits (1.5), the second clips (1.668), the
    # third waits (1.5): predicted median 1.5, as measured; nothing is said.
    assert PlanCheck(plan, lambda r: None, max_grad_norm=1.0).after(run((5, 0.5, 5, 0.5), (9, 1.5, 1.7, 1.5))) == []
    # Measured at the plan's step of steps that keep their updates, 1.0: a third faster than these steps.
    (line,) = PlanCheck(plan, lambda r: None, max_grad_norm=1.0).after(run((5, 0.5, 5, 0.5), (9, 1.0, 1.0, 1.0)))
    assert line == ("plan check: step 1.00 s measured, 1.50 s predicted (0.67x); 1 of those 3 steps clipped "
                    "(predicted as steps that redo their updates, and the steps after them as waiting for their norm)")
    # Where none clipped the plan's own step is the prediction (and a dispatched run's is its own).
    assert PlanCheck(plan, lambda r: None, max_grad_norm=1.0).after(run((0.5,) * 4, (9, 1.0, 1.0, 1.0))) == []
    assert PlanCheck(plan, lambda r: None, predicted=StepPrediction(1.0), max_grad_norm=1.0).after(
        run((5, 0.5, 5, 0.5), (9, 1.0, 1.0, 1.0))) == []


def test_a_pipeline_run_is_checked_against_the_prediction_of_the_schedule_that_runs():
    """The run's check (:meth:`PlanCheck.of` its spec's pipeline setup): where the bound plan runs,
    against the plan's predictions of steps that clip and of those after them; where the dispatched
    schedule runs, against its own step."""
    from mobius.runtime.spec import DispatchedShape, PipelineSetup

    plan = dataclasses.replace(plan_of(MIN_PARAMS_KEPT * 4, rate=1e8), waiting_step_s=1.5, clipped_step_s=1.668)
    clipping = [dataclasses.replace(m, grad_norm=n, step_time_s=t)
                for m, n, t in zip(steps(0.168, 1e8, n=4), (5, 0.5, 5, 0.5), (9, 1.5, 1.7, 1.5))]
    assert PlanCheck.of(PipelineSetup(plan), lambda r: None, 1.0).after(clipping) == []
    # The same steps measured against the plan's step alone (1.0 s) are off, as they were before the
    # run's check was made from its setup.
    assert PlanCheck(plan, lambda r: None, predicted=StepPrediction(plan.predicted_step_s), max_grad_norm=1.0).after(
        clipping)
    shape = DispatchedShape([(0, 2), (2, 4)], [(0, 2), (2, 4)], [0, 1])
    (line,) = PlanCheck.of(PipelineSetup(plan, dispatched=shape, dispatched_steps=StepPrediction(0.75)), lambda r: None, 1.0
                           ).after(clipping)
    assert line.startswith("plan check: step 1.50 s measured, 0.75 s predicted (2.00x); 1 of those 3 steps clipped")


@pytest.mark.slow
def test_a_run_planned_on_a_stale_rate_names_the_lane_and_the_next_plan_uses_what_it_measured(tmp_path, capfd):
    """A host AdamW rate a tenth of this machine's is in the cache (measured while the machine was
    busy, say): the plan uses it, the run says its host AdamW lane is off after four steps and
    keeps what it measured, and the next plan is made with that rate."""
    from mobius.config import parse_train_args
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.planning.prepare import get_profile, measured_on, resolve_topology
    from mobius.runtime.inputs import check_model_input
    from mobius.runtime.plan_check import HOST_RATES, host_rate_key
    from mobius.train import main

    args = ["--model", "small", "--topology", "cpu", "--cpu-workers", "2", "--device-optimizer", "off",
            "--seq-len", "64", "--micro-batch-size", "2", "--steps", "5", "--no-progress"]
    cfg = parse_train_args(args)
    topo, model = resolve_topology(cfg), check_model_input(cfg)
    timed = get_profile(cfg.model, model, topo, 2, 64, "fp32").host.adam_params_per_s
    key = host_rate_key(measured_on(), 2)
    HOST_RATES.put(key, {"adam_params_per_s": timed / 10})
    assert prepare_pipeline(resolve(cfg, topo, "pipeline"), model)[1].host_costs["adam_params_per_s"] == timed / 10
    capfd.readouterr()

    main(args)
    out = capfd.readouterr().out  # the workers print it
    assert any(line.startswith("plan check: host AdamW") and line.endswith("uses the measured rate")
               for line in out.splitlines()), out
    measured = HOST_RATES.get(key, lambda d: d["adam_params_per_s"])
    assert measured != timed / 10
    assert prepare_pipeline(resolve(cfg, topo, "pipeline"), model)[1].host_costs["adam_params_per_s"] == measured


SLOW_BOX = {"name": "slowbox", "description": "two slow GPUs under one root complex: a box a CPU emulates quickly",
            "host": {"memory_gb": 64}, "root_complexes": [{"id": 0, "host_bandwidth_gbps": 1.0}],
            "gpus": [{"index": i, "name": "slow", "memory_gb": 1, "tflops": 0.05, "root_complex": 0,
                      "link_bandwidth_gbps": 1.0} for i in range(2)],
            "nvlink": [], "p2p": False}


@pytest.mark.slow
def test_an_emulated_host_4x_faster_than_planned_is_named_and_replan_switches_with_the_straight_runs_losses(
        tmp_path, capfd):
    """The emulated box's host updates at the rate its topology states (--host-adam-gbps); the
    cache holds a quarter of it (a stale measurement), so the plan is made for a slower host.  The
    run names the host AdamW lane after its fourth step and keeps what it measured; --replan auto
    plans again with it and switches plans mid-run; a run planned with the measured rate from the
    start (the next plan) is another plan, and its losses are the switched run's, bit for bit."""
    import json
    import re

    from mobius.config import parse_train_args
    from mobius.planning.prepare import host_key, resolve_topology
    from mobius.runtime.plan_check import HOST_RATES
    from mobius.train import main

    box = tmp_path / "box.json"
    box.write_text(json.dumps(SLOW_BOX))
    common = ["--model", "tiny8", "--topology", str(box), "--emulate", "--seq-len", "64", "--micro-batch-size", "2",
              "--micro-batches", "4", "--host-adam-gbps", "0.8", "--gpu-mem-gb", "0.004", "--precision", "fp32",
              "--steps", "150", "--no-progress"]
    key = host_key(resolve_topology(parse_train_args(common)), measured=False)
    true_rate = 0.8e9 / 28 / 2  # one of two workers' optimizer threads on the stated host
    HOST_RATES.put(key, {"adam_params_per_s": true_rate / 4})
    try:
        # (the switch pays over the steps left: 13 ms an emulated step saved over 46, against the
        # 0.07 s a start takes, emulated, on a quiet machine)
        main(common + ["--replan", "auto", "--stop-after", "50", "--metrics", str(tmp_path / "switched.jsonl")])
        out = capfd.readouterr().out.splitlines()
        measured = HOST_RATES.get(key, lambda d: d["adam_params_per_s"])
        main(common + ["--stop-after", "12", "--metrics", str(tmp_path / "straight.jsonl")])
        straight_out = capfd.readouterr().out.splitlines()
    finally:
        HOST_RATES.path(key).unlink(missing_ok=True)
    checks = [line for line in out if line.startswith("plan check: host AdamW")]
    assert len(checks) == 1 and "4 M planned" in checks[0], out
    assert measured == pytest.approx(true_rate, rel=0.2)
    (replan,) = [line for line in out if line.startswith("replan:")]
    assert replan.endswith("; switching"), out
    (switched,) = [line for line in out if line.startswith("switched plans after step 4: ")]
    headers = [line for line in out + straight_out if line.startswith("mobius: backend pipeline")]
    assert len(headers) == 2
    first_plan, next_plan = (re.search(r"(\d+) stages", h).group(1) for h in headers)
    assert first_plan != next_plan and f"after step 4: {next_plan} stages" in switched  # to the next run's plan

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]

    switched_losses, straight_losses = losses("switched.jsonl"), losses("straight.jsonl")
    assert len(switched_losses) == 50 and len(straight_losses) == 12
    assert switched_losses[:12] == pytest.approx(straight_losses, rel=1e-6, abs=0)


def test_a_compute_lane_faster_than_its_profile_marks_the_profile_stale_and_a_slower_one_keeps_it():
    """A profile measured on a busy machine makes every plan slow: a run whose compute lane (the
    busiest worker's micro-batch passes) is faster than planned has the next run measure the
    layers again; one slower than planned (the machine busy now) is named and keeps the profile."""
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)  # worker 0: two stages of 1 + 1 ms, one micro-batch
    assert predicted_compute_s(plan) == pytest.approx(4e-3)

    def check(compute_s):
        found = PlanCheck(plan, lambda r: None)
        return found.after(steps(adam_s=0.168, rate=1e8, compute_s=compute_s)), found.stale_profile

    assert check(2e-3) == (["plan check: compute 2.00 ms measured, 4.00 ms predicted (0.50x); the layers ran faster "
                            "than their cached profile says: the next run measures them again"], True)
    assert check(8e-3) == (["plan check: compute 8.00 ms measured, 4.00 ms predicted (2.00x)"], False)
    assert check(4.4e-3) == ([], False)


def test_no_cache_measures_the_profile_again(capfd):
    """``mobius.plan --no-cache`` (``fresh``) measures the layers again instead of reading the cache."""
    from mobius.models import PRESETS
    from mobius.planning.prepare import get_profile
    from topology import cpu_topology

    topo = cpu_topology(1)
    get_profile("tiny", PRESETS["tiny"], topo, 1, 16, "fp32")
    capfd.readouterr()
    get_profile("tiny", PRESETS["tiny"], topo, 1, 16, "fp32")
    assert "profiling: measuring" not in capfd.readouterr().out  # cached
    get_profile("tiny", PRESETS["tiny"], topo, 1, 16, "fp32", fresh=True)
    assert "profiling: measuring tiny's layers" in capfd.readouterr().out
