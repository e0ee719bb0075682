"""The host update as one pass (:func:`mobius.runtime.optim.host_update`): the bits of torch's
AdamW step with the 16-bit conversions around it, on its own and in both schedules' runs."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_threads
from test_dispatch import KEPT_TAIL, SPLIT_HEAD
from test_dispatch import config as dispatched_config
from test_dispatch import run as run_dispatched

import mobius.runtime.optim as optim
import mobius.stages.host_optimizer
import mobius.stages.piece_updates
from mobius.runtime.optim import HostUpdatePath, UpdateRule, adamw, host_update, host_update_path

# A matrix over four chunks with a short last one, a bias, a matrix shorter than a chunk.
SHAPES = [(700, 100), (70,), (300, 30)]
CHUNK = 2**14


def flat_params(seed: int) -> tuple[torch.Tensor, list[torch.nn.Parameter], torch.optim.AdamW]:
    """Parameters viewing one flat fp32 master, in two groups (decay on matrices), as a stage's."""
    torch.manual_seed(seed)
    master = torch.randn(sum(torch.Size(s).numel() for s in SHAPES))
    params, at = [], 0
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        params.append(torch.nn.Parameter(master[at:at + n].view(shape)))
        at += n
    groups = [{"params": [params[0], params[2]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]
    return master, params, adamw(groups, UpdateRule(lr=1e-2))


@pytest.mark.parametrize("unscale,clip", [(None, 1.0), (1024.0, 0.3)])
def test_one_pass_gives_the_bits_of_the_conversions_and_the_step_one_after_the_other(unscale, clip):
    """Two parts of 16-bit gradients summed into fp32, unscaled, clipped, AdamW, the bf16 compute
    copy: the unfused path's weights, moments, step counts and compute copy bit for bit, over three
    steps (the first makes the state), and a state dict of torch's own form."""
    master_a, params_a, opt_a = flat_params(0)
    master_b, params_b, opt_b = flat_params(0)
    compute_a, compute_b = (torch.empty_like(master_a, dtype=torch.bfloat16) for _ in range(2))
    grads = torch.zeros_like(master_a)
    for step in range(3):
        parts = tuple((torch.randn_like(master_a) * 100).to(torch.bfloat16) for _ in range(2))
        grads.copy_(parts[0])
        grads.add_(parts[1])
        at = 0
        for p in params_a:
            p.grad = grads[at:at + p.numel()].view(p.shape)
            at += p.numel()
            if unscale is not None:
                p.grad.div_(unscale)
            if clip != 1.0:
                p.grad.mul_(clip)
        opt_a.step()
        compute_a.copy_(master_a)
        host_update(opt_b, master_b, compute_b, parts, unscale, clip, chunk=CHUNK)
        assert torch.equal(master_a, master_b) and torch.equal(compute_a, compute_b), step
        for a, b in zip(params_a, params_b):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt_a.state[a][key], opt_b.state[b][key]), (step, key)
    want, got = opt_a.state_dict(), opt_b.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for k, state in want["state"].items():
        assert {n: (v.dtype, v.shape) for n, v in state.items()} == {n: (v.dtype, v.shape) for n, v in
                                                                    got["state"][k].items()}


def test_an_update_split_into_slices_on_threads_gives_the_bits_of_one_pass():
    """The head's update split over threads (:func:`~mobius.runtime.optim.update_slices`): runs of
    consecutive parameters of about as many elements each, every parameter in one, and the slices
    stepped side by side leave the weights, moments, step counts and compute copy of one pass."""
    import threading

    master_a, params_a, opt_a = flat_params(0)
    master_b, params_b, opt_b = flat_params(0)
    slices = optim.update_slices(opt_b, 2)
    order = [p for group in opt_b.param_groups for p in group["params"]]
    assert [p for run in slices for p in run] == order and len(slices) == 2
    assert [[p.numel() for p in run] for run in slices] == [[70_000], [9_000, 70]]  # by their middles
    assert optim.update_slices(opt_b, 1) == [order] and len(optim.update_slices(opt_b, 9)) == 2
    compute_a, compute_b = (torch.empty_like(master_a, dtype=torch.bfloat16) for _ in range(2))
    for step in range(3):
        parts = tuple((torch.randn_like(master_a) * 100).to(torch.bfloat16) for _ in range(2))
        host_update(opt_a, master_a, compute_a, parts, clip=0.3, chunk=CHUNK)
        threads = [threading.Thread(target=host_update, args=(opt_b, master_b, compute_b, parts),
                                    kwargs={"clip": 0.3, "chunk": CHUNK, "params": run}) for run in slices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert torch.equal(master_a, master_b) and torch.equal(compute_a, compute_b), step
        for a, b in zip(params_a, params_b):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt_a.state[a][key], opt_b.state[b][key]), (step, key)


def test_with_the_gradients_attached_the_pass_steps_them_and_leaves_a_gradient_less_parameter_as_it_is():
    """Gradients already fp32 on the parameters (the step's norm read them first): the pass is
    the step, the compute copy refreshed; a parameter without a gradient keeps its weights and
    state, and its compute copy is its weights."""
    master_a, params_a, opt_a = flat_params(1)
    master_b, params_b, opt_b = flat_params(1)
    for pa, pb in zip(params_a[:2], params_b[:2]):
        pa.grad = torch.randn_like(pa)
        pb.grad = pa.grad.clone()
    opt_a.step()
    compute = torch.zeros_like(master_b, dtype=torch.bfloat16)
    host_update(opt_b, master_b, compute, chunk=CHUNK)
    assert torch.equal(master_a, master_b) and torch.equal(compute, master_b.to(torch.bfloat16))
    assert params_b[2] not in opt_b.state


def test_the_pass_converts_unless_the_update_needs_fp32_gradients_first_and_charges_what_it_moves():
    """The runtime's and the plan's rule (max_grad_norm, lag, fp16, replicated): an update made
    before its step's decision (clipping or fp16 without the lag) and the replicas' sum need the
    fp32 gradients first; the replicas' broadcast comes between the update and the compute copy.
    In 16 bits 28 bytes a parameter in one pass, as fp32's AdamW, and 2 for each read of the
    gradients as they came home (the norm, the vote); converted ahead, 36 with the compute copy
    written in the pass, 40 refreshed after, and 4 for each read in fp32."""
    assert host_update_path(0.0, 0, False, False) == HostUpdatePath(converts=True, refreshes=True, checks=0)
    assert host_update_path(1.0, 1, False, False) == HostUpdatePath(converts=True, refreshes=True, checks=1)
    assert host_update_path(1.0, 1, True, False) == HostUpdatePath(converts=True, refreshes=True, checks=2)
    assert host_update_path(1.0, 0, False, False) == HostUpdatePath(converts=False, refreshes=True, checks=1)
    assert host_update_path(0.0, 0, True, False) == HostUpdatePath(converts=False, refreshes=True, checks=3)
    assert host_update_path(0.0, 0, False, True) == HostUpdatePath(converts=False, refreshes=False, checks=0)
    assert [host_update_path(1.0, lag, False, False).bytes_per_param(2) for lag in (0, 1)] == [36 + 4, 28 + 2]
    assert host_update_path(0.0, 0, False, True).bytes_per_param(2) == 40
    assert host_update_path(0.0, 0, False, False).bytes_per_param(4) == 28
    assert host_update_path(1.0, 1, False, False).bytes_per_param(4) == 32


def test_a_split_pieces_update_is_charged_for_each_part_it_sums():
    """The head's parts (four here): summed in the pass where nothing reads the gradients first,
    one more 16-bit read each (28 + 3 x 2); where the norm or the vote reads their sum first, each
    added into the fp32 gradient ahead (its read, the sum's read and write: 10 bytes) and the update
    reads that as a converted-ahead one (36 + the check's 4, + 3 x 10); in fp32 each part's add, 12
    bytes; one part as the path says."""
    plain, voted = host_update_path(0.0, 0, False, False), host_update_path(0.0, 1, True, False)
    assert plain.split_bytes_per_param(2, 4) == 28 + 3 * 2
    assert voted.bytes_per_param(2) == 30 and voted.split_bytes_per_param(2, 4) == 36 + 4 + 3 * 10
    assert plain.split_bytes_per_param(4, 2) == 28 + 12
    assert [p.split_bytes_per_param(2, 1) for p in (plain, voted)] == [28, 30]


def counting_passes(monkeypatch, modules) -> list[bool]:
    """Whether each host update's pass converted 16-bit gradients (it was given their staging)."""
    converted: list[bool] = []

    def counted(*args, **kw):
        staging = kw.get("staging", args[3] if len(args) > 3 else ())
        converted.append(bool(staging))
        return host_update(*args, **kw)
    for module in modules:
        monkeypatch.setattr(module, "host_update", counted)
    return converted


def unfused(monkeypatch, module) -> None:
    """``module``'s updates as before the pass: gradients converted as they come home, the compute
    copy refreshed after."""
    monkeypatch.setattr(module, "host_update_path", lambda *a: HostUpdatePath(converts=False, refreshes=False))


@pytest.mark.slow
@pytest.mark.parametrize("precision,lag,clip", [("bf16", 0, 0.0), ("bf16", 1, 0.0), ("bf16", 1, 0.05),
                                                ("fp16", 1, 0.05)])
def test_bound_schedule_gives_the_unfused_updates_bits(monkeypatch, precision, lag, clip):
    """Two workers, four stages, with and without the lag, and with the lag clipped (at a norm
    every step exceeds) and in fp16 (its vote): every update converted in its pass, the norm and
    the vote read from the 16-bit gradients, and the losses and weights of the updates run as
    before, bit for bit."""
    monkeypatch.setattr(optim, "HOST_UPDATE_CHUNK", CHUNK)
    module = mobius.stages.host_optimizer
    from test_executor import config
    cfg = config(2, 4, steps=3, recompute="on", precision=precision, optimizer_lag=lag, max_grad_norm=clip)
    converted = counting_passes(monkeypatch, [module])
    fused = run_in_threads(cfg)
    assert converted and all(converted)
    unfused(monkeypatch, module)
    converted.clear()
    before = run_in_threads(cfg)
    assert converted and not any(converted)
    assert fused[0] == before[0]
    for name, w in before[1].items():
        assert torch.equal(fused[1][name], w), name


@pytest.mark.slow
@pytest.mark.parametrize("shape,lag,clip", [(SPLIT_HEAD, 0, 0.0), (KEPT_TAIL, 1, 0.0), (SPLIT_HEAD, 1, 0.05)])
def test_dispatched_schedule_in_bf16_gives_the_unfused_updates_bits(monkeypatch, shape, lag, clip):
    """The head's parts summed in the pass, with and without the lag; with the lag clipped, the
    norm read from the 16-bit gradients of the pieces of one part (the head's parts are summed
    first): the bits of the updates run as before."""
    monkeypatch.setattr(optim, "HOST_UPDATE_CHUNK", CHUNK)
    module = mobius.stages.piece_updates
    cfg = dispatched_config(4, optimizer_lag=lag, max_grad_norm=clip).changed(precision="bf16")
    converted = counting_passes(monkeypatch, [module])
    fused = run_dispatched(cfg, shape)
    assert converted and (all(converted) if not clip else 0 < converted.count(False) < len(converted))
    unfused(monkeypatch, module)
    converted.clear()
    before = run_dispatched(cfg, shape)
    assert converted and not any(converted)
    assert fused[0] == before[0]
    for name, w in before[1].items():
        assert torch.equal(fused[1][name], w), name
