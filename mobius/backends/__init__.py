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
from mobius.backends.pipeline import check_pipeline_options, launch_pipeline, torchrun_worker
from mobius.backends.single import check_single_options, train_single
from mobius.boundary.errors import InputError
from mobius.config import OPTIONS, SECTIONS, RunConfig, flag_name
from mobius.models import GPTConfig
from mobius.models.precision import use_fp16_accumulation
from mobius.planning.prepare import (data_parallel_of, early_calibration, resolve_devices, resolve_precision,
                                     resolve_topology)
from mobius.runtime.device import cuda_available
from topology import Topology


@dataclass(frozen=True)
class Backend:
    name: str
    # Trains the run: (cfg, model_config, topology or None, data=(batches, held-out or None),
    # inputs=the digests checkpoints record) -> the history of StepMetrics.
    train: Callable
    in_workers: bool  # its steps run in worker processes, which map the command's one copy of the data
    replicated: bool  # it runs --data-parallel replicas
    options: str | None = None  # the configuration section of the options it alone takes
    # What it does not build, or cannot do on this machine, refused: (cfg, model_config, topology or None).
    check: Callable[[RunConfig, GPTConfig, Topology | None], None] | None = None
    emulates: bool = True  # --emulate rehearses it on CPU workers
    under_torchrun: Callable[[RunConfig], None] | None = None  # this process as one of torchrun's workers
    # What it starts while the command reads the data: (cfg, model_config, topology) -> a context
    # within which that runs.
    meanwhile: Callable | None = None

    def replicas(self, cfg: RunConfig) -> int:
        return data_parallel_of(cfg) if self.replicated else 1


BACKENDS = {
    "pipeline": Backend("pipeline", launch_pipeline, in_workers=True, replicated=True, options="pipeline",
                        check=check_pipeline_options, under_torchrun=torchrun_worker, meanwhile=early_calibration),
    "chunked": Backend("chunked", launch_chunked, in_workers=True, replicated=False, options="chunked",
                       check=check_chunked_options),
    "single": Backend("single", train_single, in_workers=False, replicated=False, check=check_single_options,
                      emulates=False),
}


def resolve(cfg: RunConfig) -> tuple[RunConfig, Backend, Topology | None]:
    """What a run decides from the machine, once, before anything reads them: its topology, its
    backend (``--backend``, or the topology's choice; ``single`` needs no topology, but a bad one is
    still an error) and ``cfg`` with the precision it trains in
    (:func:`mobius.planning.prepare.resolve_precision`)."""
    topo = resolve_topology(cfg)
    backend = BACKENDS[topo.choose_backend()[0] if cfg.backend == "auto" else cfg.backend]
    topo = topo if backend.in_workers else None
    cuda = cuda_available() if topo is None else resolve_devices(topo, cfg.emulation.enabled)[0]
    precision = resolve_precision(cfg, cuda)
    if cfg.optim.fp16_accumulation:
        use_fp16_accumulation(cuda)
    return cfg.changed(precision=precision), backend, topo


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
    joins.under_torchrun(cfg)
    return True


def check_options(cfg: RunConfig, model_config: GPTConfig, backend: Backend, topo: Topology | None) -> None:
    """Options that ``backend`` would ignore, or that it does not build, are refused, naming the
    backend they need; then its own checks (:attr:`Backend.check`)."""
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
        backend.check(cfg, model_config, topo)


def resolved(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what the run decides from the machine: the backend, the precision, the replicas
    (``--print-config``)."""
    cfg, backend, _ = resolve(cfg)
    replicas = {"data_parallel": backend.replicas(cfg)} if backend.replicated else {}
    return cfg.changed(backend=backend.name, **replicas)
