"""Mobius against what users would pick instead, side by side on one GPU in one run.

With the GPU capped at ``--gpu-mem-gb`` (24 emulates an RTX 3090), for a model whose fp16 training
state exceeds the cap and whose host state fits:

* the Mobius pipeline (one GPU, many stages, stage prefetch; the stages that fit stay on the GPU
  and are updated there), and the same with every stage swapping and updated by the host's AdamW;
* chunked_dp with offload;
* PyTorch FSDP2 (``fully_shard`` per layer) with ``CPUOffloadPolicy``;
* DeepSpeed ZeRO-3 with parameter and optimizer offload, when ``deepspeed`` can be imported;
* plain PyTorch without offload, uncapped, on the same model (each block recomputed in backward
  where its activations would not fit otherwise, said in the row): the 100% line.

Every system trains the same model on the same batches at one ``--lr``, and the table prints each
one's first losses beside plain PyTorch's.  Per system: tokens/s, model TFLOPS (8 x tokens x
parameters per step, Elixir-000 Eq. 1), peak GPU memory and, for Mobius, the achieved host->device
GB/s during stage prefetch against the pinned bandwidth measured in the same run, the fraction of
prefetch time not overlapped by compute, and each lane's busy seconds per step beside the plan's.

    python scripts/bench_gpu.py [--gpu-mem-gb 24] [--model mobius-3b] [--json bench_gpu.json]
    python scripts/bench_gpu.py --sweep          # at users' batch sizes: 4k, 32k, 128k tokens a step, seq 512, 2048
    python scripts/bench_gpu.py --plans          # the MIP's plan raced against the alternatives, on the GPU
    python scripts/bench_gpu.py --plans --emulate 1xh100   # the same on CPU workers emulating the card
    python scripts/bench_gpu.py --smoke          # CPU, tiny models: keeps the harness working in CI
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

from mobius.backends import resolve
from mobius.boundary.janitor import scratch_dir
from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.models import build_model, get_config
from mobius.models.precision import DTYPES
from mobius.runtime.optim import UpdateRule, make_adamw

FIRST_LOSSES = 3  # each system's first step losses, printed beside plain PyTorch's


def model_tflops(tokens_per_s: float, params: int) -> float:
    return 8 * tokens_per_s * params / 1e12


def steady(times: list[float]) -> float:
    return statistics.median(times[1:] or times)


def prefetch_stats(events: list[dict]) -> tuple[float, float]:
    """(achieved GB/s of stage loads, fraction of load time not overlapped by compute) from a trace."""
    loads = [e for e in events if e["tid"] == "prefetch"]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "compute"]
    if not loads:
        return 0.0, 0.0
    gbps = sum(e["args"]["bytes"] for e in loads) / max(1e-9, sum(e["dur"] for e in loads) / 1e6) / 1e9
    exposed = 0.0
    for e in loads:
        start, end = e["ts"], e["ts"] + e["dur"]
        covered = sum(max(0.0, min(end, ce) - max(start, cs)) for cs, ce in compute)
        exposed += max(0.0, (end - start) - covered)
    return gbps, exposed / max(1e-9, sum(e["dur"] for e in loads))


def busy_s_per_step(events: list[dict]) -> dict[str, float]:
    """Seconds each lane of the trace was busy in a step (device-timed on the device's lanes): per
    step after the first (the warm-up, which ``steady`` leaves out of the step time too), the union
    of the lane's spans within the step's window, so overlapping spans count once and a lane never
    exceeds its step; the median over those steps, as the step time is.  With several workers, the
    busiest worker's lane."""
    steps = [e for e in events if e["tid"] == "step"]  # every worker marks its steps; one worker's suffice
    first = min((e["pid"] for e in steps), default=None)
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in steps if e["pid"] == first)
    windows = windows[1:] or windows
    spans: dict[tuple, list[tuple[float, float]]] = {}
    for e in events:
        if e["tid"] != "step":
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    busy: dict[str, float] = {}
    for (_, lane), intervals in spans.items():
        per_step = statistics.median(_union_within(intervals, a, b) for a, b in windows) / 1e6 if windows else 0.0
        busy[lane] = max(busy.get(lane, 0.0), per_step)
    return busy


def _union_within(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """Length of the union of ``intervals`` inside ``[a, b]``."""
    total, reach = 0.0, a
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, b)
        if end > start:
            total += end - start
            reach = end
    return total


def pinned_h2d_gbps(cuda: bool) -> float:
    if cuda:
        from topology.bandwidth import _copy_gbps

        return _copy_gbps(0, 256 * 2**20, 8, "h2d", None)
    src = torch.empty(128 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return 4 * src.numel() / (time.perf_counter() - t0) / 1e9


def row(system: str, model: str, tokens: int, step_s: float, params: int, peak: int, **extra) -> dict:
    tps = tokens / step_s
    return {"system": system, "model": model, "step_s": step_s, "tokens_per_s": tps,
            "model_tflops": model_tflops(tps, params), "peak_gpu_gb": peak / 1e9, **extra}


# ---- the systems --------------------------------------------------------------------------------

def tokens_per_step(args) -> int:
    return args.micro_batches * args.micro_batch_size * args.seq_len


def run_mobius(args, cuda: bool, out_dir: str, device_optimizer: str = "auto") -> dict:
    from mobius.backends.pipeline import launch_pipeline
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.planning.prepare import resolve_topology

    trace = os.path.join(out_dir, f"mobius_trace_{device_optimizer}_{tokens_per_step(args)}.json")
    cfg = RunConfig.of(model=args.model, backend="pipeline", topology="auto" if cuda else "cpu", cpu_workers=1,
                       steps=args.steps, micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches,
                       seq_len=args.seq_len, gpu_mem_gb=args.gpu_mem_gb, precision=args.precision, trace=trace,
                       stages=args.stages, progress=False, device_optimizer=device_optimizer, lr=args.lr)
    topo = resolve_topology(cfg)
    if cuda and topo.n > 1:  # one GPU, many stages
        topo.gpus, topo.extra = topo.gpus[:1], {}
    decided = resolve(cfg, topo, "pipeline")
    _, plan = prepare_pipeline(decided, get_config(args.model))  # what the launch below runs (the plan is cached)
    history = launch_pipeline(decided, get_config(args.model))
    events = json.load(open(trace))["traceEvents"]
    gbps, exposed = prefetch_stats(events)
    params = build_model(get_config(args.model), device="meta").num_parameters()
    name = "mobius pipeline" + (" (host AdamW only)" if device_optimizer == "off" else "")
    return row(name, args.model, history[0].tokens, steady([m.step_time_s for m in history]), params,
               max(m.peak_device_bytes for m in history), prefetch_h2d_gbps=gbps, prefetch_not_overlapped=exposed,
               busy_s_per_step=busy_s_per_step(events), predicted_step_s=plan.predicted_step_s,
               predicted_lane_floor_s=plan.lane_floor_s, stages=len(plan.bounds), resident=len(plan.resident),
               losses=[m.loss for m in history[:FIRST_LOSSES]])


def run_mobius_host_adam(args, cuda: bool, out_dir: str) -> dict:
    """The pipeline with every stage swapping and updated by the host's AdamW (the paper's Mobius)."""
    return run_mobius(args, cuda, out_dir, device_optimizer="off")


def run_chunked(args, cuda: bool, out_dir: str) -> dict:
    from chunked_dp.prepare import prepare_chunked
    from mobius.backends.chunked import launch_chunked
    from mobius.planning.prepare import resolve_topology

    trace = os.path.join(out_dir, f"chunked_trace_{tokens_per_step(args)}.json")
    cfg = RunConfig.of(model=args.model, backend="chunked", topology="auto" if cuda else "cpu", cpu_workers=1,
                       steps=args.steps, micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches,
                       seq_len=args.seq_len, gpu_mem_gb=args.gpu_mem_gb, precision=args.precision, offload="on",
                       trace=trace, progress=False, lr=args.lr)
    topo = resolve_topology(cfg)
    if cuda and topo.n > 1:  # one GPU
        topo.gpus, topo.extra = topo.gpus[:1], {}
    decided = resolve(cfg, topo, "chunked")
    setup = prepare_chunked(decided, get_config(args.model)).setup  # what the launch below runs
    history = launch_chunked(decided, get_config(args.model))
    events = json.load(open(trace))["traceEvents"]
    params = build_model(get_config(args.model), device="meta").num_parameters()
    predicted = dict(setup.predicted)
    return row("chunked_dp offload", args.model, history[0].tokens, steady([m.step_time_s for m in history]), params,
               max(m.peak_device_bytes for m in history), busy_s_per_step=busy_s_per_step(events),
               predicted_step_s=predicted.pop("step"), predicted_lane_floor_s=predicted,
               losses=[m.loss for m in history[:FIRST_LOSSES]])


@contextlib.contextmanager
def single_rank_group():
    """A process group of this process alone, with the variables a launcher would have set (DeepSpeed
    reads LOCAL_RANK and the others from the environment, not from the group); the environment is
    given back as it was."""
    import torch.distributed as dist

    launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + os.getpid() % 300), "RANK": "0",
                "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    before = {k: os.environ.get(k) for k in launcher}
    os.environ.update({k: v for k, v in launcher.items() if before[k] is None})
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)


def _train_loop(model, optimizer, args, device, autocast_dtype) -> tuple[list[float], list[float]]:
    """Seconds and mean micro-batch loss of each step, at the learning rate a run's schedule gives."""
    rule = UpdateRule(lr=args.lr, steps=args.steps)
    batches = BatchSource(load_corpus(None), args.seq_len, args.micro_batch_size, args.micro_batches, 0)
    times, losses = [], []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for mb in batches.step(step):
            ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
            with ctx:
                loss = model(mb.tokens.to(device), mb.targets.to(device))
            (loss / args.micro_batches).backward()
            total += loss.item() / args.micro_batches
        for group in optimizer.param_groups:
            group["lr"] = rule.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    return times, losses


def _cap(args, cuda: bool) -> None:
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_gb * 1e9 / total))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_fsdp2(args, cuda: bool, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = torch.device("cuda" if cuda else "cpu")
    _cap(args, cuda)
    config = get_config(args.model)
    with single_rank_group():
        mesh = init_device_mesh(device.type, (1,))
        model = build_model(config, seed=0)  # host memory; FSDP2 moves shards where its policy says
        kwargs = {"mesh": mesh}
        if cuda:
            kwargs["offload_policy"] = CPUOffloadPolicy()
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if not cuda:
            model.to(device)
        optimizer = make_adamw(model.named_parameters(), UpdateRule(lr=args.lr, steps=args.steps))
        times, losses = _train_loop(model, optimizer, args, device, None)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    note = "CPUOffloadPolicy, bf16 params" if cuda else "no offload: CPUOffloadPolicy needs an accelerator"
    return row("fsdp2", args.model, tokens, steady(times), model.num_parameters(), peak, note=note,
               losses=losses[:FIRST_LOSSES])


def run_deepspeed(args, cuda: bool, out_dir: str) -> dict:
    try:
        import deepspeed
    except ImportError:
        return {"system": "deepspeed zero-3 offload", "skipped": "deepspeed is not installed"}
    if not cuda:
        return {"system": "deepspeed zero-3 offload", "skipped": "needs CUDA"}
    _cap(args, cuda)
    config = get_config(args.model)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": list(UpdateRule(lr=args.lr).betas),
                                                  "weight_decay": UpdateRule(lr=args.lr).weight_decay}},
    }
    with single_rank_group():
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(config, seed=0)
        # An initialisation inside zero.Init writes to partitioned placeholders: the model must be
        # given the weights every other row starts from, one gathered parameter at a time.
        reference = build_model(config, seed=0)
        for p, weights in zip(model.parameters(), reference.parameters()):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(weights.data)
        del reference
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        batches = BatchSource(load_corpus(None), args.seq_len, args.micro_batch_size, args.micro_batches, 0)
        times, losses = [], []
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            total = 0.0
            for mb in batches.step(step):
                loss = engine(mb.tokens.cuda(), mb.targets.cuda())
                engine.backward(loss)
                engine.step()
                total += loss.item() / args.micro_batches
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(total)
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    params = build_model(config, device="meta").num_parameters()
    return row("deepspeed zero-3 offload", args.model, tokens, steady(times), params, torch.cuda.max_memory_allocated(),
               losses=losses[:FIRST_LOSSES])


def run_plain(args, cuda: bool, out_dir: str) -> dict:
    """Plain PyTorch on the model under test, uncapped, no offload: the 100% line.  Where its
    activations would not fit beside the training state (16 bytes a parameter), each block
    recomputes its forward in backward (activation checkpointing), and the row says so."""
    device = torch.device("cuda" if cuda else "cpu")
    config = get_config(args.model)
    model = build_model(config, seed=0)
    note = ""
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
        dtype = DTYPES[args.precision]
        activations = sum(layer.working_bytes(args.micro_batch_size, args.seq_len, dtype) for layer in model.layers)
        if model.num_parameters() * 16 + activations > 0.9 * torch.cuda.mem_get_info()[0]:
            checkpoint_blocks(model)
            note = "activation checkpointing"
        torch.cuda.reset_peak_memory_stats()
    model = model.to(device)
    optimizer = make_adamw(model.named_parameters(), UpdateRule(lr=args.lr, steps=args.steps))
    times, losses = _train_loop(model, optimizer, args, device, torch.bfloat16 if cuda else None)
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return row("plain pytorch (100% line)", args.model, tokens, steady(times), model.num_parameters(), peak,
               note=note, losses=losses[:FIRST_LOSSES])


def checkpoint_blocks(model) -> None:
    """Each transformer block recomputes its forward in backward (torch.utils.checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.layers:
        if layer.kind == "block":
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


# ---- the plans raced ---------------------------------------------------------------------------

VARIANTS = ("mip", "balanced", "uniform", "recompute", "fewer-stages", "more-stages", "lag", "no-resident")


def plan_variants(cfg: RunConfig, plan, keys: tuple[str, ...] = VARIANTS) -> dict[str, dict]:
    """The alternatives to the MIP's plan that matter, as option changes by name: other partitions,
    the other recompute choice, the stage count +-50%, residency off, and the optimizer lag (those
    of ``keys``, :data:`VARIANTS`)."""
    stages = len(plan.bounds)
    variants = {"mip": ("mip (the plan)", {}), "balanced": ("balanced partition", {"partitioner": "balanced"}),
                "uniform": ("uniform partition", {"partitioner": "uniform"}),
                "recompute": (f"recompute {'off' if plan.recompute else 'on'}",
                              {"recompute": "off" if plan.recompute else "on"}),
                "fewer-stages": (f"{max(1, stages // 2)} stages (-50%)", {"stages": max(1, stages // 2)}),
                "more-stages": (f"{stages + (stages + 1) // 2} stages (+50%)", {"stages": stages + (stages + 1) // 2}),
                "lag": ("--optimizer-lag 1", {"optimizer_lag": 1})}
    if plan.resident:
        variants["no-resident"] = ("no resident stages", {"device_optimizer": "off"})
    return dict(variants[k] for k in keys if k in variants)


def race_plans(args, cuda: bool, out_dir: str) -> list[dict]:
    """Each plan of :func:`plan_variants` trained for ``--steps``: predicted beside measured (on the
    emulated GPUs under ``--emulate``), at one dilation for all of them."""
    from mobius.backends.pipeline import launch_pipeline
    from mobius.boundary.errors import InputError
    from mobius.planning.pipeline import prepare_pipeline
    from mobius.planning.prepare import resolve_topology

    config = get_config(args.model)
    base = {"model": args.model, "backend": "pipeline", "steps": args.steps, "micro_batch_size": args.micro_batch_size,
            "micro_batches": args.micro_batches, "seq_len": args.seq_len, "gpu_mem_gb": args.gpu_mem_gb,
            "precision": args.precision, "progress": False, "lr": args.lr}
    if args.emulate:
        base.update(topology=args.emulate, emulate=True)
    else:
        base.update(topology="auto" if cuda else "cpu", cpu_workers=1)
    topo = resolve_topology(RunConfig.of(**base))
    if cuda and topo.n > 1:  # one GPU, many stages
        topo.gpus, topo.extra = topo.gpus[:1], {}
    _, mip = prepare_pipeline(resolve(RunConfig.of(**base), topo, "pipeline"), config)
    variants = plan_variants(RunConfig.of(**base), mip, tuple(args.variants.split(",")))
    prepared = {}  # each variant planned once: its spec and plan, or why it cannot run
    for name, change in variants.items():
        try:
            prepared[name] = prepare_pipeline(resolve(RunConfig.of(**base, **change), topo, "pipeline"), config)
        except InputError as err:  # e.g. recompute off where no partition fits
            prepared[name] = str(err)
    if args.emulate:  # one clock for every plan: the slowest any of them needs
        dilation = max(p[0].emulation.factor for p in prepared.values() if not isinstance(p, str))
        base["dilation"] = dilation
    rows, runs = [], {}
    for name, change in variants.items():
        if isinstance(prepared[name], str):
            rows.append({"plan": name, "skipped": prepared[name]})
            continue
        cfg = RunConfig.of(**base, **change)
        plan = prepared[name][1]  # (the dilation changes the clock the run keeps, not its plan)
        same = (tuple(map(tuple, plan.bounds)), tuple(plan.resident), plan.recompute, cfg.optim.optimizer_lag)
        if same in runs:  # another variant gave this very plan: one run, named by both
            runs[same]["plan"] += f" = {name}"
            continue
        history = launch_pipeline(resolve(cfg, topo, "pipeline"), config)
        measured = steady([m.emulated_step_s if m.emulated_step_s is not None else m.step_time_s for m in history])
        rows.append({"plan": name, "stages": len(plan.bounds), "resident": len(plan.resident),
                     "recompute": plan.recompute, "predicted_step_s": plan.predicted_step_s,
                     "measured_step_s": measured})
        runs[same] = rows[-1]
        print(f"plans: {json.dumps(rows[-1])}", flush=True)
    ranked = [r for r in rows if "measured_step_s" in r]
    for key, rank in (("predicted_step_s", "predicted_rank"), ("measured_step_s", "measured_rank")):
        for k, r in enumerate(sorted(ranked, key=lambda r: r[key]), 1):
            r[rank] = k
    print_plans(args, rows)
    return rows


def print_plans(args, rows: list[dict]) -> None:
    where = f"emulated {args.emulate}" if args.emulate else "this machine"
    print(f"\n{datetime.date.today()} plans raced on {where}: {args.model}, {args.precision}, cap {args.gpu_mem_gb:g} "
          f"GB, {args.micro_batches}x{args.micro_batch_size}x{args.seq_len} tokens a step, "
          f"median of steps {'2-' if args.steps > 2 else ''}{args.steps}")
    print(f"{'plan':<44} {'stages':>6} {'resident':>8} {'recompute':>9} {'predicted ms':>12} {'measured ms':>11} "
          f"{'error':>7} {'rank pred':>9} {'rank meas':>9}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['plan']:<44} {r['skipped']}")
            continue
        error = r["predicted_step_s"] / r["measured_step_s"] - 1
        print(f"{r['plan']:<44} {r['stages']:>6} {r['resident']:>8} {'on' if r['recompute'] else 'off':>9} "
              f"{r['predicted_step_s'] * 1e3:>12.3f} {r['measured_step_s'] * 1e3:>11.3f} {error:>+7.1%} "
              f"{r['predicted_rank']:>9} {r['measured_rank']:>9}")
    ranked = [r for r in rows if "measured_step_s" in r]
    mip = next((r for r in ranked if r["plan"].startswith("mip")), None)
    if mip is None:  # not among --variants
        return
    fastest = min(ranked, key=lambda r: r["measured_step_s"])
    print(f"the MIP's plan measured {mip['measured_step_s'] / fastest['measured_step_s'] - 1:+.1%} against the "
          f"fastest measured ({fastest['plan']})")


# The 100% line first: time on a GPU is short, and the baselines that offload are slow.
SYSTEMS = {f.__name__.removeprefix("run_"): f
           for f in (run_plain, run_mobius, run_mobius_host_adam, run_chunked, run_fsdp2, run_deepspeed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps")
    p.add_argument("--model", default=None)
    p.add_argument("--gpu-mem-gb", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--stages", type=int, default=None, help="force the pipeline's stage count")
    p.add_argument("--precision", default=None)
    p.add_argument("--lr", type=float, default=1e-5, help="every system's peak learning rate")
    p.add_argument("--json", default="bench_gpu.json")
    p.add_argument("--traces", default=None, metavar="DIR",
                   help="keep each run's trace here (named by system and tokens per step); default: not kept")
    p.add_argument("--sweep", action="store_true",
                   help="every system at each --sweep-seq and --sweep-tokens (tokens per optimizer step)")
    p.add_argument("--sweep-seq", type=int, nargs="+", default=None, help="default: 512 2048 (smoke: 32)")
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=None,
                   help="default: 4096 32768 131072 (smoke: 128 256)")
    p.add_argument("--plans", action="store_true",
                   help="race the MIP's plan against the alternatives (other partitions, recompute, the stage count "
                        "+-50%%, residency, --optimizer-lag 1): predicted beside measured, both rankings")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"--plans: the plans raced, a comma-separated subset of {','.join(VARIANTS)} (default: all)")
    p.add_argument("--emulate", default=None, metavar="TOPOLOGY",
                   help="--plans on CPU workers emulating this topology's GPUs (mobius.train --emulate)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    args = p.parse_args()
    wanted = args.systems.split(",")
    if not set(wanted) <= set(SYSTEMS):
        print(f"error: --systems: unknown {sorted(set(wanted) - set(SYSTEMS))}; pick from {list(SYSTEMS)}",
              file=sys.stderr)
        raise SystemExit(2)
    if not set(args.variants.split(",")) <= set(VARIANTS):
        print(f"error: --variants: unknown {sorted(set(args.variants.split(',')) - set(VARIANTS))}; pick from "
              f"{list(VARIANTS)}", file=sys.stderr)
        raise SystemExit(2)
    cuda = torch.cuda.is_available() and not args.smoke and not args.emulate
    if args.emulate and not args.plans:
        print("error: --emulate races --plans; give both", file=sys.stderr)
        raise SystemExit(2)
    if not cuda and not args.smoke and not args.emulate:
        print("error: no CUDA GPU: run with --smoke (or --plans --emulate TOPOLOGY) on CPU", file=sys.stderr)
        raise SystemExit(2)
    if args.smoke:
        args.model = args.model or "tiny"
        args.steps, args.micro_batch_size, args.seq_len = args.steps or 3, args.micro_batch_size or 2, args.seq_len or 32
        args.precision, args.gpu_mem_gb = args.precision or "fp32", min(args.gpu_mem_gb, 1.0)
        args.stages = args.stages or 3
        args.sweep_seq, args.sweep_tokens = args.sweep_seq or [32], args.sweep_tokens or [128, 256]
    else:
        args.model = args.model or "mobius-3b"
        args.steps, args.micro_batch_size, args.seq_len = args.steps or 4, args.micro_batch_size or 2, args.seq_len or 512
        args.precision = args.precision or "bf16"
        args.sweep_seq, args.sweep_tokens = args.sweep_seq or [512, 2048], args.sweep_tokens or [4096, 32768, 131072]
    with contextlib.ExitStack() as stack:
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
        out_dir = args.traces or stack.enter_context(scratch_dir("mobius-bench-gpu-"))
        run_benchmarks(args, cuda, out_dir, wanted)


def run_benchmarks(args, cuda: bool, out_dir: str, wanted: list[str]) -> None:
    if args.plans:
        rows = race_plans(args, cuda, out_dir)
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "emulate": args.emulate, "args": vars(args),
                       "plans": rows}, f, indent=1)
        return
    pinned = pinned_h2d_gbps(cuda)
    if not args.sweep:
        results = [bench(args, cuda, out_dir, wanted, pinned)]
    else:  # tokens per optimizer step x sequence length; micro-batches of about 4,096 (smoke: 64) tokens
        results = []
        for seq in args.sweep_seq:
            for tokens in args.sweep_tokens:
                size = max(1, (64 if args.smoke else 4096) // seq)
                if tokens % (size * seq):
                    continue
                one = argparse.Namespace(**{**vars(args), "seq_len": seq, "micro_batch_size": size,
                                            "micro_batches": tokens // (size * seq)})
                results.append(bench(one, cuda, out_dir, wanted, pinned))
        print_sweep(results)
    with open(args.json, "w") as f:
        json.dump({"date": str(datetime.date.today()), "device": results[0]["device"], "pinned_h2d_gbps": pinned,
                   "args": vars(args), "runs": results}, f, indent=1)


def bench(args, cuda: bool, out_dir: str, wanted: list[str], pinned: float) -> dict:
    """Every wanted system on one configuration; prints its table as it finishes."""
    rows = []
    for system in (SYSTEMS[name] for name in wanted):
        t0 = time.perf_counter()
        try:
            r = system(args, cuda, out_dir)
        except SystemExit as e:
            if isinstance(e.code, int) and e.code > 128:  # a signal (the caller's timeout, Ctrl-C): the bench ends too
                raise
            r = {"system": system.__name__, "error": f"exit {e.code}"}
        except Exception as e:  # a baseline that fails is reported, not fatal
            traceback.print_exc()
            r = {"system": system.__name__, "error": f"{type(e).__name__}: {e}"[:200]}
        r["wall_s"] = round(time.perf_counter() - t0, 1)  # set-up included: what a GPU run's time limit must hold
        rows.append(r)
        print(f"bench: {json.dumps(r)}", flush=True)  # each row as it comes: a run cut short keeps them
        gc.collect()
        if cuda:  # what this process cached must not count against the next system's cap
            torch.cuda.empty_cache()
    plain = next((r for r in rows if r.get("system", "").startswith("plain") and "step_s" in r), None)
    device = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    print(f"\n{datetime.date.today()} {device}, cap {args.gpu_mem_gb:g} GB, {args.model}, {args.precision}, "
          f"{args.micro_batches}x{args.micro_batch_size}x{args.seq_len} = {tokens} tokens/step; "
          f"pinned H2D {pinned:.1f} GB/s")
    print(f"{'system':<34} {'model':<11} {'tokens/s':>9} {'TFLOPS':>7} {'% plain':>8} {'peak GB':>8} "
          f"{'prefetch GB/s':>14} {'not overlapped':>15}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<34} {r.get('skipped') or r.get('error')}")
            continue
        share = f"{r['model_tflops'] / plain['model_tflops']:.0%}" if plain else "-"
        gbps = f"{r['prefetch_h2d_gbps']:.1f} ({r['prefetch_h2d_gbps'] / pinned:.0%})" if "prefetch_h2d_gbps" in r else "-"
        exposed = f"{r['prefetch_not_overlapped']:.0%}" if "prefetch_not_overlapped" in r else "-"
        print(f"{r['system']:<34} {r['model']:<11} {r['tokens_per_s']:>9.0f} {r['model_tflops']:>7.3f} {share:>8} "
              f"{r['peak_gpu_gb']:>8.2f} {gbps:>14} {exposed:>15}")
    for r in rows:
        if "busy_s_per_step" in r:
            print(f"{r['system']}: {lanes_text(r)}")
    for r in rows:  # the systems train alike: same model, batches and lr
        if r.get("losses"):
            print(f"{r['system']}: first losses {' '.join(f'{x:.4f}' for x in r['losses'])}"
                  + (f" (plain: {' '.join(f'{x:.4f}' for x in plain['losses'])})" if plain and r is not plain else ""))
    return {"device": device, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
            "micro_batches": args.micro_batches, "tokens_per_step": tokens, "rows": rows}


def lanes_text(r: dict) -> str:
    """A system's step measured beside predicted, and each lane's busy seconds beside its floor."""
    floors = r["predicted_lane_floor_s"]
    lanes = ", ".join(f"{lane} {s:.3f}" + (f" (pred {floors[lane]:.3f})" if lane in floors else "")
                      for lane, s in sorted(r["busy_s_per_step"].items()))
    unmeasured = ", ".join(f"{lane} {s:.3f}" for lane, s in sorted(floors.items()) if lane not in r["busy_s_per_step"])
    where = f"{r['resident']} of {r['stages']} stages resident; " if "stages" in r else ""
    return (f"{where}step {r['step_s']:.3f} s measured, {r['predicted_step_s']:.3f} s predicted; seconds busy "
            f"per step by lane (median of the steps after the first): {lanes}" + (f"; predicted, no lane: {unmeasured}"
                                                                       if unmeasured else ""))


def ratio(rows: list[dict], mine: str, other: str) -> str:
    a = next((r for r in rows if r.get("system", "").startswith(mine) and "step_s" in r), None)
    b = next((r for r in rows if r.get("system", "").startswith(other) and "step_s" in r), None)
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" if a and b else "-"


def print_sweep(results: list[dict]) -> None:
    """One line per configuration: Mobius's tokens/s over each alternative's."""
    print(f"\n{'seq':>5} {'tokens/step':>11} {'mobius tok/s':>12} {'/plain':>7} {'/deepspeed':>10} {'/fsdp2':>7} "
          f"{'/chunked':>8}")
    for res in results:
        rows = res["rows"]
        mine = next((r for r in rows if r.get("system") == "mobius pipeline" and "step_s" in r), None)
        print(f"{res['seq_len']:>5} {res['tokens_per_step']:>11} "
              f"{(mine['tokens_per_s'] if mine else float('nan')):>12.0f} {ratio(rows, 'mobius pipeline', 'plain'):>7} "
              f"{ratio(rows, 'mobius pipeline', 'deepspeed'):>10} {ratio(rows, 'mobius pipeline', 'fsdp2'):>7} "
              f"{ratio(rows, 'mobius pipeline', 'chunked'):>8}")


if __name__ == "__main__":
    main()
