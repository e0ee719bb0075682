"""A run compares its first steps with its plan, names a lane that is off, and keeps the host's
measured AdamW rate for the next plan on this machine."""

import pytest

from mobius.metrics import StepMetrics
from mobius.runtime.plan_check import MIN_PARAMS_KEPT, PlanCheck, predicted_host_adam_s
from mobius.runtime.spec import Plan, StagePlan


def plan_of(params_per_worker: int, rate: float, step_s: float = 1.0) -> Plan:
    """Two workers, two stages each, one of worker 0's stages resident (updated on its GPU)."""
    stages = [StagePlan(j, (j, j + 1), j % 2, 0, 1.0, 1.0, 0, 0, 0, 0, grad_bytes=4 * params_per_worker // 2)
              for j in range(4)]
    return Plan(model="m", topology="t", micro_batch_size=1, micro_batches=1, seq_len=1, precision="fp32",
                recompute=False, partitioner="mip", bounds=[(j, j + 1) for j in range(4)], order=[0, 1], contention=0.0,
                predicted_step_s=step_s, stages=stages, resident=[0], host_costs={"adam_params_per_s": rate})


def steps(adam_s: float, rate: float, step_s: float = 1.0, n: int = 4) -> list[StepMetrics]:
    return [StepMetrics(step=k, loss=1.0, lr=1.0, tokens=1, step_time_s=step_s, host_adam_s=adam_s,
                        host_adam_params_per_s=rate) for k in range(n)]


def test_the_busiest_workers_swapping_stages_make_the_host_lane():
    plan = plan_of(8 * 10**6, rate=1e9)
    assert predicted_host_adam_s(plan) == pytest.approx(8e-3)  # worker 1: both stages; worker 0: one resident


def test_a_lane_off_by_more_than_a_fifth_is_named_once_and_its_rate_kept():
    kept = []
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)  # predicted: 4 * 2**22 / 1e8 = 0.168 s
    check = PlanCheck(plan, kept.append)
    history = steps(adam_s=0.042, rate=4e8)
    assert check.after(history[:3]) == []  # the warm-up step and two: not yet
    lines = check.after(history)
    assert lines == ["plan check: host AdamW 42.00 ms measured, 0.17 s predicted (400 M parameters/s measured, "
                     "100 M planned); the next plan on this machine uses the measured rate"]
    assert kept == [4e8]
    assert check.after(history + steps(0.042, 4e8)) == []  # once per run


def test_within_a_fifth_nothing_is_said_and_small_updates_keep_no_rate():
    kept = []
    plan = plan_of(MIN_PARAMS_KEPT * 4, rate=1e8)
    assert PlanCheck(plan, kept.append).after(steps(adam_s=0.16, rate=1.05e8, step_s=1.1)) == []
    small = plan_of(1000, rate=1e8)  # a tiny model: the calls' fixed costs, not the bytes
    (line,) = PlanCheck(small, kept.append).after(steps(adam_s=1e-3, rate=1e6))
    assert line.endswith("too few parameters a step to take it for the host's rate") and kept == []
    (line,) = PlanCheck(plan, kept.append).after(steps(adam_s=0.16, rate=1e8, step_s=2.0))
    assert line == "plan check: step 2.00 s measured, 1.00 s predicted (2.00x)" and kept == []


@pytest.mark.slow
def test_a_run_planned_on_a_stale_rate_names_the_lane_and_the_next_plan_uses_what_it_measured(tmp_path, capfd):
    """A host AdamW rate a tenth of this machine's is in the cache (measured while the machine was
    busy, say): the plan uses it, the run says its host AdamW lane is off after four steps and
    keeps what it measured, and the next plan is made with that rate."""
    from mobius.config import parse_train_args
    from mobius.prepare import get_profile, measured_on, prepare_pipeline, resolve_topology
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
    assert prepare_pipeline(cfg, topo, model)[1].host_costs["adam_params_per_s"] == timed / 10
    capfd.readouterr()

    main(args)
    out = capfd.readouterr().out  # the workers print it
    assert any(line.startswith("plan check: host AdamW") and line.endswith("uses the measured rate")
               for line in out.splitlines()), out
    measured = HOST_RATES.get(key, lambda d: d["adam_params_per_s"])
    assert measured != timed / 10
    assert prepare_pipeline(cfg, topo, model)[1].host_costs["adam_params_per_s"] == measured
