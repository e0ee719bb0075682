"""The runtime's own costs, measured by running it (mobius.stages.calibrate)."""

from __future__ import annotations

from pathlib import Path

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


class _Runs:
    """Stands in for the calibration's worker processes, saying what was asked of them."""

    def __init__(self, events: list, threads: int):
        self.events = events
        events.append(("start", threads))

    def times(self):
        self.events.append("times")
        return {(2, 2): 0.01}

    def close(self):
        self.events.append("close")


def test_runs_started_early_are_waited_for_before_anything_is_timed_taken_once_and_stopped_if_unused(monkeypatch):
    events: list = []
    monkeypatch.setattr(calibrate, "CalibrationRuns", lambda threads, steps=calibrate.STEPS: _Runs(events, threads))
    with calibrate.started_early(3):
        calibrate.finish_early()  # what the profile does before it times a layer
        assert calibrate.time_calibration_runs(3) == {(2, 2): 0.01}
        assert events == [("start", 3), "times", "times"]
        calibrate.time_calibration_runs(3)  # taken once: another calibration starts its own
        assert events[-2:] == [("start", 3), "times"]
    assert events[-1] == "close"
    events.clear()
    with calibrate.started_early(1):  # the run failed before it profiled: the workers are stopped
        pass
    assert events == [("start", 1), "close"]


def test_a_pipeline_run_on_cpu_workers_starts_its_calibration_only_where_it_will_need_it(monkeypatch):
    import contextlib

    from mobius.config import RunConfig
    from mobius.planning import prepare
    from mobius.runtime.device import cpu_threads_per_worker

    started: list = []
    monkeypatch.setattr(prepare, "started_early", lambda threads: started.append(threads) or contextlib.nullcontext())
    cfg = RunConfig.of(model="tiny", topology="cpu", cpu_workers=2, seq_len=27)  # a profile never measured
    topo = prepare.resolve_topology(cfg)
    monkeypatch.setattr(prepare.RUNTIME_COSTS, "get", lambda key, parse: None)
    decided = prepare.decide(cfg, topo, "pipeline", replicated=True)
    with prepare.early_calibration(decided, get_config("tiny")):
        assert started == [cpu_threads_per_worker(2)]
    emulating = prepare.decide(cfg.changed(emulate=True, topology="4x3090"), topo, "pipeline", replicated=True)
    with prepare.early_calibration(emulating, get_config("tiny")):
        pass  # emulated GPUs are planned from FLOPs and bytes first
    monkeypatch.setattr(prepare.RUNTIME_COSTS, "get", lambda key, parse: {"micro_batch_s": 0.0})  # calibrated
    with prepare.early_calibration(decided, get_config("tiny")):
        pass
    assert started == [cpu_threads_per_worker(2)]


@pytest.mark.slow
def test_calibration_workers_left_unused_are_gone_with_their_files(tmp_path, monkeypatch):
    """Closed early, the workers are gone, and so are torch's error files (one a worker writes
    when it fails, on a lost peer say): they are made in the calibration's own directory, never
    in the user's temporary directory, where nobody would remove them."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runs = calibrate.CalibrationRuns(threads=1, steps=2)
    processes = list(runs._context.processes)
    assert any(p.is_alive() for p in processes)
    (ours,) = tmp_path.glob("mobius-calibration-*")
    assert [Path(f).parent for f in runs._context.error_files] == [ours] * len(processes)
    runs.close()
    assert not any(p.is_alive() for p in processes)
    assert list(tmp_path.iterdir()) == []


class _Context:
    """Stands in for the workers' spawn context: joined, it raises ``error`` (or reports them done)."""

    def __init__(self, error=None):
        self.error = error

    def join(self, timeout=None):
        if self.error is not None:
            raise self.error
        return True


class _Writing(_Context):
    """Writes the times as it fails: the worker lost in its teardown, after its last step."""

    def __init__(self, error, out):
        super().__init__(error)
        self.out = out

    def join(self, timeout=None):
        self.out.write_text('{"2,2": 0.5}')
        return super().join(timeout)


def test_the_times_are_taken_once_written_and_a_worker_lost_before_them_is_the_runs_error(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "times.json"
    lost = [mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=1,
                                      exit_code=-6, signal_name="SIGABRT"),
            mp.ProcessExitedException("process 1 terminated with exit code 1", error_index=1, error_pid=1,
                                      exit_code=1),
            mp.ProcessRaisedException("Traceback ...", error_index=0, error_pid=1)]
    for error in lost:
        with pytest.raises(type(error)):
            calibrate.joined(_Context(error), out)
        assert calibrate.joined(_Writing(error, out), out) == {(2, 2): 0.5}
        out.unlink()
    out.write_text('{"2,2": 0.5, "10,12": 1.5}')  # written: taken at once, the workers' teardown not waited for
    assert calibrate.joined(_Context(lost[0]), out) == {(2, 2): 0.5, (10, 12): 1.5}


def test_calibration_workers_killed_before_their_times_are_written_run_once_more(monkeypatch):
    import torch.multiprocessing as mp

    class Started:
        processes: list = []

    starts, outcomes = [], []
    monkeypatch.setattr(calibrate.mp, "start_processes", lambda *a, **k: starts.append(1) or Started())

    def joined(context, out):
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(calibrate, "joined", joined)
    killed = mp.ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=1,
                                       exit_code=-9, signal_name="SIGKILL")
    outcomes[:] = [killed, {(2, 2): 0.25}]
    assert calibrate.CalibrationRuns(threads=1).times() == {(2, 2): 0.25}
    assert len(starts) == 2
    outcomes[:] = [killed, killed]  # twice: the run's error
    with pytest.raises(mp.ProcessExitedException):
        calibrate.CalibrationRuns(threads=1).times()
    assert len(starts) == 4
    exited = mp.ProcessExitedException("process 0 terminated with exit code 1", error_index=0, error_pid=1,
                                       exit_code=1)
    outcomes[:] = [exited, {(2, 2): 0.25}]  # an exit of its own is an error: not run again
    with pytest.raises(mp.ProcessExitedException):
        calibrate.CalibrationRuns(threads=1).times()
    assert len(starts) == 5
