"""The runtime's own costs, measured by running it (mobius.stages.calibrate)."""

from __future__ import annotations

import pytest

from mobius.models import get_config
from mobius.partition.profile import analytic_profile
from mobius.stages import calibrate


def test_the_fit_finds_the_costs_the_runs_were_made_of():
    """Step times the cost model gives with known ``o``, ``w`` and ``h`` on the calibration
    configurations: the fit finds costs with which the model gives them again."""
    profile = analytic_profile(calibrate.MODEL, get_config(calibrate.MODEL), calibrate.MICRO_BATCH,
                               calibrate.SEQ_LEN, 0.001, "fp32")
    configs = calibrate.calibration_configs()
    made_of = (1.2e-3, 0.8e-3, 0.5e-3)
    measured = calibrate.predicted_times(profile, made_of, configs)
    assert measured != calibrate.predicted_times(profile, (0.0, 0.0, 0.0), configs)
    fitted = calibrate.predicted_times(profile, calibrate.fit_runtime_costs(profile, measured), configs)
    for c in configs:
        assert fitted[c] == pytest.approx(measured[c], rel=0.02)


@pytest.mark.slow
def test_the_calibration_runs_two_worker_processes_on_the_real_runtime():
    """Every configuration runs, one stage per worker and one stage per layer, over gloo."""
    times = calibrate.time_calibration_runs(threads=1, steps=2)
    assert set(times) == set(calibrate.calibration_configs())
    assert all(0 < t < 10 for t in times.values())
    # More micro-batches take longer, whatever the stages.
    for stages in {s for s, _ in times}:
        assert times[(stages, calibrate.MANY)] > times[(stages, calibrate.FEW)]


def test_the_handoff_is_a_gloo_round_trip_and_grows_with_the_message():
    small, large = calibrate.measure_handoff(4096), calibrate.measure_handoff(16 * 2**20)
    assert 0 < small < large < 1
