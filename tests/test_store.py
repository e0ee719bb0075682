"""The host stage store: flat buffers, parameters as views, and the bytes the pre-flight assumes."""

import dataclasses

import pytest
import torch

from mobius.models import build_model, get_config
from mobius.models.precision import DTYPES
from mobius.planning.planner import host_bytes_needed
from mobius.runtime.device import CpuDevice
from mobius.runtime.optim import UpdateRule
from mobius.swap.store import HostStageStore


@pytest.mark.parametrize("precision,lora,lag", [("fp32", 0, 0), ("bf16", 0, 0), ("fp32", 0, 1), ("bf16", 4, 0),
                                                ("bf16", 4, 1)])
def test_flat_buffers_hold_exactly_the_bytes_the_preflight_assumes(precision, lora, lag):
    config = get_config("tiny")
    if lora:
        config = dataclasses.replace(config, lora_rank=lora, lora_alpha=8.0,
                                     lora_targets=("qkv", "proj", "fc", "fc_out"))
    store = HostStageStore(config, [(0, 2), (2, 6)], [0, 1], seed=0, rule=UpdateRule(lr=1e-3),
                           compute_dtype=DTYPES[precision],
                           device=CpuDevice(check=False), optimizer_lag=lag)
    reference = dict(build_model(config).named_parameters())
    tensors = 0
    for st in store.stages.values():
        for (name, p), slot in zip(st.named_params(), st.grad_slots()):
            if slot is None:  # frozen: held once, in the compute dtype, in the flat frozen buffer
                assert p.dtype == DTYPES[precision] and torch.equal(p, reference[name].to(p.dtype))
                continue
            assert p.data_ptr() == st.master[slot.offset:].data_ptr()  # a view of the flat buffer
            assert torch.equal(p, reference[name])  # the reference trainer's initial weights
            for buf in st.compute_buffers:
                assert torch.equal(buf[slot.offset:slot.offset + slot.numel].view(slot.shape),
                                   p.detach().to(DTYPES[precision]))
            tensors += 1
        if st.optimizer:
            st.attach_master_grads()
            st.master_grad.zero_()
            st.optimizer.step()  # AdamW state exists from the first step on
    # ... plus AdamW's step counter, one fp32 scalar per trained parameter tensor.
    assert store.host_bytes() == host_bytes_needed(config, precision, lag) + 4 * tensors
