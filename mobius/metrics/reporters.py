"""Where a run's scalars go besides ``--metrics``: TensorBoard (``--tensorboard DIR``, or
``--report-to tensorboard``), Weights & Biases and MLflow (``--report-to wandb,mlflow``), each the
same scalars (:func:`scalars_of`) at the same steps, each in its own place under ``--report-dir``.

Offline by default, so a run needs no network and no account: wandb writes an offline run under
``DIR/wandb`` (``wandb sync`` uploads it later) unless ``WANDB_MODE`` says otherwise, with its
cache, configuration and data directories there too, never in the user's home; MLflow logs into a
local store at ``DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` names another.  Every reporter adds a
new run beside what its directory holds and never replaces one."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from mobius.boundary.errors import RunError, first_line
from mobius.boundary.ownership import writing
from mobius.metrics import StepMetrics


def scalars_of(m: StepMetrics) -> dict[str, float]:
    """The scalars every reporter gets for one step (``m``)."""
    scalars = {"train/loss": m.loss, "train/lr": m.lr, "perf/step_time_s": m.step_time_s,
               "perf/tokens_per_s": m.tokens / max(m.step_time_s, 1e-9),
               "perf/peak_device_mib": m.peak_device_bytes / 2**20}
    if m.emulated_step_s is not None:
        scalars["perf/emulated_step_s"] = m.emulated_step_s
    if m.eval_loss is not None:
        scalars.update({"eval/loss": m.eval_loss, "eval/perplexity": m.eval_perplexity})
    if m.grad_norm is not None:
        scalars["train/grad_norm"] = m.grad_norm
    scalars.update({f"train/{name}": value for name, value in (m.preference or {}).items()})
    scalars.update({f"eval/{name}": value for name, value in (m.eval_preference or {}).items()})
    return scalars


@contextlib.contextmanager
def environment(**values: str):
    """``values`` set in the environment for as long as this lasts, where the user set nothing."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class TensorBoardLog:
    """TensorBoard events (torch's ``SummaryWriter``): a new event file in ``directory``."""

    option = "--tensorboard"

    def __init__(self, directory: Path, settings: dict):
        from torch.utils.tensorboard import SummaryWriter  # needs the 'tensorboard' package

        self.directory = directory
        with writing(self.option, directory):
            self.writer = SummaryWriter(str(directory))
        _quiet_writer_threads()

    def log(self, scalars: dict[str, float], step: int) -> None:
        with writing(self.option, self.directory):
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        with writing(self.option, self.directory):
            self.writer.close()


class WandbLog:
    """A Weights & Biases run, offline unless ``WANDB_MODE`` says otherwise; the run's settings as
    its config."""

    option = "--report-to wandb"

    def __init__(self, directory: Path, settings: dict, run_id: str | None = None):
        import wandb

        self.directory = directory
        own = {"WANDB_CACHE_DIR": directory / ".cache", "WANDB_CONFIG_DIR": directory / ".config",
               "WANDB_DATA_DIR": directory / ".data", "WANDB_ARTIFACT_DIR": directory / ".artifacts"}
        with contextlib.ExitStack() as settings_here:  # undone if the run does not start
            settings_here.enter_context(environment(**{k: str(v) for k, v in own.items()}))
            with writing(self.option, directory):
                directory.mkdir(parents=True, exist_ok=True)
                # A resumed run continues its wandb run (its id, resumed where wandb has it).
                resumed = {"id": run_id, "resume": "allow"} if run_id else {}
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mobius"), dir=str(directory.parent),
                                      mode=os.environ.get("WANDB_MODE", "offline"), config=settings,
                                      settings=wandb.Settings(silent=True, disable_git=True, save_code=False,
                                                              console="off"), **resumed)
            self._environment = settings_here.pop_all()  # the run's for as long as it lasts: close() ends it
        self.run_id = self.run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        with writing(self.option, self.directory):
            self.run.log(scalars, step=step)

    def close(self) -> None:
        try:
            with writing(self.option, self.directory):
                self.run.finish()
        finally:
            self._environment.close()


@contextlib.contextmanager
def _database_setup_quiet():
    """MLflow says at INFO, on stderr, each step of making its database's tables: not the run's news."""
    import logging

    loggers = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class MlflowLog:
    """An MLflow run in experiment ``MLFLOW_EXPERIMENT_NAME`` (``mobius``), in a local store under
    ``directory`` unless ``MLFLOW_TRACKING_URI`` is set; the run's settings as its parameters.
    The local store is MLflow's SQLite database, ``directory/mlflow.db`` (``mlflow ui
    --backend-store-uri sqlite:///DIR/mlflow.db``): MLflow 3 keeps its store of plain files in
    maintenance mode, read only with ``MLFLOW_ALLOW_FILE_STORE``."""

    option = "--report-to mlflow"
    PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch

    def __init__(self, directory: Path, settings: dict, run_id: str | None = None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.directory = directory
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        database = directory.resolve() / "mlflow.db"
        self.uri = uri = f"sqlite:///{database}" if local else os.environ["MLFLOW_TRACKING_URI"]
        # A tracking server that does not answer is said within seconds, naming it, from this
        # process: MLflow's own retries (7, backing off to minutes) would outlast the other workers'
        # collectives, whose timeout would then be blamed.  The user's settings win.
        with contextlib.ExitStack() as settings_here:  # undone if the run does not start
            settings_here.enter_context(environment(MLFLOW_HTTP_REQUEST_MAX_RETRIES="1",
                                                    MLFLOW_HTTP_REQUEST_TIMEOUT="5",
                                                    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1"))
            with writing(self.option, directory), self._served(), _database_setup_quiet():
                if local:
                    directory.mkdir(parents=True, exist_ok=True)
                self.client = MlflowClient(tracking_uri=uri)
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mobius")
                found = self.client.get_experiment_by_name(name)
                # (a local store's artifacts beside its database: MLflow's default is ./mlruns, in
                # whatever directory the run was started from)
                experiment = found.experiment_id if found else self.client.create_experiment(
                    name, artifact_location=(directory.resolve() / "artifacts").as_uri() if local else None)
                if run_id and self._exists(run_id, experiment):  # a resumed run continues its MLflow run
                    self.run_id = run_id
                    self.client.update_run(run_id, status="RUNNING")
                else:
                    self.run_id = self.client.create_run(experiment).info.run_id
                    params = [Param(k, str(v)[:6000]) for k, v in settings.items() if v is not None]
                    for i in range(0, len(params), self.PARAMS_PER_BATCH):
                        self.client.log_batch(self.run_id, params=params[i:i + self.PARAMS_PER_BATCH])
            self._environment = settings_here.pop_all()  # the run's for as long as it lasts: close() ends it

    def _exists(self, run_id: str, experiment: str) -> bool:
        """The run ``run_id`` is in this store's experiment, and not deleted (another store, or an
        experiment of another name, starts a new run)."""
        try:
            run = self.client.get_run(run_id)
        except Exception:  # MLflow's "not found", whatever its type
            return False
        return run.info.experiment_id == experiment and run.info.lifecycle_stage != "deleted"

    @contextlib.contextmanager
    def _served(self):
        """What the tracking store refuses, said naming it (a remote server's URI)."""
        try:
            yield
        except RunError:
            raise
        except Exception as err:  # MLflow raises its own types and requests' for a server that does not answer
            if self.uri.startswith(("http://", "https://")):
                raise RunError(f"{self.option}: the MLflow tracking server {self.uri} (MLFLOW_TRACKING_URI) did not "
                               f"answer, or refused: {type(err).__name__}: {first_line(err, 160)}") from None
            raise

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with writing(self.option, self.directory), self._served():
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        try:
            with writing(self.option, self.directory), self._served():
                self.client.set_terminated(self.run_id)
        finally:
            self._environment.close()


# Each reporter and the directory it takes under --report-dir.
REPORTER_CLASSES = {"tensorboard": (TensorBoardLog, "tensorboard"), "wandb": (WandbLog, "wandb"),
                    "mlflow": (MlflowLog, "mlruns")}


class Reports:
    """Every reporter the run asked for, given the same scalars after each step.  A reporter whose
    write failed (disk full) is said once, in the training loop's error line, and not written again."""

    def __init__(self, reporters: list, names: list[str] | None = None):
        self.reporters = reporters
        self.names = names or [""] * len(reporters)
        self.failed: set[int] = set()

    def runs(self) -> dict[str, str]:
        """Each tracker's run, by tracker: what a checkpoint keeps for a resume to continue."""
        return {name: r.run_id for name, r in zip(self.names, self.reporters) if getattr(r, "run_id", None)}

    def write(self, m: StepMetrics) -> None:
        scalars = scalars_of(m)
        for i, reporter in enumerate(self.reporters):
            if i in self.failed:
                continue
            self.failed.add(i)  # until the write is through: the error it raises is said once
            reporter.log(scalars, m.step + 1)
            self.failed.discard(i)

    def close(self) -> None:
        errors = []
        for i, reporter in enumerate(self.reporters):
            try:
                reporter.close()
            except Exception as err:  # every reporter is closed; the first failure not yet said is raised
                if i not in self.failed:
                    errors.append(err)
        if errors:
            raise errors[0]


def open_reports(outputs, settings: dict, runs: dict[str, str] | None = None) -> Reports:
    """The reporters of ``outputs`` (an :class:`~mobius.config.OutputConfig`), opened; ``settings``:
    the run's options, for the reporters that record them; ``runs``: the trackers' runs to continue
    (a resumed checkpoint's, :meth:`Reports.runs`)."""
    reporters, names = [], []
    try:
        if outputs.tensorboard:
            reporters.append(TensorBoardLog(Path(outputs.tensorboard), settings))
            names.append("tensorboard")
        for name in outputs.report_to:
            kind, place = REPORTER_CLASSES[name]
            try:
                directory = Path(outputs.report_dir) / place
                reporters.append(kind(directory, settings, (runs or {}).get(name)) if name != "tensorboard"
                                 else kind(directory, settings))
                names.append(name)
            except RunError:
                raise
            except Exception as err:  # the package's own refusal (a tracking server that does not answer)
                raise RunError(f"{kind.option}: {type(err).__name__}: {first_line(err, 200)}") from None
    except BaseException:
        Reports(reporters).close()
        raise
    return Reports(reporters, names)


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk) and Python prints its
    traceback; the same failure reaches the training loop at the next flush, which says it in one
    line.  Exceptions of those threads are not printed a second time; every other thread's are."""
    if getattr(threading.excepthook, "mobius_quiet", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.mobius_quiet = True
    threading.excepthook = hook
