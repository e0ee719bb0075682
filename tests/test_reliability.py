"""Checkpoints, resume, signals, dead workers, numerics and bad input."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from mobius.boundary import ownership
from mobius.runtime import checkpoint as ck
from mobius.runtime.worker import parent_of
from mobius.train import main
from conftest import fault_env, none_left, tagged

pytestmark = pytest.mark.adversarial  # the reliability rounds' cases, kept as one set

TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def weights(directory):
    c = ck.load_checkpoint(directory)
    return {n: c.get(n) for n in c.names() if "/" not in n}


@pytest.mark.parametrize("lag", ["0", "1"])
def test_stop_after_then_resume_equals_straight_run_bitwise(tmp_path, lag):
    a, b = tmp_path / "a", tmp_path / "b"
    args = TINY + ["--backend", "single", "--steps", "10", "--optimizer-lag", lag]
    main(args + ["--stop-after", "5", "--save", str(a), "--metrics", str(tmp_path / "a.jsonl")])
    assert ck.load_checkpoint(a).step == 5
    main(args + ["--resume", str(a), "--save", str(a), "--metrics", str(tmp_path / "a.jsonl")])
    main(args + ["--save", str(b), "--metrics", str(tmp_path / "b.jsonl")])
    assert losses(tmp_path / "a.jsonl") == losses(tmp_path / "b.jsonl")
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_on_single_backend(tmp_path):
    """Per-stage shards from 2 workers are reassembled by name by another backend."""
    d = tmp_path / "pipe"
    main(TINY + ["--topology", "cpu", "--cpu-workers", "2", "--stages", "4", "--steps", "6", "--stop-after", "3",
                 "--save", str(d), "--metrics", str(tmp_path / "p.jsonl")])
    assert {f.name for f in d.iterdir()} >= {"weights-stage0000.safetensors", "weights-stage0003.safetensors"}
    main(TINY + ["--backend", "single", "--steps", "6", "--resume", str(d), "--metrics", str(tmp_path / "p.jsonl")])
    main(TINY + ["--backend", "single", "--steps", "6", "--metrics", str(tmp_path / "s.jsonl")])
    for x, y in zip(losses(tmp_path / "p.jsonl"), losses(tmp_path / "s.jsonl"), strict=True):
        assert abs(x - y) / y < 1e-5


@pytest.mark.slow
def test_lagged_checkpoints_move_between_backends(tmp_path):
    """--optimizer-lag 1: the pipeline's checkpoint (master weights plus the weights the next step
    computes with) resumes on single and single's on the pipeline, as one straight run."""
    lag = ["--optimizer-lag", "1", "--steps", "6", "--metrics", str(tmp_path / "p.jsonl")]
    pipe = ["--topology", "cpu", "--cpu-workers", "2", "--stages", "4"]
    d = tmp_path / "ck"
    main(TINY + pipe + lag + ["--stop-after", "2", "--save", str(d)])
    assert any(n.startswith(ck.LAGGED) for n in ck.load_checkpoint(d).names())
    main(TINY + lag + ["--backend", "single", "--resume", str(d), "--stop-after", "2", "--save", str(d)])
    main(TINY + pipe + lag + ["--backend", "pipeline", "--resume", str(d), "--save", str(d)])
    main(TINY + ["--backend", "single", "--optimizer-lag", "1", "--steps", "6", "--save", str(tmp_path / "s"),
                 "--metrics", str(tmp_path / "s.jsonl")])
    assert losses(tmp_path / "p.jsonl") == pytest.approx(losses(tmp_path / "s.jsonl"), rel=1e-5)
    wp, ws = weights(d), weights(tmp_path / "s")
    assert wp.keys() == ws.keys()
    for k in ws:
        torch.testing.assert_close(wp[k], ws[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture()
def saved(tmp_path):
    d = tmp_path / "ck"
    main(TINY + ["--backend", "single", "--steps", "2", "--save", str(d)])
    return d


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return exit_info.value.code, err


def test_one_changed_byte_is_refused_naming_the_file(saved, capsys):
    f = saved / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="weights.safetensors is corrupt"):
        ck.load_checkpoint(saved)
    code, err = run_cli(TINY + ["--backend", "single", "--steps", "4", "--resume", str(saved)], capsys)
    assert code == 2 and len(err) == 1 and "weights.safetensors is corrupt" in err[0]


def test_a_worker_checks_each_file_as_it_reads_it(saved):
    """Bytes changed after the launcher's check never train: a worker's reader verifies a file
    before its first tensor is read."""
    ckpt = ck.load_checkpoint(saved, verify=False)
    f = saved / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="weights.safetensors is corrupt"):
        ckpt.get(next(n for n in ckpt.names() if not n.startswith(("exp_avg", "step/", "rng/"))))


def test_truncated_manifest_is_refused(saved):
    m = saved / "manifest.json"
    m.write_text(m.read_text()[:40])
    with pytest.raises(ck.CheckpointError, match="manifest.json: not valid JSON"):
        ck.load_checkpoint(saved)


@pytest.mark.parametrize("field,value,said", [
    *[("step", v, "step must be a non-negative integer") for v in (2.5, -1, "2", True)],
    *[("loss_scale", v, "loss_scale must be a positive finite number") for v in (0, -1.0, float("inf"), "x", True)],
    ("loss_scale_clean_steps", -3, "loss_scale_clean_steps must be a non-negative integer"),
    ("skipped_steps", 1.5, "skipped_steps must be a non-negative integer"),
])
def test_a_checkpoint_number_that_is_no_such_number_is_refused(saved, capsys, field, value, said):
    """The numbers a resume continues from, even with the manifest's digest recomputed (it proves
    integrity, not origin): refused in one line, exit 2, before training."""
    m = saved / "manifest.json"
    manifest = json.loads(m.read_text())
    manifest[field] = value
    manifest["digest"] = ck.manifest_digest(manifest)
    m.write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match=said):
        ck.load_checkpoint(saved)
    code, err = run_cli(TINY + ["--backend", "single", "--steps", "4", "--resume", str(saved)], capsys)
    assert code == 2 and len(err) == 1 and said in err[0], err


def test_checkpoint_of_another_model_is_refused(saved, capsys):
    code, err = run_cli(["--model", "tiny8", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress",
                         "--backend", "single", "--steps", "4", "--resume", str(saved)], capsys)
    assert code == 2 and "different model (differs in n_layer)" in err[0]


def test_crash_during_save_leaves_the_previous_checkpoint(saved, monkeypatch):
    before = weights(saved)
    calls = []
    real = ck.write_tensors

    def crash_on_second_file(staging, name, tensors):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-save")
        real(staging, name, tensors)

    monkeypatch.setattr(ck, "write_tensors", crash_on_second_file)
    with pytest.raises(SystemExit):
        main(TINY + ["--backend", "single", "--steps", "4", "--resume", str(saved), "--save", str(saved),
                     "--resume-with-changes"])
    monkeypatch.undo()
    assert ck.load_checkpoint(saved).step == 2
    after = weights(saved)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A crash between the two renames of a save: the checkpoint is parked beside DIR and still loads.
    os.replace(saved, ownership.sibling(saved, "previous"))
    assert ck.load_checkpoint(saved).step == 2


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    d = tmp_path / "ck"
    code, err = run_cli(TINY + ["--backend", "single", "--steps", "8", "--lr", "1e9", "--save", str(d),
                                "--save-every", "1"], capsys)
    assert code == 1 and "loss is nan at step 1" in err[-1] and "last checkpoint" in err[-1]
    assert ck.load_checkpoint(d).step == 1


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    from mobius.config import RunConfig
    from mobius.data import BatchSource, load_corpus
    from mobius.models import get_config
    from mobius.reference import ReferenceTrainer

    cfg = RunConfig.of(model="tiny", steps=3, micro_batch_size=2, micro_batches=2, seq_len=32, precision="fp16")
    t = ReferenceTrainer(cfg, get_config("tiny"), BatchSource(load_corpus(None, 100_000), 32, 2, 2, 0),
                         torch.device("cpu"))
    t.scaler.scale = 3e38  # the scaled loss overflows
    before = [p.detach().clone() for p in t.model.parameters()]
    m = t.step(0)
    assert m.skipped_steps == 1 and m.loss_scale == pytest.approx(1.5e38)
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    t.scaler.scale = 1024.0
    m = t.step(1)
    assert m.skipped_steps == 1 and not all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))


def _die_with_the_test() -> None:
    """In the child before it runs: the kernel SIGKILLs it when the test process dies, however that
    dies (its workers die with it in turn), so an interrupted suite leaves nothing training."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(args, tmp_path, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "mobius.train"] + args, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            preexec_fn=_die_with_the_test, **kwargs)


def _workers(tag: str) -> list[str]:
    """The worker processes among ``tagged(tag)`` (the calibration's and the run's): forked by
    multiprocessing's fork server (the server itself is none), or started by its spawn."""
    return [pid for pid in tagged(tag) if b"spawn_main" in _cmdline(pid)
            or b"forkserver" in _cmdline(pid) and b"forkserver" in _cmdline(parent_of(int(pid)))]


def _cmdline(pid) -> bytes:
    """A process's command line; nothing once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""



# How long a test waits for what must happen before calling it a hang: a bound for a busy machine,
# many times the quiet time, never what a test asserts.
PATIENCE_S = 600


def _wait_for_step(run: subprocess.Popen, metrics: Path, step: int, timeout: float = PATIENCE_S) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if metrics.exists() and sum(1 for _ in open(metrics)) > step:
            return
        if run.poll() is not None:
            raise AssertionError(f"the run ended ({run.returncode}) before the step: {run.communicate()[1][-2000:]}")
        time.sleep(0.2)
    raise AssertionError("the run did not reach the step")


def _resource_trackers(launcher: int) -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent_of(int(pid)) == launcher
            and b"from multiprocessing.resource_tracker import main" in _cmdline(pid)]


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_0_pipeline(tmp_path):
    """SIGTERM: the step finishes, is saved, exit 0.  multiprocessing's resource tracker was killed
    mid-run (a user's ``pkill``): it is replaced, and nothing of it reaches stderr."""
    p = _spawn(TINY + ["--topology", "cpu", "--cpu-workers", "2", "--stages", "4", "--steps", "1000",
                       "--save", "ck", "--metrics", "m.jsonl"], tmp_path)
    _wait_for_step(p, tmp_path / "m.jsonl", 1)
    killed = _resource_trackers(p.pid)
    for tracker in killed:
        os.kill(tracker, signal.SIGKILL)
    _wait_for_step(p, tmp_path / "m.jsonl", 3)
    t0 = time.monotonic()  # a tracker is started again when something next needs one, not at once
    while ((not (now := _resource_trackers(p.pid)) or set(now) & set(killed))  # a SIGKILL takes a moment
           and time.monotonic() - t0 < PATIENCE_S and p.poll() is None):
        time.sleep(0.2)
    assert killed and now and not set(now) & set(killed)  # replaced
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode == 0, err[-2000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "SIGTERM: finishing the current step, then saving (send it again to exit at once)"], err
    step = ck.load_checkpoint(tmp_path / "ck").step
    assert f"stopped after step {step} of 1000: checkpoint saved to ck" in out
    assert step == sum(1 for _ in open(tmp_path / "m.jsonl"))


@pytest.mark.slow
def test_a_closing_terminals_sighup_stops_the_run_as_sigterm_does(tmp_path):
    """SIGHUP to the whole process group (a terminal closing): the step finishes, the checkpoint is
    saved, exit 0, and the one line saying so is all of stderr (no agent traceback, no resource
    tracker dying of it)."""
    p = _spawn(PIPELINE + ["--save", "ck", "--metrics", "m.jsonl"], tmp_path, start_new_session=True)
    _wait_for_step(p, tmp_path / "m.jsonl", 1)
    os.killpg(p.pid, signal.SIGHUP)
    out, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode == 0, err[-2000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "SIGHUP: finishing the current step, then saving (send it again to exit at once)"], err
    step = ck.load_checkpoint(tmp_path / "ck").step
    assert f"stopped after step {step} of 1000: checkpoint saved to ck" in out


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path):
    # `small` steps take about a second, so the second signal lands while the first is being honoured.
    p = _spawn(["--model", "small", "--no-progress", "--backend", "single", "--steps", "1000", "--save", "ck",
                "--save-every", "1000", "--metrics", "m.jsonl"], tmp_path)
    _wait_for_step(p, tmp_path / "m.jsonl", 1)
    p.send_signal(signal.SIGINT)
    # The second Ctrl-C once the first is being honoured (the run said so), not one the kernel
    # merges with the first; the step it finishes and the save take far longer than this reply.
    lines = _lines_of(p.stderr)
    assert any("finishing the current step" in line for line in _until(lines, "finishing the current step"))
    p.send_signal(signal.SIGINT)
    rest = "".join(_until(lines, None))
    assert p.wait(PATIENCE_S) == 128 + signal.SIGINT and "exiting now" in rest
    assert not (tmp_path / "ck").exists()  # nothing saved


@pytest.mark.slow
def test_killed_worker_leaves_no_orphans(tmp_path):
    """Worker 2 of a run of a million steps is killed in step 2: the run ends with one line naming
    it, and no process of the run is left."""
    tag = uuid.uuid4().hex
    p = _spawn(TINY + ["--topology", "cpu", "--cpu-workers", "3", "--stages", "3", "--steps", "1000000"], tmp_path,
               env={**fault_env("2:2"), "MOBIUS_TEST_TAG": tag})
    _, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode != 0
    assert err.strip().splitlines() == ["error: worker 2 failed: Signal 9 (SIGKILL) received by PID " +
                                        err.split("received by PID ")[1].split()[0]]
    assert none_left(tag)


PIPELINE = TINY + ["--topology", "cpu", "--cpu-workers", "2", "--stages", "4", "--steps", "1000"]


def _scratch(tmp_path: Path, tag: str) -> dict[str, str]:
    """The environment of a run whose temporary directories all go under ``tmp_path/tmp`` (torch's
    own compile cache elsewhere) and whose processes carry ``tag``."""
    (tmp_path / "tmp").mkdir()
    return {"MOBIUS_TEST_TAG": tag, "TMPDIR": str(tmp_path / "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


def _lines_of(stream):
    """The lines of a child's output as they come, read on a thread of their own."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _until(lines: queue.Queue, marker: str | None) -> list[str]:
    """The lines up to the first that holds ``marker`` (``None``: to the end of the output)."""
    got = []
    while True:
        line = lines.get(timeout=PATIENCE_S)
        if line is None:
            return got
        got.append(line)
        if marker is not None and marker in line:
            return got


def _left(tag: str, scratch: Path, within: float = PATIENCE_S) -> list[str]:
    """What is left of a run once it has had time to end: the command lines of the processes
    carrying ``tag`` and the entries of its temporary directory ``scratch`` (none: all gone)."""
    def left() -> list[str]:
        procs = []
        for pid in tagged(tag):
            try:
                procs.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
            except OSError:
                continue
        return procs + [str(entry) for entry in scratch.rglob("*")]

    t0 = time.monotonic()
    while left() and time.monotonic() - t0 < within:
        time.sleep(0.2)
    return left()


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_workers(tmp_path):
    """Killed while training: the workers remove the launcher's temporary directories and die."""
    tag, scratch = uuid.uuid4().hex, tmp_path / "tmp"
    p = _spawn(PIPELINE + ["--metrics", "m.jsonl"], tmp_path, env=_scratch(tmp_path, tag))
    _wait_for_step(p, tmp_path / "m.jsonl", 1)
    assert len(_workers(tag)) >= 2 and any(scratch.iterdir())  # two workers; the run's directories
    p.kill()
    p.communicate()
    assert _left(tag, scratch) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_during_calibration_ends_everything(tmp_path, sig):
    """The first plan on a machine calibrates the runtime with two worker processes.  SIGTERM then
    is one line and exit 143; SIGKILL of the launcher leaves no worker and no temporary directory."""
    tag, scratch = uuid.uuid4().hex, tmp_path / "tmp"
    p = _spawn(PIPELINE, tmp_path, env={**_scratch(tmp_path, tag), "MOBIUS_CACHE": str(tmp_path / "cache")})
    t0 = time.monotonic()
    while not (list(scratch.glob("mobius-calibration-*")) and len(_workers(tag)) >= 2) and time.monotonic() - t0 < PATIENCE_S:
        time.sleep(0.1)
    assert list(scratch.glob("mobius-calibration-*")), "calibration did not start"
    p.send_signal(sig)
    _, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode == -signal.SIGKILL if sig == signal.SIGKILL else (
        p.returncode == 143 and err.strip().splitlines() == ["interrupted (SIGTERM)"]), err
    assert _left(tag, scratch) == []


def test_a_signal_within_a_deferred_block_is_handled_as_it_ends():
    """What a block starts is registered before a signal can interrupt it: the signal is handled,
    by the handler in place before the block, once the block is done."""
    from mobius.signals import signals_deferred

    seen = []
    handler = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handled"))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            seen.append("registered")
        seen.append("after")
        assert seen == ["registered", "handled", "after"]
        assert signal.getsignal(signal.SIGTERM) is not handler  # ours again, not the block's
    finally:
        signal.signal(signal.SIGTERM, handler)


@pytest.mark.slow
def test_a_sigterm_as_the_calibration_workers_start_kills_them_before_their_directory_goes():
    """SIGTERM just as the calibration's workers have started (the start not yet returned): they
    are killed, then their directory removed; none is left to write into it."""
    import mobius.stages.calibrate as calibrate
    from mobius.boundary.errors import Terminated, _terminate

    start, started = calibrate.mp.start_processes, []

    def start_then_signalled(fn, args, **kwargs):
        started.append((start(fn, args, **kwargs), Path(args[3]).parent))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        return started[-1][0]

    handler = signal.signal(signal.SIGTERM, _terminate)
    try:
        calibrate.mp.start_processes = start_then_signalled
        with pytest.raises(Terminated):
            calibrate.CalibrationRuns(1)
    finally:
        calibrate.mp.start_processes = start
        signal.signal(signal.SIGTERM, handler)
    ((context, directory),) = started
    assert [p.is_alive() for p in context.processes] == [False, False] and not directory.exists()


@pytest.mark.slow
def test_ctrl_c_while_workers_start_is_one_line_and_130(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, workers still starting included (held
    before training starts)."""
    tag, scratch = uuid.uuid4().hex, tmp_path / "tmp"
    p = _spawn(PIPELINE, tmp_path, env={**_scratch(tmp_path, tag), **fault_env("start")}, start_new_session=True)
    t0 = time.monotonic()
    # The run's workers exist (its directory does: the calibration's workers are gone), and start.
    while not (list(scratch.glob("mobius-run-*")) and len(_workers(tag)) >= 2) and time.monotonic() - t0 < PATIENCE_S:
        time.sleep(0.05)
    assert len(_workers(tag)) >= 2
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode == 130 and err.strip().splitlines() == ["interrupted (SIGINT) before training started"], err
    assert none_left(tag)


@pytest.mark.slow
def test_a_second_run_on_the_same_outputs_is_refused_before_it_trains(tmp_path):
    """While a run writes --save (and --metrics), another run given them is refused in one line;
    the first carries on and saves."""
    a = _spawn(TINY + ["--backend", "single", "--steps", "1000", "--save", "ck", "--metrics", "m.jsonl"], tmp_path)
    try:
        _wait_for_step(a, tmp_path / "m.jsonl", 1)
        b = subprocess.run([sys.executable, "-m", "mobius.train"] + TINY +
                           ["--backend", "single", "--steps", "3", "--save", "ck", "--metrics", "other.jsonl"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=PATIENCE_S)
        assert b.returncode == 2 and b.stderr.strip().splitlines() == [
            f"error: --save ck: another run is writing it (it holds {tmp_path / '.ck.mobius-lock'}); "
            "refusing to start a second one"], b.stderr
        assert not (tmp_path / "other.jsonl").exists()
        a.send_signal(signal.SIGTERM)
        out, err = a.communicate(timeout=PATIENCE_S)
        assert a.returncode == 0, err[-2000:]
        assert ck.load_checkpoint(tmp_path / "ck").step == sum(1 for _ in open(tmp_path / "m.jsonl"))
        assert not (tmp_path / ".ck.mobius-lock").exists()  # released and removed with the run
    finally:
        a.kill()


def test_output_locks_in_one_process(tmp_path):
    from mobius.boundary.errors import InputError

    with ownership.output_locks({"--export": str(tmp_path / "out"), "--export-merged": str(tmp_path / "out")}):
        with pytest.raises(InputError, match="--export .* another run is writing it"):
            with ownership.output_locks({"--export": str(tmp_path / "out")}):
                pass
    with ownership.output_locks({"--export": str(tmp_path / "out")}):  # released
        pass



def test_a_lock_name_that_is_not_our_lock_is_refused_and_left_alone(tmp_path):
    """A file of the user's with our lock's name is neither used nor removed; a dangling link with
    that name creates nothing where it points; a stale empty lock of ours (a killed run's) is reused."""
    from mobius.boundary.errors import InputError

    lock = tmp_path / ".out.mobius-lock"
    lock.write_text("my notes")
    with pytest.raises(InputError, match="is not a lock Mobius made"):
        with ownership.output_locks({"--save": str(tmp_path / "out")}):
            pass
    assert lock.read_text() == "my notes"
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InputError, match="cannot create its lock"):
        with ownership.output_locks({"--save": str(tmp_path / "out")}):
            pass
    assert not (tmp_path / "elsewhere").exists()
    lock.unlink()
    lock.write_bytes(b"")
    with ownership.output_locks({"--save": str(tmp_path / "out")}):
        assert lock.read_bytes() == ownership.LOCK_TAG
    assert not lock.exists()


def test_a_file_the_user_writes_into_an_output_between_saves_survives_the_next(tmp_path, capsys):
    """Each save (and export) swaps a complete directory in; what the user wrote into the previous
    version meanwhile, and a file of ours they edited, are moved into the new one, not removed."""
    out = tmp_path / "ck"
    for version, note in enumerate((None, "notes.txt", None, None)):
        staging = ownership.fresh_dir(ownership.sibling(out, "partial"), "checkpoint")
        (staging / "weights.bin").write_bytes(bytes([version]) * 1000)
        (staging / "manifest.json").write_text(f"version {version}")
        if version == 2:  # the user edits one of our files of version 1 (a different size)
            (out / "manifest.json").write_text("the user's own words")
        ownership.swap_into_place(staging, out, "checkpoint")
        if note:
            (out / note).write_text("mine")
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "manifest.json").read_text() == "version 3"
    assert (out / "manifest.json.user-1").read_text() == "the user's own words"
    assert (out / "weights.bin").read_bytes() == bytes([3]) * 1000
    assert not ownership.sibling(out, "previous").exists()
    assert capsys.readouterr().err.splitlines() == [  # said once, not at every save after
        f"note: {out.resolve()}: kept 2 file(s) Mobius did not write (manifest.json.user-1, notes.txt)"]


def test_a_run_in_the_callers_process_gives_its_signal_handlers_back(tmp_path):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    main(TINY + ["--backend", "single", "--steps", "1"])
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_full_disk_under_tensorboard_is_one_line_and_no_writer_thread_traceback(tmp_path, capfd):
    """Event files that cannot grow (the file-size limit stands in for a full disk): the failure is
    one RunError line from the training loop's write; TensorBoard's writer thread prints nothing and
    closing the log raises nothing more."""
    import resource
    import signal

    from mobius.boundary.errors import RunError
    from mobius.config import OutputConfig
    from mobius.metrics import StepMetrics
    from mobius.metrics.reporters import open_reports

    log = open_reports(OutputConfig(tensorboard=str(tmp_path / "tb")), {})
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, hard))
    try:
        with pytest.raises(RunError, match="writing --tensorboard .* failed: File too large"):
            for k in range(50):
                log.write(StepMetrics(step=k, loss=1.0, lr=1.0, tokens=1, step_time_s=1.0))
        log.write(StepMetrics(step=50, loss=1.0, lr=1.0, tokens=1, step_time_s=1.0))  # said once: no second error
        log.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    err = capfd.readouterr().err
    assert "Exception in thread" not in err and "Traceback" not in err, err


def _rewrite(saved, filename: str, change) -> None:
    """``filename`` of the checkpoint rewritten by ``change(tensors)`` and the manifest re-digested,
    as a hostile user could: its digest proves integrity, not origin."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved / filename))
    change(tensors)
    save_file(tensors, str(saved / filename))
    m = saved / "manifest.json"
    manifest = json.loads(m.read_text())
    manifest["files"][filename] = ownership_sha256(saved / filename)
    manifest["digest"] = ck.manifest_digest(manifest)
    m.write_text(json.dumps(manifest))


def ownership_sha256(path):
    from mobius.boundary.ownership import sha256_of

    return sha256_of(path)


@pytest.mark.parametrize("what,change,said", [
    ("a short moment", lambda t: t.__setitem__(next(k for k in t if k.startswith("exp_avg/")), torch.zeros(1)),
     "is F32 of shape [1]; the model's is F32 of shape"),
    ("int32 weights", lambda t: t.__setitem__(next(k for k in t if not k.startswith(("exp_avg", "step/"))),
                                              torch.zeros(t[next(k for k in t if not k.startswith(("exp_avg", "step/")))].shape,
                                                          dtype=torch.int32)), "is I32 of shape"),
    ("a negative second moment", lambda t: t.__setitem__(next(k for k in t if k.startswith("exp_avg_sq/")),
                                                         -torch.ones_like(t[next(k for k in t if k.startswith("exp_avg_sq/"))])),
     "holds negative values"),
    ("a short generator state", lambda t: t.__setitem__("rng/torch_cpu", t["rng/torch_cpu"][:16].clone()),
     "a random generator's state is U8 of shape"),
])
def test_a_crafted_checkpoint_is_refused_in_one_line_before_anything_is_allocated(saved, capsys, what, change, said):
    files = {f.name for f in saved.iterdir()}
    target = {"int32 weights": "weights.safetensors", "a short generator state": "rng.safetensors"}.get(
        what, "optimizer.safetensors")
    assert target in files
    _rewrite(saved, target, change)
    code, err = run_cli(TINY + ["--backend", "single", "--steps", "4", "--resume", str(saved), "--resume-with-changes"],
                        capsys)
    assert code == 2 and len(err) == 1 and said in err[0], (what, err)


def test_an_output_file_is_created_only_where_absent_and_replaced_only_while_ours(tmp_path):
    """``mobius.rates --write FILE``'s write: a file that appears at FILE while the rates are
    measured, or replaces ours there, is left as it is and the write refused in one line."""
    from mobius.boundary.errors import InputError
    from mobius.boundary.ownership import is_our_file, write_output_file

    target = tmp_path / "box.json"
    write_output_file("--write", target, "one")
    assert target.read_text() == "one" and is_our_file(target)
    write_output_file("--write", target, "two")  # ours: replaced
    assert target.read_text() == "two" and is_our_file(target)
    target.write_text("the user's")  # replaced by the user's own file since
    with pytest.raises(InputError, match="not ours appeared there"):
        write_output_file("--write", target, "three")
    assert target.read_text() == "the user's"
    fresh = tmp_path / "new.json"

    def appears(src, dst):  # a file of the user's lands there between the check and the write
        fresh.write_text("theirs")
        return real_link(src, dst)

    real_link = os.link
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "link", appears)
        with pytest.raises(InputError, match="appeared there"):
            write_output_file("--write", fresh, "ours")
    assert fresh.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["box.json", "new.json"]
