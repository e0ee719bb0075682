"""The three backends, each in a module of its own behind one interface (:class:`Backend`), and
the run's choice between them: which one a run uses (``--backend``, or the topology's choice), which
options each takes, and what the rest of the run asks of it.

* :mod:`~mobius.backends.pipeline`: Mobius's pipeline, one worker per device (PCIe boxes);
* :mod:`~mobius.backends.chunked`: the chunk-based data-parallel engine (NVLink boxes);
* :mod:`~mobius.backends.single`: the reference trainer, plain PyTorch in the command's process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mobius.backends.chunked import check_chunked_options, launch_chunked
from mobius.backends.pipeline import check_pipeline_options, check_torchrun_options, launch_pipeline, torchrun_worker
from mobius.backends.single import check_single_options, train_single
from mobius.boundary.errors import InputError
from mobius.config import OPTIONS, SECTIONS, RunConfig, flag_name
from mobius.models import GPTConfig
from mobius.planning.prepare import Decided, decide, early_calibration, resolve_topology
from topology import Topology


@dataclass(frozen=True)
class Backend:
    name: str
    # Trains the run: (decided, model_config, data=(batches, held-out or None), inputs=the digests
    # checkpoints record) -> the history of StepMetrics.
    train: Callable
    in_workers: bool  # its steps run in worker processes, which map the command's one copy of the data
    replicated: bool  # it runs --data-parallel replicas
    options: str | None = None  # the configuration section of the options it alone takes
    # What it does not build, or cannot do on this machine, refused: (decided, model_config).
    check: Callable[[Decided, GPTConfig], None] | None = None
    emulates: bool = True  # --emulate rehearses it on CPU workers
    # This process as one of torchrun's workers: the options it refuses there (checked before
    # anything is probed), then the worker, given the run's decisions.
    torchrun_refusals: Callable[[RunConfig], None] | None = None
    under_torchrun: Callable[[Decided], None] | None = None
    # What it starts while the command reads the data: (decided, model_config) -> a context
    # within which that runs.
    meanwhile: Callable | None = None


BACKENDS = {
    "pipeline": Backend("pipeline", launch_pipeline, in_workers=True, replicated=True, options="pipeline",
                        check=check_pipeline_options, torchrun_refusals=check_torchrun_options,
                        under_torchrun=torchrun_worker, meanwhile=early_calibration),
    "chunked": Backend("chunked", launch_chunked, in_workers=True, replicated=False, options="chunked",
                       check=check_chunked_options),
    "single": Backend("single", train_single, in_workers=False, replicated=False, check=check_single_options,
                      emulates=False),
}


def resolve(cfg: RunConfig, topo: Topology | None = None, backend: str | None = None, here: bool = True) -> Decided:
    """Every decision of a run, once, before anything reads them (:class:`~mobius.planning.prepare.Decided`):
    its topology (``topo``, or the one ``--topology`` gives), its backend (``backend``, else
    ``--backend``, else the topology's choice; ``single`` needs no topology, but a bad one is still
    an error), and from them its devices, precision and replicas
    (:func:`~mobius.planning.prepare.decide`; ``here``: on this machine, else on the one the
    topology describes, as ``mobius.plan`` plans it).  ``mobius.train``, ``mobius.plan``, a torchrun
    worker and the scripts all decide through this."""
    topo = resolve_topology(cfg) if topo is None else topo
    name = backend or (topo.choose_backend()[0] if cfg.backend == "auto" else cfg.backend)
    chosen = BACKENDS[name]
    return decide(cfg, topo if chosen.in_workers else None, chosen.name, chosen.replicated, here)


def resolve_for_plan(cfg: RunConfig, topo: Topology | None = None) -> Decided:
    """The decisions ``mobius.plan`` plans from: the pipeline's, on the machine the topology
    describes (its GPUs, wherever the command runs)."""
    return resolve(cfg, topo, backend="pipeline", here=False)


def join_torchrun(cfg: RunConfig) -> bool:
    """Under torchrun: this process joins the run as one of its workers (True), or trains alone as
    without torchrun (False: the reference trainer in the command's process, ``--backend single``).
    Only the pipeline runs under torchrun."""
    asked = BACKENDS.get(cfg.backend)  # None: auto
    if asked is not None and not asked.in_workers:
        return False
    joins = BACKENDS["pipeline"] if asked is None else asked
    if joins.under_torchrun is None:
        raise InputError(f"under torchrun only the pipeline backend runs, not {joins.name}; start python -m "
                         "mobius.train directly for the others")
    joins.torchrun_refusals(cfg)
    joins.under_torchrun(resolve(cfg, backend=joins.name))
    return True


def check_options(decided: Decided, model_config: GPTConfig) -> None:
    """Options that the run's backend would ignore, or that it does not build, are refused, naming
    the backend they need; then its own checks (:attr:`Backend.check`)."""
    cfg, backend = decided.cfg, BACKENDS[decided.backend]
    flag = {"prefetch": "--no-prefetch", "chunk_prefetch": "--no-chunk-prefetch"}
    if cfg.emulation.enabled and not backend.emulates:
        raise InputError(f"--emulate is built for --backend pipeline and chunked, not {backend.name}")
    for owner in BACKENDS.values():
        if owner is backend or owner.options is None:
            continue
        default = SECTIONS[owner.options]()
        given = [flag.get(option, flag_name(option)) for option, (section, attr) in OPTIONS.items()
                 if section == owner.options and getattr(getattr(cfg, section), attr) != getattr(default, attr)]
        if given:
            raise InputError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --backend "
                             f"{owner.name}, and this run uses --backend {backend.name}")
    if backend.check is not None:
        backend.check(decided, model_config)


def resolved(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what the run decides from the machine: the backend, the precision, the replicas
    (``--print-config``)."""
    decided = resolve(cfg)
    replicas = {"data_parallel": decided.replicas} if BACKENDS[decided.backend].replicated else {}
    return decided.cfg.changed(backend=decided.backend, **replicas)
