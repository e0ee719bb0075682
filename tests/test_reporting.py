"""--report-to: TensorBoard, Weights & Biases and MLflow get the same scalars at the same steps as
the metrics file, offline, in their places under --report-dir and nowhere else."""

import json
import sys
import types

import pytest
from conftest import SINGLE, one_line_exit_2

from mobius.train import main as train_main



def run_args(tmp_path) -> list[str]:
    """A 3-step run evaluated after step 2 and at the end, writing its metrics file."""
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": f"note {i}: " + "the quick brown fox " * 8}) + "\n" for i in range(40)))
    return SINGLE + ["--steps", "3", "--data", str(data), "--eval-split", "0.2", "--eval-every", "2", "--metrics",
                     str(tmp_path / "m.jsonl")]


def losses_of(metrics_file) -> dict[int, float]:
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in open(metrics_file)}


def tensorboard_scalars(directory) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


class FakeWandb(types.ModuleType):
    """The part of wandb's API a run uses (init, Settings, Run.log, Run.finish), recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], {}, 0

    def Settings(self, **kwargs):
        return kwargs

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            id = kwargs.get("id") or f"w{len(fake.inits)}"

            def log(self, scalars, step):
                for tag, value in scalars.items():
                    fake.logged.setdefault(tag, {})[step] = value

            def finish(self):
                fake.finished += 1

        return Run()


def fake_mlflow(monkeypatch) -> dict:
    """mlflow.tracking.MlflowClient and mlflow.entities as a run uses them, recorded."""
    seen = {"metrics": {}, "params": {}, "terminated": 0, "uri": None, "created": 0, "resumed": []}

    class Client:
        def __init__(self, tracking_uri):
            seen["uri"] = tracking_uri

        def get_experiment_by_name(self, name):
            seen["experiment"] = name

        def create_experiment(self, name, artifact_location=None):
            seen["artifacts"] = artifact_location
            return "1"

        def create_run(self, experiment):
            seen["created"] += 1
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=f"r{seen['created']}"))

        def get_run(self, run_id):
            if run_id not in {f"r{k}" for k in range(1, seen["created"] + 1)}:
                raise LookupError(run_id)
            return types.SimpleNamespace(info=types.SimpleNamespace(experiment_id="1", lifecycle_stage="active"))

        def update_run(self, run_id, status):
            seen["resumed"].append((run_id, status))

        def log_batch(self, run_id, metrics=(), params=()):
            for m in metrics:
                seen["metrics"].setdefault(m.key, {})[m.step] = m.value
            seen["params"].update({p.key: p.value for p in params})

        def set_terminated(self, run_id):
            seen["terminated"] += 1

    mlflow, tracking, entities = (types.ModuleType(n) for n in ("mlflow", "mlflow.tracking", "mlflow.entities"))
    tracking.MlflowClient = Client
    entities.Metric = lambda key, value, timestamp, step: types.SimpleNamespace(key=key, value=value, step=step)
    entities.Param = lambda key, value: types.SimpleNamespace(key=key, value=value)
    mlflow.tracking, mlflow.entities = tracking, entities
    for name, module in (("mlflow", mlflow), ("mlflow.tracking", tracking), ("mlflow.entities", entities)):
        monkeypatch.setitem(sys.modules, name, module)
    return seen


def test_every_reporter_gets_the_same_scalars_at_the_same_steps(tmp_path, monkeypatch):
    """TensorBoard's events, and what wandb's and MLflow's APIs were given, hold the same scalars
    at the same steps, the loss equal to the metrics file's; wandb offline, MLflow in a local store
    under --report-dir, the run's settings recorded once."""
    pytest.importorskip("tensorboard")
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    mlflow = fake_mlflow(monkeypatch)
    monkeypatch.setattr("mobius.config.installed", lambda name: True)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reports = tmp_path / "reports"
    train_main(run_args(tmp_path) + ["--report-to", "tensorboard,wandb,mlflow", "--report-dir", str(reports)])
    board = tensorboard_scalars(reports / "tensorboard")
    assert board["train/loss"] == pytest.approx(losses_of(tmp_path / "m.jsonl"), rel=1e-6)
    assert set(board["eval/loss"]) == {2, 3} and set(board["train/lr"]) == {1, 2, 3}
    for logged in (wandb.logged, mlflow["metrics"]):
        assert set(logged) == set(board)
        for tag, values in board.items():
            assert logged[tag] == pytest.approx(values, rel=1e-6), tag
    (init,) = wandb.inits
    assert init["mode"] == "offline" and init["dir"] == str(reports) and init["config"]["steps"] == 3
    assert wandb.finished == 1 and mlflow["terminated"] == 1
    assert mlflow["uri"] == f"sqlite:///{(reports / 'mlruns' / 'mlflow.db').resolve()}"
    assert mlflow["artifacts"] == (reports / "mlruns" / "artifacts").resolve().as_uri()
    assert mlflow["params"]["lr"] == "0.001"
    assert "WANDB_CACHE_DIR" not in __import__("os").environ  # the run's own settings, given back


@pytest.mark.slow
def test_the_real_packages_write_offline_under_the_report_dir_only(tmp_path, monkeypatch):
    """wandb and MLflow themselves, each where installed: an offline wandb run and an MLflow run
    whose loss history is the metrics file's, both under --report-dir, MLflow's read back by its
    own client with no switch; nothing in the user's home, nothing in the working directory."""
    from mobius.config import installed

    names = [n for n in ("wandb", "mlflow", "sqlalchemy", "alembic") if installed(n)]
    names = [n for n in ("wandb", "mlflow") if n in names and (n != "mlflow" or len(names) >= 3)]
    if not names:
        pytest.skip("neither wandb nor mlflow (with SQLAlchemy and Alembic) is installed")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    reports = tmp_path / "reports"
    train_main(run_args(tmp_path) + ["--report-to", ",".join(names), "--report-dir", str(reports)])
    if "wandb" in names:
        assert len(list((reports / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    if "mlflow" in names:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{(reports / 'mlruns' / 'mlflow.db').resolve()}")
        (run,) = client.search_runs([client.get_experiment_by_name("mobius").experiment_id])
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
        assert history == pytest.approx(losses_of(tmp_path / "m.jsonl"), rel=1e-6)
    assert not any(home.iterdir()), list(home.rglob("*"))
    assert not any(work.iterdir()), list(work.rglob("*"))


@pytest.mark.parametrize("args,message", [
    (["--report-to", "wandb"], "--report-to needs --report-dir DIR"),
    (["--report-to", "comet", "--report-dir", "r"], "--report-to 'comet': give distinct names among tensorboard, "
                                                    "wandb, mlflow"),
    (["--report-dir", "r"], "--report-dir needs --report-to NAMES"),
    (["--report-to", "tensorboard", "--report-dir", "r", "--tensorboard", "tb"],
     "give --tensorboard DIR or --report-to tensorboard, not both"),
])
def test_bad_report_options_are_one_line(args, message, capsys):
    assert message in one_line_exit_2(train_main, SINGLE + args, capsys)


def test_a_missing_package_is_named_with_its_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("mobius.config.installed", lambda name: False)
    assert "--report-to mlflow needs the 'mlflow' package: pip install 'mobius-train[mlflow]'" in one_line_exit_2(
        train_main, SINGLE + ["--report-to", "mlflow", "--report-dir", str(tmp_path / "r")], capsys)
    # MLflow's local store is SQLite: without SQLAlchemy, refused naming it; a server needs none.
    monkeypatch.setattr("mobius.config.installed", lambda name: name != "sqlalchemy")
    assert "--report-to mlflow needs the 'sqlalchemy' package: pip install 'mobius-train[mlflow]'" in one_line_exit_2(
        train_main, SINGLE + ["--report-to", "mlflow", "--report-dir", str(tmp_path / "r")], capsys)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    from mobius.config import check_paths, parse_train_args

    check_paths(parse_train_args(SINGLE + ["--report-to", "mlflow", "--report-dir", str(tmp_path / "r")]))


@pytest.mark.slow
def test_a_tracking_server_that_does_not_answer_is_named_within_seconds(tmp_path, monkeypatch, capsys):
    """``MLFLOW_TRACKING_URI`` naming a server that accepts and never answers: the run stops in one
    line naming the server (MLflow's own retries would take minutes), and writes nothing."""
    pytest.importorskip("mlflow")
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        started = time.monotonic()
        with pytest.raises(SystemExit) as info:
            train_main(SINGLE + ["--steps", "1", "--report-to", "mlflow", "--report-dir", str(tmp_path / "r")])
        waited = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(err) == 1
    assert f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) did not answer" in err[0]
    assert not (tmp_path / "r").exists()
    print(f"refused after {waited:.1f} s")  # bounded by the timeouts set (2 tries of 5 s), not asserted


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """Stopped after step 2 and resumed: the same wandb run (its id, resume allowed) and the same
    MLflow run get steps 3 and 4; no second run is started."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    mlflow = fake_mlflow(monkeypatch)
    monkeypatch.setattr("mobius.config.installed", lambda name: True)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reports, ck = ["--report-to", "wandb,mlflow", "--report-dir", str(tmp_path / "r")], str(tmp_path / "ck")
    args = SINGLE + ["--steps", "4", "--seq-len", "16", "--no-progress"]
    train_main(args + reports + ["--save", ck, "--stop-after", "2"])
    train_main(["--resume", ck] + reports)
    assert mlflow["created"] == 1 and mlflow["resumed"] == [("r1", "RUNNING")]
    assert sorted(mlflow["metrics"]["train/loss"]) == [1, 2, 3, 4] and mlflow["terminated"] == 2
    first, again = wandb.inits
    assert "id" not in first and (again["id"], again["resume"]) == ("w1", "allow")
    assert sorted(wandb.logged["train/loss"]) == [1, 2, 3, 4]
