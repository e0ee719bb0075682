import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))  # make_tiny_chat_model

import atexit  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# The suite's own caches, made fresh for each run and removed after it: nothing under the user's
# home is read or written, and no measurement an earlier run left (a runtime calibration taken on
# a busy machine, say) decides a test.  Set before anything imports mobius (mobius.boundary.cache
# reads it at each use); worker processes inherit it, and so do the test processes pytest-xdist
# starts, which share what one of them measured (a calibration costs 20 CPU-seconds).
_SCRATCH = os.environ.get("MOBIUS_TEST_SCRATCH") if os.environ.get("PYTEST_XDIST_WORKER") else None
if _SCRATCH is None or not os.path.isdir(_SCRATCH):  # this run's first (or only) test process
    _SCRATCH = os.environ["MOBIUS_TEST_SCRATCH"] = tempfile.mkdtemp(prefix="mobius-tests-")
    _OWNER = os.getpid()  # a forked child exiting through atexit must not remove it under the suite
    atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(_SCRATCH, ignore_errors=True))
os.environ["MOBIUS_CACHE"] = os.path.join(_SCRATCH, "mobius")
os.environ["HF_HOME"] = os.path.join(_SCRATCH, "huggingface")
os.environ["XDG_CACHE_HOME"] = os.path.join(_SCRATCH, "cache")
os.environ["MPLCONFIGDIR"] = os.path.join(_SCRATCH, "matplotlib")

# Every run in the tests goes through the stream-order checker of the CPU device layer
# (mobius.runtime.device), pipeline workers included (they inherit the environment).
os.environ.setdefault("MOBIUS_CHECK_STREAMS", "1")

# Test processes side by side share the cores: each computes on its share (set before torch is
# imported; commands the tests start inherit it, and pipeline workers set their own).  torch's
# default, a thread per core in each process, had the threads of one spin while another held
# the cores: a fine-tuning test took 28 CPU-seconds on two threads, 16 on one, in the same time.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


# How long a test waits for a process it started before taking it for hung: a guard, not a
# deadline (a machine kept busy by others runs the suite at a fraction of its quiet speed, and the
# emulated clock of a run is chosen from measurements taken under that load); below CI's limit.
HANG_S = 3000


def pytest_xdist_auto_num_workers(config) -> int:
    """How many test processes ``-n auto`` (pyproject.toml's default) starts: two for a run with the
    slow tests, which mostly wait (on worker processes starting, emulated GPUs, a solver; the whole
    suite measured 10 to 16 minutes on two, 20 on one); none beside this one for ``-m "not slow"``,
    whose tests compute in this process (128 s on two, 65 s here)."""
    return 0 if "not slow" in (config.option.markexpr or "") else 2


def fault_env(fault: str) -> dict[str, str]:
    """What a run's environment adds so that its workers fail as ``fault`` says (``RANK:STEP``: that
    worker is killed in that step; ``start``: every worker is held before training starts), by
    ``tests/faults/sitecustomize.py``: the product has no fault hook."""
    faults = str(Path(__file__).parent / "faults")
    return {"MOBIUS_FAULT": fault, "PYTHONPATH": os.pathsep.join(p for p in (faults, os.environ.get("PYTHONPATH")) if p)}


# A two-step run of the tiny preset, and the same on the single backend (command-line arguments).
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2", "--no-progress"]
SINGLE = TINY + ["--backend", "single"]


def save_hf_model(model, directory) -> str:
    """A ``transformers`` model saved as a Hugging Face directory with a byte-level tokenizer
    (ids 0-255 are the bytes): what a user's model directory holds."""
    from make_tiny_chat_model import byte_tokenizer

    model.save_pretrained(str(directory))
    byte_tokenizer().save(str(Path(directory) / "tokenizer.json"))
    return str(directory)


def one_line_exit_2(command, argv, capsys) -> str:
    """``command(argv)`` refuses with one line on stderr, ``error: ...``, and exit status 2."""
    import pytest

    with pytest.raises(SystemExit) as info:
        command(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (info.value.code, err)
    return err[0]


def reference(cfg, device: str = "cpu", **changes):
    """What every backend must reproduce: the single-device reference trainer (plain PyTorch) on
    ``cfg``'s model and data, with ``changes`` (e.g. ``precision="fp32"``): its per-step losses
    and the final master weights of every parameter (with ``--optimizer-lag``, the updated ones)."""
    import torch

    from mobius.config import RunConfig
    from mobius.reference import ReferenceTrainer
    from mobius.runtime.inputs import make_batches, model_config_for

    ref_cfg = RunConfig.from_dict({**cfg.to_dict(), "backend": "single", "precision": cfg.optim.precision or "fp32",
                                   "offload_dir": (), "host_mem_gb": None, "drive_gbps": (), **changes})
    model_config = model_config_for(ref_cfg)
    trainer = ReferenceTrainer(ref_cfg, model_config, make_batches(ref_cfg, model_config), torch.device(device))
    losses = [trainer.step(k).loss for k in range(ref_cfg.optim.steps)]
    return losses, {n: p.detach().clone() for n, p in trainer.master.items()}


def run_in_threads(cfg, plan_change=None, workers_out: list | None = None):
    """The pipeline of ``cfg`` in this process, one thread per worker linked by an in-process
    transport, every stream under the order checker: per-step losses and final weights.
    ``plan_change``: what the plan becomes before it runs (a test's placement); ``workers_out``
    gets each worker's parts (closed), by rank."""
    import dataclasses
    import threading

    from mobius.backends import resolve
    from mobius.metrics import Trace
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.runtime.device import CpuDevice
    from mobius.runtime.inputs import make_data, model_config_for
    from mobius.runtime.inputs import check_model_input
    from mobius.stages.transport import LocalGroup, on_threads
    from mobius.stages.worker import build_worker

    spec, plan = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    if plan_change is not None:
        plan = plan_change(plan)
        spec = dataclasses.replace(spec, setup=dataclasses.replace(spec.setup, plan=plan))
    data = make_data(cfg, model_config_for(cfg))  # made once, as the launcher does, and shared
    group = LocalGroup(cfg.cpu_workers)
    results: dict[int, tuple] = {}
    building = threading.Lock()  # layers are initialised through torch's global generator

    def worker(rank: int) -> None:
        with building:
            parts = build_worker(cfg, spec, group.endpoint(rank), CpuDevice(check=True), Trace(enabled=False), data)
        try:
            sums = [parts.runner.step(k) for k in range(cfg.optim.steps)]
            parts.runner.drain()  # every update in the host store (resident stages' too)
            weights = parts.weights()
        finally:
            parts.close()
        results[rank] = (sums, weights)
        if workers_out is not None:
            workers_out.append((rank, parts))

    on_threads(worker, range(cfg.cpu_workers))
    losses = [sum(results[r][0][k] for r in results) for k in range(cfg.optim.steps)]  # the last stage's worker has it
    weights = {n: w for r in results for n, w in results[r][1].items()}
    if cfg.pipeline.stages is not None:
        assert len(plan.bounds) == cfg.pipeline.stages
    return losses, weights


def tagged(tag: str) -> list[str]:
    """Processes (a run's and their children) whose environment carries ``tag``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if tag.encode() in (proc / "environ").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


def none_left(tag: str, within: float = 600) -> bool:
    """No process carrying ``tag``, once the ones ending have had time to end (a bound for a busy
    machine, not what a test asserts)."""
    import time

    t0 = time.monotonic()
    while tagged(tag) and time.monotonic() - t0 < within:
        time.sleep(0.2)
    return not tagged(tag)


@contextlib.contextmanager
def host_rate_cached(params_per_s: float, workers: int):
    """A host AdamW rate for this machine as a run on it would have kept it
    (:mod:`mobius.runtime.plan_check`), for the plans made inside the block."""
    from mobius.planning.prepare import this_host_key
    from mobius.runtime.plan_check import HOST_RATES

    key = this_host_key(workers)
    HOST_RATES.put(key, {"adam_params_per_s": params_per_s})
    try:
        yield
    finally:
        HOST_RATES.path(key).unlink(missing_ok=True)
