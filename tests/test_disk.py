"""The disk tier (--offload-dir): AdamW's moments and master weights through files give the bits they
give in memory, in process and on pipeline workers, across a resume between tiers; the plan places
them by the host memory; the files are the run's own."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import SINGLE, TINY, one_line_exit_2, reference

from mobius.backends import resolve, resolve_for_plan
from mobius.backends.pipeline import launch_pipeline
from mobius.boundary.errors import InputError, RunError
from mobius.config import RunConfig, parse_train_args
from mobius.metrics import Trace
from mobius.models import get_config
from mobius.planning.prepare import resolve_topology
from mobius.runtime.optim import UpdateRule
from mobius.swap.disk import BLOCKS_PER_STAGE, DiskState
from mobius.train import main as train_main


def _stores(tmp_path, drives: int, masters: list[int], weights: list[int] = ()):
    """The same four stages of ``tiny`` twice: with their state in memory, and through a disk tier
    (every stage's moments, ``masters``' master weights, ``weights``' compute weights, blocks of
    1,000 parameters striped over ``drives`` directories)."""
    from mobius.runtime.device import CpuDevice
    from mobius.swap.store import HostStageStore

    config, rule = get_config("tiny"), UpdateRule(lr=1e-2)
    bounds = [(0, 1), (1, 3), (3, 5), (5, 6)]
    directories = [tmp_path / f"nvme{k}" for k in range(drives)]
    for d in directories:
        d.mkdir(exist_ok=True)
    disk = DiskState(directories, 0, trace=Trace(enabled=True), masters=masters, weights=weights, block=1000)
    ours = HostStageStore(config, bounds, [0, 1, 2, 3], 0, rule, torch.float32, CpuDevice(), disk=disk)
    disk.attach(dict(ours.stages))
    theirs = HostStageStore(config, bounds, [0, 1, 2, 3], 0, rule, torch.float32, CpuDevice())
    return ours, theirs, disk, directories


@pytest.mark.slow
@pytest.mark.parametrize("drives", [1, 3])
def test_state_through_files_gives_the_bits_of_state_in_memory(tmp_path, drives):
    """Five AdamW updates of four stages, block by block (blocks cutting through parameters),
    every stage's moments and two stages' master weights through the files, clipped, one stage's
    update skipped once (as fp16's overflow skips a step): the compute copies the loads read, the
    master weights and the moments equal the same updates in memory, bit for bit; a checkpoint's
    view and a restore go through the files (a restored master rewrites the compute weights kept
    there, of stage 2); every transfer is a span on the trace's disk lanes; closing removes the files."""
    ours, theirs, disk, directories = _stores(tmp_path, drives, masters=[1, 2], weights=[2])

    def compute_copy(s: int) -> torch.Tensor:
        if not ours.stages[s].weights_on_disk:
            return ours.stages[s].compute_buffers[0]
        out = torch.empty(ours.stages[s].grad_staging.numel())
        disk.read_weights(s, out)
        return out

    try:
        assert [ours.stages[s].master.numel() == 0 for s in range(4)] == [False, True, True, False]
        g = torch.Generator().manual_seed(1)
        for step in range(5):
            for s in (3, 2, 1, 0):  # backward order
                mine, other = ours.stages[s], theirs.stages[s]
                grads = torch.randn(mine.grad_staging.numel(), generator=g)
                mine.grad_staging.copy_(grads)
                other.grad_staging.copy_(grads)
                other.attach_master_grads()
                apply = not (step == 1 and s == 1)
                disk.update(s, 1e-2, None, 0.5, mine.compute_buffers[0], apply=apply)
                if apply:
                    for p in other.master_params:
                        p.grad.mul_(0.5)
                    other.optimizer.step()
                    theirs.refresh_compute_copy(s)
                if not mine.master_on_disk:
                    ours.refresh_compute_copy(s)
                assert all(st == {} for st in mine.optimizer.state.values())  # the state is on disk
        assert [ours.stages[s].compute_buffers[0].numel() == 0 for s in range(4)] == [False, False, True, False]
        for s in range(4):
            assert torch.equal(compute_copy(s), theirs.stages[s].compute_buffers[0]), s
            with disk.present(s):
                mine, other = ours.stages[s], theirs.stages[s]
                for p, q in zip(mine.master_params, other.master_params):
                    assert torch.equal(p, q)
                    for key in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(mine.optimizer.state[p][key], other.optimizer.state[q][key]), key
            disk.loaded(s)
            for p in mine.master_params:
                mine.optimizer.state[p]["exp_avg"] = mine.optimizer.state[p]["exp_avg"] * 0 + 7.0  # a restore
            if s == 2:
                mine.master.fill_(3.0)
            disk.unload(s)
            with disk.present(s):
                assert all(torch.all(mine.optimizer.state[p]["exp_avg"] == 7.0) for p in mine.master_params)
        assert torch.all(compute_copy(2) == 3.0)
        assert disk.read_bytes > 0 and disk.written_bytes > 0
        lanes = {lane: sum(e["args"]["bytes"] for e in disk.trace.events if e["tid"] == lane)
                 for lane in ("disk read", "disk write")}
        assert lanes == {"disk read": disk.read_bytes, "disk write": disk.written_bytes}
        for d in directories:  # each drive holds its part of every stage's state, and the files' ledger
            assert sorted(p.name for p in d.iterdir()) == sorted(
                [f"rank000-stage000{s}.adam" for s in range(4)] + ["rank000-stage0002.weights",
                                                                   f".mobius-ledger-rank000-{os.getpid()}"])
        trained = {s: ours.stages[s].grad_staging.numel() for s in range(4)}
        assert sum(p.stat().st_size for d in directories for p in d.iterdir() if ".mobius-ledger" not in p.name) == 4 * sum(
            (3 if s in (1, 2) else 2) * n for s, n in trained.items()) + 4 * trained[2]
    finally:
        disk.close()
    assert all(list(d.iterdir()) == [] for d in directories)


def test_a_stage_is_striped_in_equal_contiguous_parts():
    from mobius.swap.disk import stripes

    assert stripes(10, 3) == [(0, 4), (4, 3), (7, 3)] and stripes(4, 1) == [(0, 4)] and stripes(2, 3)[2] == (2, 0)


def _killed_after_making(where, names) -> None:
    """A process that records ``names`` in its ledger in ``where``, makes them, and dies (its lock
    let go as a SIGKILL lets go of it)."""
    from mobius.boundary.ledger import FileLedger

    pid = os.fork()
    if pid == 0:
        try:
            ledger = FileLedger(where, "rank001")
            for name in names:
                os.write(ledger.create(name), b"left by a worker")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.adversarial
def test_files_a_dead_worker_left_are_removed_by_their_identity_never_by_name(tmp_path):
    """A worker killed before it closed its tier leaves its files: the run's janitor removes each
    one its ledger recorded while the name still leads to it; a file of the user's renamed over one
    of ours, or named like ours, stays; so does the directory then.  A later run on a directory a
    killed run left removes them first; one a live process holds is refused."""
    from mobius.boundary.ledger import FileLedger
    from mobius.boundary.ownership import working_dir
    from mobius.swap.disk import state_file_name

    where = tmp_path / "nvme"
    with working_dir("--offload-dir", where):
        _killed_after_making(where, [state_file_name(1, 3), state_file_name(1, 4)])
        (where / "notes.txt").write_text("the user's, made while the run lasted")
        os.replace(where / "notes.txt", where / state_file_name(1, 4))  # renamed over one of ours
        (where / state_file_name(2, 0)).write_text("the user's, named like ours")
    assert sorted(p.name for p in where.iterdir()) == [state_file_name(1, 4), state_file_name(2, 0)]
    assert (where / state_file_name(1, 4)).read_text() == "the user's, made while the run lasted"

    killed = tmp_path / "killed"
    killed.mkdir()
    _killed_after_making(killed, [state_file_name(0, 0)])
    with working_dir("--offload-dir", killed):  # not refused: what it holds is a dead run's
        assert list(killed.iterdir()) == []
    live = FileLedger(killed, "rank000")
    with pytest.raises(InputError, match="is in use by a running Mobius process"):
        with working_dir("--offload-dir", killed):
            pass
    live.close()
    assert list(killed.iterdir()) == []


# A process that makes files in DIR through its ledger, without end, until it is killed.
MAKER = """
import os, sys
from mobius.boundary.ledger import FileLedger
ledger = FileLedger(sys.argv[1], "rank000")
for i in range(10**9):
    try:
        fd = ledger.create(f"rank000-stage{i % 10000:04d}.adam")
    except FileExistsError:  # the user's, or ours not yet removed: never opened
        continue
    os.write(fd, b"moments" * 100)
    os.close(fd)
    if i % 3 == 0:
        ledger.remove(f"rank000-stage{i % 10000:04d}.adam")
"""


@pytest.mark.slow
@pytest.mark.adversarial
def test_a_process_killed_at_any_instant_leaves_nothing_and_changes_nothing_of_the_users(tmp_path):
    """SIGKILL, at a random instant in each of 20 tries, of a process making files in a directory the
    user named: its watcher removes what it made, ledger included; the user's files stay as they
    were.  (Files appear under their names only once recorded, the ledger only once locked.)"""
    import random
    import signal
    import subprocess
    import sys
    import time

    where = tmp_path / "nvme"
    where.mkdir()
    (where / "notes.txt").write_text("the user's")
    (where / "rank000-stage0009.adam").write_text("the user's, named like ours")
    mine = {p.name: p.read_bytes() for p in where.iterdir()}
    rng = random.Random(0)
    root = str(Path(__file__).parents[1])
    for _ in range(20):
        maker = subprocess.Popen([sys.executable, "-c", MAKER, str(where)], env={**os.environ, "PYTHONPATH": root})
        try:
            time.sleep(rng.uniform(0.0, 0.4))  # from before the ledger exists to deep into making files
        finally:
            maker.send_signal(signal.SIGKILL)
            maker.wait()
        for _ in range(600):  # the watcher polls for its parent's death every 0.2 s
            if {p.name for p in where.iterdir()} == set(mine):
                break
            time.sleep(0.05)
        assert {p.name: p.read_bytes() for p in where.iterdir()} == mine


def test_a_file_that_is_there_is_never_opened(tmp_path):
    (tmp_path / "nvme0").mkdir()
    (tmp_path / "nvme0" / "rank000-stage0001.adam").write_text("the user's")
    with pytest.raises(RunError, match="cannot create its files"):
        _stores(tmp_path, 1, masters=[])
    assert (tmp_path / "nvme0" / "rank000-stage0001.adam").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / "nvme0").iterdir()) == ["rank000-stage0001.adam"]


@pytest.mark.slow
def test_pipeline_workers_with_moments_on_disk_equal_the_reference_and_resume_across_tiers(tmp_path, capfd):
    """Two workers, every stage's moments on disk, clipped and with the optimizer lag: per-step
    losses and weights equal the reference trainer's; each worker read and wrote its moments; the
    directory is gone at the end.  A run saved with its moments on disk resumes without the disk
    tier, and one saved without resumes onto it, each ending equal to the reference."""
    cfg = RunConfig.of(model="tiny", topology="cpu", cpu_workers=2, stages=4, steps=4, micro_batch_size=2,
                       micro_batches=4, seq_len=32, lr=3e-3, progress=False, backend="pipeline",
                       device_optimizer="off", max_grad_norm=0.1, optimizer_lag=1, host_mem_gb=0,
                       offload_dir=(str(tmp_path / "nvme0"), str(tmp_path / "nvme1")))  # striped over two
    ref_losses, ref_weights = reference(cfg, precision="fp32", offload_dir=(), host_mem_gb=None)
    for d in cfg.offload_dir:
        Path(d).mkdir()
    history, weights, results = launch_pipeline(resolve(cfg, backend="pipeline"), get_config("tiny"),
                                                return_weights=True)
    assert [m.loss for m in history] == pytest.approx(ref_losses, rel=1e-5)
    for name, w in weights.items():
        assert torch.allclose(w, ref_weights[name], rtol=1e-5, atol=1e-7), name
    assert all(r.report.disk_bytes[0] > 0 and r.report.disk_bytes[1] > 0 for r in results.values())
    for d in cfg.offload_dir:
        assert list(Path(d).iterdir()) == []
        Path(d).rmdir()
    run = TINY + ["--backend", "pipeline", "--topology", "cpu", "--device-optimizer", "off", "--steps", "4",
                  "--optimizer-lag", "1"]
    straight, _ = reference(parse_train_args(run), precision="fp32")
    disk = ["--offload-dir", str(tmp_path / "nvme"), "--host-mem-gb", "0"]  # with the lag, the masters too
    for first, then, name in ((disk, [], "off-the-disk"), ([], disk, "onto-the-disk")):
        metrics = str(tmp_path / f"{name}.jsonl")
        for args, tier in ((run + first + ["--stop-after", "2", "--save", str(tmp_path / name), "--metrics", metrics],
                            first),
                           (["--resume", str(tmp_path / name), "--metrics", metrics, *then], then)):  # not inherited
            train_main(args)
            said = capfd.readouterr().out  # the header (the first worker's) says where the state waits
            assert ("on disk: AdamW's moments of stages" in said
                    and "the master weights of stages" in said) == bool(tier), said
        assert [json.loads(line)["loss"] for line in open(metrics)] == pytest.approx(straight, rel=1e-5), name
        assert not (tmp_path / "nvme").exists()  # made by the run, removed by it


def test_an_offload_dir_with_the_users_files_or_on_another_backend_is_refused(tmp_path, capsys):
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "notes.txt").write_text("mine")
    assert "--offload-dir" in one_line_exit_2(train_main, TINY + ["--backend", "pipeline", "--topology", "cpu",
                                                                  "--offload-dir", str(tmp_path / "nvme")], capsys)
    assert (tmp_path / "nvme" / "notes.txt").read_text() == "mine"
    message = one_line_exit_2(train_main, TINY + ["--backend", "pipeline", "--topology", "cpu", "--offload-dir",
                                                  str(tmp_path / "nvme")], capsys)
    assert "holds files Mobius did not write" in message
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in one_line_exit_2(train_main, TINY + ["--backend", "pipeline", "--topology", "cpu",
                                                                       "--offload-dir", str(tmp_path / "file")], capsys)
    assert "--offload-dir is built for --backend pipeline and single, not chunked" in one_line_exit_2(
        train_main, TINY + ["--backend", "chunked", "--topology", "cpu", "--offload-dir", str(tmp_path / "new")],
        capsys)
    assert "--backend single keeps every AdamW moment on disk" in one_line_exit_2(
        train_main, SINGLE + ["--offload-dir", str(tmp_path / "new"), "--host-mem-gb", "1"], capsys)
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_single_with_moments_on_disk_equals_the_reference_and_resumes_across_tiers(tmp_path, capsys, lag):
    """--backend single with --offload-dir, clipped, with and without the optimizer lag: every
    AdamW moment waits on disk (blocks of an eighth of the model, striped over two directories),
    and with the lag the master weights too (all of AdamW's state and the master: the model holds
    the weights it computes with); the per-step losses and final weights equal the reference
    trainer's in memory (fp32, 1e-6).  A run saved on the tier resumes off it, and one saved off it
    resumes onto it, each equal to the straight run; the files are gone at the end."""
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches, model_config_for

    drives = (str(tmp_path / "nvme0"), str(tmp_path / "nvme1"))
    cfg = RunConfig.of(model="tiny", backend="single", steps=4, micro_batch_size=2, micro_batches=2, seq_len=32,
                       lr=3e-3, progress=False, max_grad_norm=0.1, optimizer_lag=lag, precision="fp32",
                       offload_dir=drives)
    ref_losses, ref_weights = reference(cfg)
    for d in drives:
        Path(d).mkdir()
    trainer = ReferenceTrainer(cfg, model_config_for(cfg), make_batches(cfg, model_config_for(cfg)),
                               torch.device("cpu"))
    try:
        losses = [trainer.step(k).loss for k in range(4)]
        assert all(st == {} for st in trainer.optimizer.state.values())  # the moments are on disk
        assert all(p.numel() == 0 for p in trainer.master.values()) == bool(lag)  # and with the lag the master
        assert trainer.disk.read_bytes > 0 and trainer.disk.written_bytes > 0
        assert sum(len([f for f in Path(d).iterdir() if ".mobius-ledger" not in f.name]) for d in drives) == 2
        with trainer.optimizer_state():
            weights = {n: p.detach().clone() for n, p in trainer.master.items()}
    finally:
        trainer.close()
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert all(torch.allclose(p, ref_weights[n], rtol=1e-6, atol=1e-8) for n, p in weights.items())
    assert all(list(Path(d).iterdir()) == [] for d in drives)

    run = SINGLE + ["--steps", "4", "--optimizer-lag", str(lag), "--max-grad-norm", "0.1"]
    straight, _ = reference(parse_train_args(run))
    disk = ["--offload-dir", str(tmp_path / "nvme")]
    for first, then, name in ((disk, [], "off-the-disk"), ([], disk, "onto-the-disk")):
        metrics = str(tmp_path / f"{name}.jsonl")
        train_main(run + first + ["--stop-after", "2", "--save", str(tmp_path / name), "--metrics", metrics])
        train_main(["--resume", str(tmp_path / name), "--metrics", metrics, *then])
        said = capsys.readouterr().out
        assert ("on disk: AdamW's moments" in said) == bool(first or then)
        assert ("and the master weights" in said) == bool(lag and (first or then))
        assert [json.loads(line)["loss"] for line in open(metrics)] == pytest.approx(straight, rel=1e-6), name
        assert not (tmp_path / "nvme").exists()


@pytest.mark.slow
def test_the_plan_puts_as_many_stages_moments_on_disk_as_the_host_memory_takes(tmp_path, capsys):
    """``--host-mem-gb`` below what the run holds in memory: the largest host stages' moments go
    to disk until the rest fits (none where it fits; with 0 all the tier can take); the prediction
    charges their way through the drives, and the disk lane's floor is their bytes there and back."""
    from mobius.planning.pipeline import run_plan
    from mobius.planning.planner import host_bytes_needed
    from mobius.runtime.spec import Lane

    base = dict(model="small", topology="4x4090", micro_batch_size=1, micro_batches=8, seq_len=256,
                precision="bf16", progress=False, offload_dir=str(tmp_path / "nvme"), drive_gbps=("2",),
                device_optimizer="off")
    config = get_config("small")
    need = host_bytes_needed(config, "bf16") / 1e9
    plans = {}
    for name, host in (("all", 0), ("half", need * 0.75), ("fits", need * 2), ("masters", need * 0.5)):
        cfg = RunConfig.of(**base, host_mem_gb=host)
        plans[name] = run_plan(resolve_for_plan(cfg), config)
    host_stages = [j for j in range(len(plans["all"].bounds)) if j not in plans["all"].resident]
    assert plans["all"].disk_stages == host_stages and plans["fits"].disk_stages == []
    assert 0 < len(plans["half"].disk_stages) < len(host_stages)
    half = plans["half"]
    assert half.disk_bytes >= (need - need * 0.75) * 1e9  # at least what the host lacks
    assert half.lane_floor_s[Lane.DISK] == pytest.approx(half.disk_bytes / 2e9)  # read beside write
    assert plans["all"].predicted_step_s > plans["fits"].predicted_step_s
    assert Lane.DISK not in plans["fits"].lane_floor_s
    assert "disk tier: AdamW's moments of stages" in half.render() and not (tmp_path / "nvme").exists()
    assert half.disk_masters == []  # the moments were enough
    tied = {0, len(plans["all"].bounds) - 1} if config.tie_embeddings else set()
    assert plans["all"].disk_masters == [j for j in host_stages if j not in tied]  # 0: all the tier can take
    # Every stage's moments on disk free 8 of bf16's 20 host bytes a parameter: at 50%, the master
    # weights (and their fp32 gradients: 8 bytes more) of the largest stages go too.
    masters = plans["masters"]
    assert masters.disk_stages == host_stages and 0 < len(masters.disk_masters) < len(host_stages)
    params = {j: s.param_bytes // 2 for j, s in enumerate(masters.stages)}
    assert masters.disk_bytes == (sum(8 * params[j] for j in host_stages)
                                  + sum(4 * params[j] for j in masters.disk_masters))
    assert masters.predicted_step_s > half.predicted_step_s
    assert "disk, disk" in masters.render() and "host, disk" in masters.render()


def test_the_host_memory_is_the_machines_available_less_a_margin_unless_stated(monkeypatch):
    """Without --host-mem-gb, a run on this machine with the disk tier may use what it has
    available less 10%; a stated figure, or a planned box's own, stands."""
    from mobius.planning import prepare

    monkeypatch.setattr(prepare, "available_host_memory", lambda: 10 * 10**9)
    machine = dict(model="tiny", topology="cpu", offload_dir="nvme")
    assert resolve_topology(RunConfig.of(**machine)).host_memory_gb == pytest.approx(9.0)
    assert resolve_topology(RunConfig.of(**machine, host_mem_gb=4)).host_memory_gb == 4
    assert resolve_topology(RunConfig.of(model="tiny", topology="cpu")).host_memory_gb > 9.0  # no tier: untouched
    assert resolve_topology(RunConfig.of(model="tiny", topology="4x4090", offload_dir="nvme")).host_memory_gb == 1024


@pytest.mark.slow
def test_llama_8b_full_fine_tuning_plans_on_64_gb_and_one_drive(tmp_path):
    """Llama-3.1-8B, full fine-tuning in bf16 on the 4x4090 preset with 64 GB of host memory and
    one 7 GB/s drive (about 160 GB of state in memory; 96 GB with every moment on disk, and refused
    so where the master must stay in memory): planned, the master weights of the largest host
    stages on disk beside every host stage's moments."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from published_models import model_dir

    from mobius.planning.pipeline import run_plan
    from mobius.runtime.inputs import model_config_for

    with model_dir("Llama-3.1-8B") as path:
        base = dict(model=path, topology="4x4090", micro_batch_size=1, micro_batches=16, seq_len=2048,
                    precision="bf16", progress=False, offload_dir=str(tmp_path / "nvme"), drive_gbps=("7",))
        moments_only = RunConfig.of(**base, host_mem_gb=64, data_parallel=2)  # replicas keep the master in memory
        with pytest.raises(InputError, match="needs [0-9.]* GB of host memory"):
            run_plan(resolve_for_plan(moments_only), model_config_for(moments_only))
        cfg = RunConfig.of(**base, host_mem_gb=64)
        plan = run_plan(resolve_for_plan(cfg), model_config_for(cfg))
    assert plan.disk_masters and set(plan.disk_masters) <= set(plan.disk_stages)
    assert "tokens/s" in plan.render()


@pytest.mark.slow
def test_llama_70b_full_fine_tuning_plans_on_256_gb_and_two_drives_beside_zero_infinity():
    """Llama-3.1-70B, full fine-tuning in bf16 on 8x3090-4+4 with 256 GB of host memory and two
    7 GB/s drives (about 1.1 TB of state in memory): planned with every stage's moments and master
    weights on disk and the compute weights of some, the disk lane in its floor; ZeRO-Infinity's
    predicted step from the same figures beside it (scripts/plan_disk.py)."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from plan_disk import row

    from mobius.runtime.spec import Lane

    args = argparse.Namespace(micro_batches=16, seq_len=2048, mip_effort=4)
    r = row("Llama-3.1-70B", "8x3090-4+4", 256, ("7", "7"), args)
    host = r["host_stages"]
    assert r["moments_on_disk"] == r["masters_on_disk"] == host and 0 < r["weights_on_disk"] < host
    assert 700 < r["disk_gb"] < 1200 and r["disk_floor_s"] > 0
    assert "weights on disk" in r["plan"] and f"{Lane.DISK}" in r["plan"] and "tokens/s" in r["plan"]
    assert 0 < r["mobius_step_s"] < r["zero_infinity_step_s"]


@pytest.mark.parametrize("args,message", [
    (["--host-mem-gb", "8"], "--host-mem-gb and --drive-gbps plan the disk tier: they need --offload-dir DIR"),
    (["--offload-dir", "x", "--drive-gbps", "fast"], "--drive-gbps 'fast': give each drive's GB/s"),
    (["--offload-dir", "x", "--host-mem-gb", "0.0001"],
     "of host memory (gradients, the disk tier's buffers, what it cannot take of the AdamW state, master and "
     "compute weights), but 4x4090 has 0.0 GB"),
    (["--offload-dir", "x", "--drive-gbps", "7,7"],
     "--offload-dir names 1 directory, but the plan is given 2 drives (the topology's drives or --drive-gbps)"),
    (["--offload-dir", "x,y,./x"], "--offload-dir 'x,y,./x': give each directory once"),
])
def test_bad_disk_tier_settings_are_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from mobius.plan import main as plan_main

    assert message in one_line_exit_2(plan_main, ["--model", "small", "--topology", "4x4090", *args], capsys)
    assert list(tmp_path.iterdir()) == []


def test_drives_in_a_topology_file_round_trip(tmp_path):
    from topology import Drive, load_preset, load_topology_file

    box = load_preset("4x4090")
    box.drives = [Drive("nvme0", 7.0, 5.5), Drive("nvme1", 7.0, 5.5)]
    box.save(tmp_path / "box.json")
    assert load_topology_file(tmp_path / "box.json").drives == box.drives


def test_an_offload_dir_on_a_full_or_read_only_file_system_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """Its file system cannot hold the moments (statvfs says so), or cannot be written: one line,
    exit 2, nothing trained, nothing left (the directory the run made is gone again)."""
    import errno
    import os
    import types

    from mobius.boundary import ownership
    from mobius.swap import disk

    run = TINY + ["--backend", "pipeline", "--topology", "cpu", "--offload-dir", str(tmp_path / "nvme"),
                  "--metrics", str(tmp_path / "m.jsonl")]
    monkeypatch.setattr(disk.os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=10, f_frsize=4096))
    message = one_line_exit_2(train_main, run, capsys)
    assert "the optimizer's state takes up to 0.00 GB there, but its file system has 0.00 GB free" in message
    monkeypatch.undo()

    real_open = os.open

    def read_only(path, flags, mode=0o777, **kwargs):  # the offload directory's file system only
        if ".mobius-probe-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(ownership.os, "open", read_only)
    assert "cannot write there (Read-only file system)" in one_line_exit_2(train_main, run, capsys)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_drive_slower_than_stated_is_refused_before_training_and_one_as_fast_passes(tmp_path, capsys):
    """The drive under --offload-dir is timed through a file of the run's own where the plan is given
    drive rates: far below them, one line, exit 2, nothing trained and nothing left; at or above
    them the check passes and leaves the directory empty."""
    from mobius.swap.disk import check_offload_dir

    run = TINY + ["--backend", "pipeline", "--topology", "cpu", "--offload-dir", str(tmp_path / "nvme"),
                  "--drive-gbps", "9000", "--metrics", str(tmp_path / "m.jsonl")]
    message = one_line_exit_2(train_main, run, capsys)
    assert "its drive reads" in message and "but the plan was given 9000 and 9000 GB/s" in message
    assert list(tmp_path.iterdir()) == []
    slow = tmp_path / "slow"
    slow.mkdir()
    cfg = RunConfig.of(model="tiny", topology="cpu", offload_dir=str(slow), drive_gbps=("0.0001",))
    check_offload_dir(cfg, get_config("tiny"), resolve_topology(cfg))
    assert list(slow.iterdir()) == []


@pytest.mark.slow
def test_a_drive_not_stated_is_timed_and_planned_at_what_it_does(tmp_path, monkeypatch):
    """``--offload-dir`` without the drive's rates (no --drive-gbps, none in the topology): before
    training the drive is timed, and the plan takes it at those rates, by the name sysfs gives it
    (or its place), instead of an assumed 3.5 GB/s; nothing is left in the directory."""
    from mobius.planning.pipeline import run_plan
    from mobius.swap import disk

    monkeypatch.setattr(disk, "DRIVE_TIMING_BYTES", 8 * 2**20)
    cfg = RunConfig.of(model="small", topology="4x4090", micro_batch_size=1, micro_batches=8, seq_len=256,
                       precision="bf16", progress=False, device_optimizer="off", host_mem_gb=0,
                       offload_dir=(str(tmp_path),))
    topo = resolve_topology(cfg)
    assert topo.drives[0].assumed and topo.drive_gbps() == (3.5, 3.5)
    disk.check_offload_dir(cfg, get_config("small"), topo)
    (drive,) = topo.drives
    assert not drive.assumed and drive.read_gbps > 0 and drive.write_gbps > 0 and list(tmp_path.iterdir()) == []
    assert drive.name == (disk.drive_name(tmp_path.stat().st_dev) or "drive0")
    plan = run_plan(resolve_for_plan(cfg, topo), get_config("small"))
    assert plan.disk_gbps == (drive.read_gbps, drive.write_gbps)


@pytest.mark.slow
def test_each_directory_is_its_own_drive(tmp_path, capsys, monkeypatch):
    """Several directories stripe the moments over several drives: two on one file system are
    refused before training (one line, nothing left); each is timed against its own drive's stated
    rates; the plan counts one drive per directory (assumed ones where none is stated), so two
    halve the disk lane of one."""
    import os
    import tempfile

    from mobius.planning.pipeline import run_plan
    from mobius.runtime.spec import Lane
    from mobius.swap import disk

    run = TINY + ["--backend", "pipeline", "--topology", "cpu", "--metrics", str(tmp_path / "m.jsonl"),
                  "--offload-dir", f"{tmp_path / 'nvme0'},{tmp_path / 'nvme1'}"]
    assert "two of these directories are on one file system" in one_line_exit_2(train_main, run, capsys)
    assert list(tmp_path.iterdir()) == []

    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system to stand for a second drive")
    monkeypatch.setattr(disk, "DRIVE_TIMING_BYTES", 8 * 2**20)
    fast = tmp_path / "fast"
    fast.mkdir()
    slow = Path(tempfile.mkdtemp(dir=other, prefix="mobius-test-"))
    try:
        cfg = RunConfig.of(model="tiny", topology="cpu", offload_dir=(str(fast), str(slow)),
                           drive_gbps=("0.0001", "9000"))
        with pytest.raises(InputError, match=f"--offload-dir {slow}: its drive reads .* but the plan was given 9000"):
            disk.check_offload_dir(cfg, get_config("tiny"), resolve_topology(cfg))
        assert list(fast.iterdir()) == [] and list(slow.iterdir()) == []
    finally:
        slow.rmdir()

    base = dict(model="small", topology="4x4090", micro_batch_size=1, micro_batches=8, seq_len=256,
                precision="bf16", progress=False, device_optimizer="off", host_mem_gb=0)
    floors = [run_plan(resolve_for_plan(RunConfig.of(**base, offload_dir=dirs)),
                       get_config("small")).lane_floor_s[Lane.DISK]
              for dirs in (("a",), ("a", "b"))]
    assert floors[1] == pytest.approx(floors[0] / 2)


def _on_disk(masters_of, weights_of=lambda plan: []):
    """A plan change: every host stage's moments on disk, the master weights of
    ``masters_of(plan)``, and the compute weights of ``weights_of(plan)``."""
    import dataclasses

    def change(plan):
        host = [j for j in range(len(plan.bounds)) if j not in plan.resident]
        return dataclasses.replace(plan, disk_stages=host, disk_masters=masters_of(plan),
                                   disk_weights=weights_of(plan))
    return change


@pytest.mark.slow
@pytest.mark.parametrize("workers,lag", [(2, 0), (2, 1), (4, 1)])
def test_master_weights_and_moments_on_disk_equal_the_reference(tmp_path, workers, lag):
    """Every stage's moments and three of four stages' master weights on disk (the embedding's
    kept: 90% of AdamW's state and the master), two and four workers, the global norm clipped,
    with and without the optimizer lag: per-step losses and final weights equal the reference
    trainer's (fp32, 1e-6); the files are gone at the end."""
    from conftest import run_in_threads

    cfg = RunConfig.of(model="tiny", topology="cpu", cpu_workers=workers, stages=4, steps=4, micro_batch_size=2,
                       micro_batches=4, seq_len=32, lr=3e-3, progress=False, backend="pipeline",
                       device_optimizer="off", max_grad_norm=0.1, optimizer_lag=lag,
                       offload_dir=(str(tmp_path / "nvme0"),))
    Path(cfg.offload_dir[0]).mkdir()
    ref_losses, ref_weights = reference(cfg, precision="fp32", offload_dir=())
    placed = {}

    def masters(plan):
        placed["plan"] = plan
        return [1, 2, 3]

    losses, weights = run_in_threads(cfg, _on_disk(masters))
    sizes = [sum(p.numel() for name, p in ref_weights.items() if lo <= int(name.split(".")[1]) < hi)
             for lo, hi in placed["plan"].bounds]
    on_disk = 8 * sum(sizes) + 4 * sum(sizes[1:])  # every stage's moments, three stages' masters
    assert on_disk >= 0.7 * 12 * sum(sizes)  # 70% or more of the AdamW state and the master
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, w in weights.items():
        assert torch.allclose(w, ref_weights[name], rtol=1e-6, atol=1e-8), name
    assert list(Path(cfg.offload_dir[0]).iterdir()) == []


@pytest.mark.slow
def test_16_bit_master_weights_on_disk_give_the_bits_they_give_in_memory(tmp_path):
    """bf16 compute: a master on disk comes back with its fp32 gradients made in the update's
    buffer from the staged ones; losses and weights are those of the same run with everything in
    memory, bit for bit (clipped: the norm reads the staged gradients)."""
    from conftest import run_in_threads

    base = dict(model="tiny", topology="cpu", cpu_workers=2, stages=4, steps=3, micro_batch_size=2, micro_batches=2,
                seq_len=32, lr=3e-3, progress=False, backend="pipeline", device_optimizer="off", max_grad_norm=0.1,
                precision="bf16")
    memory_losses, memory_weights = run_in_threads(RunConfig.of(**base))
    (tmp_path / "nvme").mkdir()
    cfg = RunConfig.of(**base, offload_dir=(str(tmp_path / "nvme"),))
    losses, weights = run_in_threads(cfg, _on_disk(lambda plan: list(range(len(plan.bounds)))))
    assert losses == memory_losses
    assert all(torch.equal(w, memory_weights[n]) for n, w in weights.items())


@pytest.mark.slow
def test_worker_processes_with_stage_weights_on_disk_resume_with_the_bits_of_a_straight_run(tmp_path, capfd):
    """bf16 on two worker processes (four stages), every stage's moments, master and weights on disk
    (``--host-mem-gb 0``): saved at step 2 and resumed onto the tier (a restore rewrites the
    weights there from the master), the losses are those of a straight run in memory, bit for bit."""
    run = TINY + ["--backend", "pipeline", "--topology", "cpu", "--device-optimizer", "off", "--precision", "bf16",
                  "--stages", "4", "--steps", "4"]
    tier = ["--offload-dir", str(tmp_path / "nvme"), "--host-mem-gb", "0"]
    train_main(run + ["--metrics", str(tmp_path / "straight.jsonl")])
    train_main(run + tier + ["--stop-after", "2", "--save", str(tmp_path / "ck"),
                             "--metrics", str(tmp_path / "m.jsonl")])
    train_main(["--resume", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl"), *tier])
    assert capfd.readouterr().out.count("the compute weights of stages 0-3") == 2
    losses = {name: [json.loads(line)["loss"] for line in open(tmp_path / name)] for name in ("straight.jsonl", "m.jsonl")}
    assert len(losses["m.jsonl"]) == 4 and losses["m.jsonl"] == losses["straight.jsonl"]
    assert not (tmp_path / "nvme").exists()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_weights_on_disk_give_the_bits_they_give_in_memory(tmp_path, precision, monkeypatch):
    """Three of four stages with every state on disk and two of them with their compute weights
    there too (loaded through the staging buffer, written block by block by each update), striped
    over two directories, the global norm clipped: losses and weights are those of the run with
    everything in memory, bit for bit; a fp32 run also equals the reference trainer (1e-6); every
    load of those two stages read their weights from the files; the files are gone at the end."""
    import os

    from conftest import run_in_threads

    moved = []
    through = DiskState._weights_io
    monkeypatch.setattr(DiskState, "_weights_io", lambda self, call, s, start, values: (
        moved.append((s, call is os.pwritev)), through(self, call, s, start, values))[1])

    base = dict(model="tiny", topology="cpu", cpu_workers=2, stages=4, steps=3, micro_batch_size=2, micro_batches=2,
                seq_len=32, lr=3e-3, progress=False, backend="pipeline", device_optimizer="off", max_grad_norm=0.1,
                precision=precision)
    memory_losses, memory_weights = run_in_threads(RunConfig.of(**base))
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in drives:
        d.mkdir()
    cfg = RunConfig.of(**base, offload_dir=tuple(map(str, drives)))
    losses, weights = run_in_threads(cfg, _on_disk(lambda plan: [1, 2, 3], lambda plan: [1, 3]))
    assert losses == memory_losses
    assert all(torch.equal(w, memory_weights[n]) for n, w in weights.items())
    if precision == "fp32":
        ref_losses, ref_weights = reference(RunConfig.of(**base), precision="fp32")
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert all(torch.allclose(w, ref_weights[n], rtol=1e-6, atol=1e-8) for n, w in weights.items())
    # Stage 1 loads twice a step (forward, backward), stage 3 (the last) once; each written at its
    # park, then block by block by each of 3 updates.
    assert sorted(m for m in moved if not m[1]) == [(1, False)] * 6 + [(3, False)] * 3
    writes = {s: moved.count((s, True)) for s in (1, 3)}
    assert set(m for m in moved if m[1]) == {(1, True), (3, True)}
    assert all(n > 4 and n % 3 == 1 for n in writes.values()), writes  # several blocks an update
    assert max(writes.values()) == 1 + 3 * BLOCKS_PER_STAGE  # the worker's largest stage in its blocks
    assert all(list(d.iterdir()) == [] for d in drives)


def test_timing_a_drive_is_refused_before_writing_where_space_is_short(tmp_path, monkeypatch):
    """The timing file is never written into a drive's last bytes: with less than twice its size
    free, the timing is refused in one line and nothing is created."""
    from mobius.swap import disk

    real = os.statvfs

    class Full:
        def __init__(self, fs):
            self.f_frsize, self.f_bavail = fs.f_frsize, (3 * 2**20) // fs.f_frsize  # 3 MiB free

    monkeypatch.setattr(disk.os, "statvfs", lambda d: Full(real(d)))
    with pytest.raises(InputError, match="GB free"):
        disk.measure_drive(tmp_path, 2 * 2**20)
    assert list(tmp_path.iterdir()) == []
