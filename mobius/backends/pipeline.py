"""The pipeline backend (Mobius): the plan made, the header that describes it, one worker per
device (or per device of every replica) launched, and the exports finished; under torchrun, rank
0's decision that every node follows."""

from __future__ import annotations

import os
from pathlib import Path

from mobius.boundary.errors import InputError, shown
from mobius.config import RunConfig
from mobius.data.preference import PreferenceBatches
from mobius.launcher import devices_text, launch_workers, start_worker_server
from mobius.metrics import seconds_text
from mobius.models import GPTConfig, build_model
from mobius.models.adapters import finish_export
from mobius.models.hf import start_export
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.planner import pcie_bps
from mobius.planning.prepare import Decided
from mobius.planning.replan import Replanner
from mobius.runtime.inputs import check_model_input
from mobius.runtime.optim import UpdateRule
from mobius.runtime.spec import Plan, RunSpec
from mobius.runtime.worker import Decision, WorkerPayload
from mobius.stages import dispatch_worker
from mobius.stages.dispatch import check_dispatched
from mobius.stages import worker as pipeline_worker
from mobius.swap.disk import check_offload_dir
from topology import Topology


def launch_pipeline(decided: Decided, model_config: GPTConfig, return_weights: bool = False,
                    inputs: dict[str, str] | None = None, data: tuple | None = None):
    """The run ``decided`` (:func:`mobius.backends.resolve`) on the pipeline; ``inputs``: the digests
    the run's checkpoints record (:func:`mobius.runtime.checkpoint.input_digests`); ``data``: the
    run's training and held-out batches, made here and shared with the workers (None: each worker
    makes them)."""
    cfg, topo = decided.cfg, decided.topology
    spec, plan = prepare_pipeline(decided, model_config, profiled=start_worker_server)
    header = pipeline_header(cfg, model_config, topo, spec) + reference_pass_text(plan, topo, data)
    # Each worker writes its stages' tensors into the staging directory of each export.
    wanted = cfg.outputs.exports()
    exports = [(str(start_export(out, cfg.data.chat_template)), merged) for _, out, merged in wanted]
    replan = Replanner(decided, model_config) if cfg.pipeline.replan == "auto" else None
    payload = WorkerPayload(cfg, spec, header, inputs, exports, return_weights, replan=replan)
    pipe = spec.setup
    if pipe.dispatched is not None:  # one process drives every GPU of a box
        boxes = pipe.data_parallel
        print(f"starting {boxes} worker process{'es' if boxes > 1 else ''} for {topo.n} {devices_text(spec)}"
              + (" each" if boxes > 1 else ""), flush=True)
        results = launch_workers(boxes, dispatch_worker.worker_main, payload, data, emulated_gpus=topo.n * boxes)
    else:
        print(f"starting {topo.n * pipe.data_parallel} worker processes", flush=True)
        results = launch_workers(topo.n * pipe.data_parallel, pipeline_worker.worker_main, payload, data)
    for (_, out, merged), (staging, _) in zip(wanted, exports):
        finish_export(model_config, Path(staging), out, merged)
        print(f"exported to {shown(out)}", flush=True)
    history = results[0].history
    if return_weights:
        weights = {}
        for r in results.values():
            weights.update(r.weights)
        return history, weights, results
    return history


def check_pipeline_options(decided: Decided, model_config: GPTConfig) -> None:
    """What the pipeline does not build, or this machine cannot do for it, refused before the data
    is read: the ``--offload-dir`` drive included (:func:`~mobius.swap.disk.check_offload_dir`)."""
    cfg = decided.cfg
    if cfg.lora.load_in_4bit:
        raise InputError("--load-in-4bit is built for --backend single: the pipeline's stage stores hold 16- and "
                         "32-bit weights")
    if cfg.pipeline.schedule == "dispatched":
        check_dispatched(cfg)
    check_offload_dir(cfg, model_config, decided.topology)


def pipeline_header(cfg: RunConfig, model_config: GPTConfig, topo: Topology, spec: RunSpec) -> str:
    """The run's first line: where it runs, the model, the plan and its prediction."""
    pipe = spec.setup
    plan = pipe.plan
    n_params = build_model(model_config, device="meta").num_parameters()
    emulating = f", {spec.emulation.header(spec.predicted_step_s(), cfg.optim.steps)}" if spec.emulation else ""
    replicas = f" x {pipe.data_parallel} replicas (ZeRO-1 host AdamW)" if pipe.data_parallel > 1 else ""
    if pipe.dispatched is not None:
        shape = f"schedule dispatched: {pipe.dispatched.describe()}, "
    else:
        shape = (f"{len(plan.bounds)} stages ({plan.partitioner}"
                 + (f"; {len(plan.resident)} resident, updated on their devices" if plan.resident else "") + "), "
                 f"mapping {plan.order}, ")
    return (f"mobius: backend pipeline on {topo.n} {devices_text(spec)}{replicas}{emulating} ({topo.name}), "
            f"model {cfg.model} ({n_params / 1e6:.1f}M parameters), {shape}{cfg.batch.describe()}, "
            f"{spec.precision}, recompute {'on' if pipe.dispatched is not None else plan.recompute_text()}, "
            f"predicted {seconds_text(spec.predicted_step_s())}/step" + (" (emulated)" if spec.emulation else "")
            + (f"\n  schedule: {pipe.schedule}" if cfg.pipeline.schedule != "bound" else "")
            + f"\n  update: {UpdateRule.of(cfg.optim).describe()}"
            + (f"\n  clipping: {pipe.predicted().clipping_text()}" if pipe.predicted().clipping else "")
            + (f"\n  on disk: {disk_text(plan, topo)}" if cfg.offload_dir else ""))


def reference_pass_text(plan: Plan, topo: Topology, data: tuple | None) -> str:
    """A preference run's reference pass (forward only, over every training and held-out row,
    before training) in the header, with the least it can take on this plan: its forward compute
    spread over the GPUs, or every stage loaded once per pass at the host's PCIe bandwidth."""
    sources = [s for s in (data or ()) if isinstance(s, PreferenceBatches)]
    if not sources:
        return ""
    per_pass = plan.micro_batches * plan.data_parallel * plan.micro_batch_size  # each replica its share
    passes = sum(-(-s.sequences // per_pass) for s in sources)
    compute = plan.micro_batches * sum(st.fwd_ms for st in plan.stages) / 1e3 / topo.n
    loads = sum(st.param_bytes for st in plan.stages) / pcie_bps(topo)
    return (f"\n  reference pass: {passes} forward-only passes of {per_pass} sequences before training, at least {seconds_text(passes * max(compute, loads))} (predicted: the "
            "plan's forward compute over the GPUs, or its stage loads at the host's PCIe rate)")


def disk_text(plan: Plan, topo: Topology) -> str:
    """What the disk tier keeps, in the header's words; where nothing needs it, why."""
    if plan.disk_stages:
        return plan.on_disk_text()
    return (f"nothing: the state fits in the {topo.host_memory_gb:.1f} GB of host memory the run may use "
            "(--host-mem-gb; 0 puts it on disk anyway)")


def torchrun_decision(decided: Decided) -> Decision:
    """Under torchrun each node plans for itself no more: every node describes its devices, rank 0
    checks that the nodes match and plans one replica's pipeline for that node shape, once."""
    cfg, topo = decided.cfg, decided.topology  # this node's devices
    model_config = check_model_input(cfg)

    def decide(nodes: list[str]) -> tuple[RunSpec, str]:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(nodes)))
        shapes = {n: shape for n, shape in enumerate(nodes[::local])}
        if len(set(shapes.values())) > 1:
            raise InputError("the nodes differ: " + "; ".join(f"node {n} has {s}" for n, s in shapes.items())
                             + " (every node runs the same pipeline: give them the same GPUs)")
        spec, _ = prepare_pipeline(decided, model_config)
        return spec, pipeline_header(cfg, model_config, topo, spec)

    return Decision(node=topo.shape, decide=decide)


def check_torchrun_options(cfg: RunConfig) -> None:
    """What a pipeline worker under torchrun does not run, refused before anything is probed."""
    if cfg.outputs.exports() or cfg.optim.epochs is not None or cfg.emulation.enabled or cfg.pipeline.replan == "auto" \
            or cfg.pipeline.schedule != "bound":
        raise InputError("under torchrun the pipeline runs without --export, --epochs, --replan auto, --emulate or "
                         "--schedule dispatched|auto (several boxes emulate on one machine: --emulate --data-parallel "
                         "D); start python -m mobius.train directly for the others")


def torchrun_worker(decided: Decided) -> None:
    """Under torchrun (several nodes, or a hand launch) this process is one pipeline worker; rank 0
    decides the run for every node."""
    pipeline_worker.worker_main(WorkerPayload(decided.cfg, None, ""), torchrun_decision(decided))
