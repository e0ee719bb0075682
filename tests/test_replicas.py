"""Data-parallel replicas of the pipeline with the host AdamW sharded across them
(mobius.stages.replicas): the pure parts in process, the runs as processes, under our launcher and
under torchrun on two "nodes" of localhost."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
from conftest import HANG_S, TINY, fault_env, none_left, reference

from mobius.backends import resolve
from mobius.backends.pipeline import launch_pipeline
from mobius.config import RunConfig, parse_train_args
from mobius.models import get_config
from mobius.planning.pipeline import prepare_pipeline
from mobius.planning.planner import host_bytes_needed
from mobius.runtime import checkpoint as ck
from mobius.runtime.inputs import check_model_input, model_config_for
from mobius.stages.replicas import ReplicaLayout, owners
from mobius.train import main

PIPELINE = TINY + ["--topology", "cpu", "--cpu-workers", "2", "--steps", "4"]


def test_owners_balance_every_replica_and_agree_everywhere():
    sizes = {f"layers.{i}.{n}": size for i in range(4) for n, size in (("fc", 400), ("proj", 100), ("b", 7))}
    for count in (1, 2, 3):
        got = owners(sizes, count)
        assert got == owners(dict(reversed(sizes.items())), count)  # a function of names and sizes only
        load = [sum(sizes[n] for n, r in got.items() if r == d) for d in range(count)]
        assert set(got.values()) == set(range(count)) and max(load) - min(load) <= max(sizes.values())


def test_layout_ranks_and_shares():
    layout = ReplicaLayout.of_rank(5, world=6, count=2)  # 2 replicas of 3 workers: rank 5 is position 2 of replica 1
    assert (layout.index, layout.workers, layout.rank_of(2), layout.rank_of(0, replica=0)) == (1, 3, 5, 0)
    assert layout.share(list(range(8))) == [4, 5, 6, 7]


def test_host_memory_per_replica_keeps_a_share_of_the_adam_state():
    config = get_config("mobius-3b")
    one, two = host_bytes_needed(config, "bf16"), host_bytes_needed(config, "bf16", data_parallel=2)
    assert one - two == pytest.approx(4 * sum(p.numel() for p in _params(config)), rel=1e-6)  # 8 bytes -> 4
    assert host_bytes_needed(config, "bf16", data_parallel=2, replicas_here=2) == 2 * two


def _params(config):
    from mobius.models import build_model

    return build_model(config, device="meta").parameters()


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
def test_two_replicas_equal_the_reference_and_checkpoints_move_between_replica_counts(tmp_path):
    """D=2 for two steps, its checkpoint resumed on D=1 for one, that one resumed on D=2 again, on
    two emulated boxes of one GPU: the losses and final weights of the reference trainer, the AdamW
    shards written by each replica, each replica's hosts holding the bytes the pre-flight counts for
    it, and the emulated boxes' step no shorter than their network's share of it."""
    base = RunConfig.of(model="tiny", seq_len=32, micro_batch_size=2, steps=4)
    want, weights = reference(base)
    a, b, c = (str(tmp_path / d) for d in "abc")
    first = base.changed(topology="cpu", cpu_workers=2, data_parallel=2, stop_after=2, save=a, metrics=a + ".jsonl",
                         progress=False)
    _, _, results = launch_pipeline(resolve(first, backend="pipeline"), model_config_for(first), return_weights=True)
    for replica in (0, 1):  # every weight and gradient, half of the AdamW moments (owners balance to a tensor)
        held = sum(results[replica * 2 + p].report.host_bytes for p in (0, 1))
        assert held == pytest.approx(host_bytes_needed(get_config("tiny"), "fp32", data_parallel=2), rel=0.05)
    # Each replica writes the AdamW state it owns (which stages hold a tensor of each depends on the
    # partition the measured profile gave).
    assert {f.rsplit("-", 1)[1] for f in os.listdir(a) if f.startswith("optimizer-stage")} == {
        "replica0.safetensors", "replica1.safetensors"}
    main(["--resume", a, "--data-parallel", "1", "--stop-after", "1", "--save", b, "--metrics", b + ".jsonl"])
    # At twice the least dilation this machine allows the run as it is now (the model's own, 2e4,
    # would take minutes), asked of the code that refuses one below it.
    emulated = ["--resume", b, "--data-parallel", "2", "--topology", "1xh100", "--emulate", "--network", "10gbe"]
    cfg = parse_train_args(emulated, checkpoint_settings=ck.run_config)
    spec, _ = prepare_pipeline(resolve(cfg, backend="pipeline"), check_model_input(cfg))
    dilation = max(2 * spec.emulation.floor, 1.0)
    main(emulated + ["--save", c, "--metrics", c + ".jsonl", "--dilation", f"{dilation:.6g}"])
    got = _losses(a + ".jsonl") + _losses(b + ".jsonl") + _losses(c + ".jsonl")
    assert got == pytest.approx(want, rel=1e-5)
    # Each step's sums and broadcasts: 8 bytes per parameter x 1/2 over 1.25 GB/s.
    network_s = 8 * sum(p.numel() for p in _params(get_config("tiny"))) / 2 / 1.25e9
    assert json.loads(open(c + ".jsonl").read().splitlines()[-1])["emulated_step_s"] >= network_s
    final = ck.load_checkpoint(c)
    assert final.step == 4
    for name, w in weights.items():
        torch.testing.assert_close(final.get(name), w, rtol=1e-5, atol=1e-6)


def _die_with_the_test() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _torchrun_nodes(tmp_path, per_node_args, per_node_env=({}, {})):
    """``torchrun --nnodes 2`` twice on localhost (c10d rendezvous), as two boxes would start it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test",
                               "-m", "mobius.train"] + args, cwd=tmp_path, env={**env, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_the_test)
             for args, extra in zip(per_node_args, per_node_env)]
    try:
        return [(node.wait(timeout=HANG_S), *node.communicate()) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.slow
def test_replicas_whose_stages_keep_or_recompute_by_memory_equal_the_lagged_reference(tmp_path, capfd):
    """Two replicas of two workers under a memory cap that lets some stages keep their activations
    and makes the others recompute (the plan's per-stage choice), with the one-step-stale
    optimizer: the reference's losses and final weights."""
    args = ["--model", "tiny8", "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "8", "--steps", "3",
            "--optimizer-lag", "1"]
    want, weights = reference(parse_train_args(args))
    out = str(tmp_path / "run")
    main(args + ["--topology", "cpu", "--cpu-workers", "2", "--data-parallel", "2", "--stages", "5",
                 "--gpu-mem-gb", "0.005", "--save", out, "--metrics", out + ".jsonl"])
    assert re.search(r"recompute on for stages [0-9, -]+, activations kept by stages [0-9]", capfd.readouterr().out)
    assert _losses(out + ".jsonl") == pytest.approx(want, rel=1e-5)
    final = ck.load_checkpoint(out)
    for name, w in weights.items():
        torch.testing.assert_close(final.get(name), w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_torchrun_two_nodes_train_as_the_reference(tmp_path):
    want, _ = reference(RunConfig.of(model="tiny", seq_len=32, micro_batch_size=2, steps=3))
    args = TINY + ["--topology", "cpu", "--cpu-workers", "2", "--steps", "3", "--metrics", "m.jsonl"]
    ran = _torchrun_nodes(tmp_path, [args, args])
    assert all(code == 0 for code, _, _ in ran), [err[-1500:] for _, _, err in ran]
    assert "x 2 replicas (ZeRO-1 host AdamW)" in "".join(out for _, out, _ in ran)  # one replica per node
    assert _losses(tmp_path / "m.jsonl") == pytest.approx(want, rel=1e-5)


def test_nodes_that_differ_are_refused_in_one_line(monkeypatch):
    """Rank 0's decision from every process's description of its node (one per node of
    LOCAL_WORLD_SIZE processes); under torchrun the refusal is raised on every rank
    (:func:`mobius.runtime.worker.decided`)."""
    from mobius.backends.pipeline import torchrun_decision
    from mobius.boundary.errors import InputError
    from mobius.config import parse_train_args
    from topology import cpu_topology

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    decision = torchrun_decision(resolve(parse_train_args(TINY + ["--topology", "cpu", "--cpu-workers", "2"]),
                                         backend="pipeline"))
    other = cpu_topology(2, memory_gb=1).shape()
    with pytest.raises(InputError, match=r"the nodes differ: node 0 has 2 CPU workers \(.*\); node 1 has 2 CPU "
                                         r"workers \(.* 1 GB"):
        decision.decide([decision.node()] * 2 + [other] * 2)

def test_network_presets_files_and_the_update_rate_they_give():
    from mobius.partition.cost import replica_update_rate
    from topology import TopologyError, load_preset, network_of, topology_from_dict

    assert network_of("25gbe").bandwidth_gbps == 3.125 and network_of("2.5").bandwidth_gbps == 2.5
    for bad in ("31gbe", "0", "nan"):
        with pytest.raises(TopologyError):
            network_of(bad)
    topo = load_preset("8x4090-4+4")
    topo.network = network_of("100gbe")
    again = topology_from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again.network == topo.network and again.shape() == topo.shape()
    # One replica: the host's own rate.  Two: AdamW on half the parameters, 2 x 4 bytes x 1/2 on the wire.
    assert replica_update_rate(1e9, 1, 1e9) == 1e9
    assert replica_update_rate(1e9, 2, 4e9) == pytest.approx(1 / (1 / 2e9 + 1 / 1e9))


@pytest.mark.slow
def test_a_plan_for_two_boxes_puts_the_network_in_the_floor_and_says_so():
    from mobius.planning.planner import make_plan
    from mobius.planning.prepare import get_profile
    from topology import load_preset, network_of

    topo = load_preset("4x4090")
    topo.network = network_of("25gbe")
    profile = get_profile("mobius-3b", get_config("mobius-3b"), topo, 2, 512, "bf16", "analytic")
    one = make_plan("mobius-3b", get_config("mobius-3b"), topo, 2, 8, 512, "bf16", profile=profile, effort=4,
                    use_cache=False, device_optimizer=False)
    two = make_plan("mobius-3b", get_config("mobius-3b"), topo, 2, 4, 512, "bf16", profile=profile, effort=4,
                    use_cache=False, data_parallel=2)
    params = sum(p.numel() for p in _params(get_config("mobius-3b")))
    assert "network" not in one.lane_floor_s and not two.resident
    assert two.lane_floor_s["network"] == pytest.approx(2 * 4 * params / 2 / 3.125e9, rel=0.01)
    assert two.lane_floor_s["host AdamW"] == pytest.approx(one.lane_floor_s["host AdamW"] / 2, rel=0.01)
    assert two.predicted_step_s >= two.lane_floor_s["network"]
    assert "replicas: 2, one per node" in two.render() and "over 25 GbE" in two.render()


def test_the_node_network_serves_its_workers_exchanges_one_at_a_time():
    """Two workers, one stage each, gradients home at 0 and 1 s; each exchange takes 2 s alone on
    the network and AdamW 1 s.  Worker 1's sum waits for worker 0's (the link is busy until 2 s);
    worker 0's broadcast, ready at 3 s, waits for worker 1's sum (until 4 s)."""
    from mobius.partition.cost import host_updates

    updated = host_updates(home=[0.0, 1.0], adam=[1.0, 1.0], exchange=[2.0, 2.0], n=2, resident=[False, False])
    assert updated == [6.0, 8.0]
    # One replica: each thread's updates one after another, nothing on the network.
    assert host_updates([0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0] * 3, 2, [False] * 3) == [2.0, 2.0, 1.0]


def test_cost_model_and_simulator_share_the_network_alike():
    """tiny8 on two boxes of 8x3090-4+4 over 25 GbE: the network bounds the step; the cost model
    (exchanges queued on the node's link) and the simulator (fair sharing) agree."""
    from mobius.planning.planner import make_plan, replica_profile
    from mobius.planning.prepare import get_profile
    from mobius.sim import simulate_mobius
    from topology import load_preset, network_of

    topo = load_preset("8x3090-4+4")
    topo.network = network_of("25gbe")
    for g in topo.gpus:
        g.memory_gb = 0.05
    profile = get_profile("tiny8", get_config("tiny8"), topo, 4, 128, "fp32", "analytic")
    plan = make_plan("tiny8", get_config("tiny8"), topo, 4, 2, 128, "fp32", profile=profile, effort=4,
                     use_cache=False, data_parallel=2)
    replica = replica_profile(profile, topo, 2)
    sim = simulate_mobius(replica, plan.bounds, topo, plan.order, plan.micro_batches, plan.recompute).step_s
    assert plan.lane_floor_s["network"] < plan.predicted_step_s == pytest.approx(sim, rel=0.05)


@pytest.mark.slow
def test_a_worker_killed_on_one_node_ends_every_node_with_one_line_each(tmp_path):
    tag = f"mobius-test-{os.getpid()}"
    args = TINY + ["--topology", "cpu", "--cpu-workers", "2", "--steps", "50"]
    ran = _torchrun_nodes(tmp_path, [args, args], ({"MOBIUS_TEST_TAG": tag}, {"MOBIUS_TEST_TAG": tag,
                                                                             **fault_env("3:1")}))
    assert all(code != 0 for code, _, _ in ran)
    ours = [line for _, _, err in ran for line in err.splitlines() if line.startswith("error: ")]
    # Every surviving worker, on both nodes, says in one line that another one stopped; no traceback of ours.
    assert len(ours) == 3 and all("another worker of the run stopped" in line for line in ours), ours
    assert none_left(tag)
