"""The runtime's own costs, measured by running it (mobius.stages.calibrate)."""

from __future__ import annotations

import pytest

from mobius.stages import calibrate


def test_the_fit_separates_per_micro_batch_and_per_switch_work_from_the_layers(monkeypatch):
    """Step times made of a fixed part, the layers' work per micro-batch, ``o`` per micro-batch per
    stage in each of two passes and ``w`` per stage in each pass: the fit returns ``o`` and ``w``
    whatever the layers cost."""
    o, w = 3e-4, 9e-4

    def step_s(stages: int, micro_batches: int) -> float:
        return 0.05 + 2 * stages * w + micro_batches * (0.012 + 2 * stages * o)

    monkeypatch.setattr(calibrate, "_step_s", step_s)
    assert calibrate.measure_runtime_overheads(workers=2) == pytest.approx((o, w))


def test_the_calibration_runs_the_real_runtime_one_stage_per_layer():
    """The hand-made plan of the calibration model runs on the runtime, one layer per stage."""
    assert 0 < calibrate._step_s(10, 2) < 10


def test_the_handoff_is_a_gloo_round_trip_and_grows_with_the_message():
    small, large = calibrate.measure_handoff(4096), calibrate.measure_handoff(16 * 2**20)
    assert 0 < small < large < 1
