"""Reproduce the Mobius paper's evaluation figures with the simulator, on servers we do not have.

Writes one CSV per figure (and PNG plots when matplotlib is installed: ``pip install .[plots]``)
into ``--out`` and prints a table per figure:

* Fig. 5  per-step time of mobius-3b/8b/15b/51b on Topo 4, 2+2, 1+3: Mobius vs DeepSpeed ZeRO-3
  offload vs GPipe;
* Fig. 6  traffic per step relative to the fp32 model size, Mobius vs DeepSpeed;
* Fig. 7  achieved bandwidth of every transfer (CDF by bytes), mobius-8b on Topo 4;
* Fig. 8  transfer time not overlapped by compute;
* Fig. 9  MIP vs minimum-stage vs maximum-stage partitions (Topo 2+2);
* Fig. 10 cross vs sequential mapping on the 8-GPU server (4 GPUs per root complex);
* Fig. 14 scaling from 2 to 8 GPUs (mobius-8b).

Profiles are analytic (fp16 on RTX 3090 Ti: 40 TFLOPS at 50% MFU), micro-batch sizes from
Table 3, M = number of GPUs micro-batches per step, recomputation on (as in the paper); each plan
is the one ``mobius.plan`` makes for those settings (with the memory CUDA itself takes reserved).

    python scripts/reproduce_paper.py [--out paper_repro] [--mip-effort N] [--smoke]

``--smoke``: every figure for mobius-3b alone, on one 4-GPU topology and 2 and 4 GPUs (seconds).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from mobius.backends import resolve_for_plan
from mobius.config import RunConfig
from mobius.mapping import cross_map, sequential_map
from mobius.models import get_config
from mobius.models.presets import PAPER_MICRO_BATCH
from mobius.partition.baselines import max_stage, min_stage
from mobius.partition.cost import machine_for
from mobius.partition.profile import analytic_profile
from mobius.planning.pipeline import run_plan
from mobius.sim import simulate_gpipe, simulate_mobius, simulate_zero3_offload
from topology import load_preset
from topology.model import Topology

MODELS = ["mobius-3b", "mobius-8b", "mobius-15b", "mobius-51b"]


def profile_for(model: str):
    return analytic_profile(model, get_config(model), PAPER_MICRO_BATCH[model], 512, 40.0, "fp16")


def fp32_model_bytes(profile) -> float:
    return sum(l.param_bytes for l in profile.layers) * 2  # fp16 profile -> fp32 bytes


def plan_for(model: str, topo: Topology, profile, effort: int | None):
    """The plan ``mobius.plan`` prints for the paper's settings (its profile, fp16, recomputation)."""
    cfg = RunConfig.of(model=model, micro_batch_size=PAPER_MICRO_BATCH[model], micro_batches=topo.n, seq_len=512,
                       precision="fp16", recompute="on")
    return run_plan(resolve_for_plan(cfg, topo), get_config(model), profile=profile, use_cache=True, effort=effort)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    widths = [max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(_fmt(r[k]).rjust(w) for k, w in zip(keys, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 1e4 else f"{v:.3g}"
    return str(v)


def subset_topology(base: Topology, k: int) -> Topology:
    """k GPUs of the 8-GPU server, half under each root complex."""
    groups = base.groups()
    chosen = sorted(groups[0][: (k + 1) // 2] + groups[1][: k // 2])
    d = base.to_dict()
    d["name"] = f"{k}x3090"
    gpus = [dict(g) for g in d["gpus"] if g["index"] in chosen]
    for i, g in enumerate(gpus):
        g["index"] = i
    d["gpus"] = gpus
    d.pop("levels", None)
    from topology.model import topology_from_dict

    return topology_from_dict(d, d["name"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="paper_repro")
    p.add_argument("--mip-effort", type=int, default=None,
                   help="the partition MIP's effort per plan, in HiGHS's limit checks (default: by its size)")
    p.add_argument("--smoke", action="store_true", help="one model, one topology, 2 and 4 GPUs: seconds")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = MODELS[:1] if args.smoke else MODELS
    topologies = ["topo2+2"] if args.smoke else ["topo4", "topo2+2", "topo1+3"]
    profiles = {m: profile_for(m) for m in models}
    figures: dict[str, list[dict]] = {}

    # Fig. 5, 6, 8: Mobius vs DeepSpeed vs GPipe on three 4-GPU topologies.
    fig5, cdf_rows = [], []
    for topo_name in topologies:
        topo = load_preset(topo_name)
        for model in models:
            prof = profiles[model]
            plan = plan_for(model, topo, prof, args.mip_effort)
            mo = simulate_mobius(prof, plan.bounds, topo, plan.order, topo.n)
            ds = simulate_zero3_offload(prof, topo, topo.n)
            gp = simulate_gpipe(prof, topo, topo.n)
            size = fp32_model_bytes(prof)
            fig5.append({"topology": topo_name, "model": model, "stages": len(plan.bounds),
                         "mobius_s": mo.step_s, "deepspeed_s": ds.step_s,
                         "gpipe_s": "OOM" if gp.oom else gp.step_s, "speedup_vs_deepspeed": ds.step_s / mo.step_s,
                         "mobius_traffic_x": mo.traffic_bytes / size, "deepspeed_traffic_x": ds.traffic_bytes / size,
                         "mobius_exposed_s": mo.result.exposed_transfer_s(),
                         "deepspeed_exposed_s": ds.result.exposed_transfer_s()})
            if (topo_name, model) == (topologies[0], "mobius-3b" if args.smoke else "mobius-8b"):
                for system, res in (("mobius", mo.result), ("deepspeed", ds.result)):
                    cdf_rows += [{"system": system, "bytes": b, "gbps": bw} for b, bw in res.achieved_bandwidths()]
                with open(out / f"fig8_timeline_{model}_{topo_name}.json", "w") as f:
                    json.dump({"traceEvents": mo.result.chrome_trace()}, f)
    figures["fig5_fig6_fig8"] = fig5
    figures["fig7_bandwidth_cdf"] = cdf_rows

    # Fig. 9: MIP vs min-/max-stage partitions, simulated (Topo 2+2).
    fig9 = []
    topo = load_preset("topo2+2")
    for model in models:
        prof = profiles[model]
        plan = plan_for(model, topo, prof, args.mip_effort)
        machine = machine_for(topo, cross_map(topo, 2 * topo.n))
        row = {"model": model}
        for name, bounds in (("mip", plan.bounds), ("min_stage", min_stage(prof, machine, topo.n)),
                             ("max_stage", max_stage(prof, machine, topo.n))):
            order = cross_map(topo, len(bounds)).order
            sim = simulate_mobius(prof, bounds, topo, list(order), topo.n)
            row[f"{name}_stages"], row[f"{name}_s"] = len(bounds), sim.step_s
        fig9.append(row)
    figures["fig9_partition"] = fig9

    # Fig. 10: cross vs sequential mapping, 8 GPUs, 4 per root complex.
    fig10 = []
    topo = load_preset("8x3090-4+4")
    for model in models:
        prof = profiles[model]
        plan = plan_for(model, topo, prof, args.mip_effort)
        cross = simulate_mobius(prof, plan.bounds, topo, list(cross_map(topo, len(plan.bounds)).order), topo.n)
        seq = simulate_mobius(prof, plan.bounds, topo, list(sequential_map(topo, len(plan.bounds)).order), topo.n)
        fig10.append({"model": model, "stages": len(plan.bounds), "cross_s": cross.step_s, "sequential_s": seq.step_s,
                      "cross_faster_pct": 100 * (seq.step_s / cross.step_s - 1)})
    figures["fig10_mapping"] = fig10

    # Fig. 14: 2 -> 8 GPUs.
    fig14 = []
    base = load_preset("8x3090-4+4")
    scaled = models[0] if args.smoke else "mobius-8b"
    prof = profiles[scaled]
    for k in (2, 4) if args.smoke else (2, 4, 6, 8):
        topo = subset_topology(base, k)
        plan = plan_for(scaled, topo, prof, args.mip_effort)
        mo = simulate_mobius(prof, plan.bounds, topo, plan.order, topo.n)
        ds = simulate_zero3_offload(prof, topo, topo.n)
        tokens = topo.n * PAPER_MICRO_BATCH[scaled] * 512
        fig14.append({"gpus": k, "mobius_tokens_per_s": tokens / mo.step_s, "deepspeed_tokens_per_s": tokens / ds.step_s})
    figures["fig14_scaling"] = fig14

    for name, rows in figures.items():
        write_csv(out / f"{name}.csv", rows)
        if name != "fig7_bandwidth_cdf":
            print_table(name, rows)
    summary = {
        "speedup_range": [min(r["speedup_vs_deepspeed"] for r in fig5), max(r["speedup_vs_deepspeed"] for r in fig5)],
        "mobius_traffic_x_mean": sum(r["mobius_traffic_x"] for r in fig5) / len(fig5),
        "deepspeed_traffic_x_mean": sum(r["deepspeed_traffic_x"] for r in fig5) / len(fig5),
        "cross_vs_sequential_pct": [min(r["cross_faster_pct"] for r in fig10), max(r["cross_faster_pct"] for r in fig10)],
    }
    print("\nsummary (paper: speed-up 3.8-5.1x, traffic 1.8x vs 7.3x, cross mapping 11.3-18.1% faster):")
    print(json.dumps(summary, indent=1))
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    _plots(out, figures)


def _plots(out: Path, figures: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: CSV only (pip install .[plots] for PNGs)")
        return
    fig5 = figures["fig5_fig6_fig8"]
    topologies = list(dict.fromkeys(r["topology"] for r in fig5))
    fig, axes = plt.subplots(1, len(topologies), figsize=(4.4 * len(topologies), 3.6), squeeze=False)
    axes = axes[0]
    for ax, topo in zip(axes, topologies):
        rows = [r for r in fig5 if r["topology"] == topo]
        x = range(len(rows))
        ax.bar([i - 0.27 for i in x], [r["mobius_s"] for r in rows], 0.27, label="Mobius")
        ax.bar(list(x), [r["deepspeed_s"] for r in rows], 0.27, label="DeepSpeed ZeRO-3 offload")
        ax.bar([i + 0.27 for i in x], [r["gpipe_s"] if r["gpipe_s"] != "OOM" else 0 for r in rows], 0.27, label="GPipe")
        ax.set_xticks(list(x), [r["model"].split("-")[1] for r in rows])
        ax.set_title(topo)
        ax.set_ylabel("step time (s, simulated)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fig5_step_time.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for system in ("mobius", "deepspeed"):
        pts = sorted((r["gbps"], r["bytes"]) for r in figures["fig7_bandwidth_cdf"] if r["system"] == system)
        total = sum(b for _, b in pts) or 1
        acc, xs, ys = 0.0, [], []
        for bw, b in pts:
            acc += b
            xs.append(bw)
            ys.append(acc / total)
        ax.step(xs, ys, where="post", label=system)
    ax.set_xlabel("achieved bandwidth (GB/s)")
    ax.set_ylabel("fraction of bytes")
    ax.set_title("Fig. 7: transfer bandwidth CDF (mobius-8b, Topo 4)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig7_bandwidth_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    rows = figures["fig14_scaling"]
    ax.plot([r["gpus"] for r in rows], [r["mobius_tokens_per_s"] for r in rows], "o-", label="Mobius")
    ax.plot([r["gpus"] for r in rows], [r["deepspeed_tokens_per_s"] for r in rows], "s-", label="DeepSpeed")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s (simulated)")
    ax.set_title("Fig. 14: scaling, mobius-8b")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig14_scaling.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
