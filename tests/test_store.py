"""The host stage store: flat buffers, parameters as views, and the bytes the pre-flight assumes."""

import pytest
import torch

from mobius.models import build_model, get_config
from mobius.planner import HOST_BYTES_PER_PARAM
from mobius.reference import DTYPES
from mobius.runtime.device import CpuDevice
from mobius.swap.store import HostStageStore


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_flat_buffers_hold_exactly_the_bytes_the_preflight_assumes(precision):
    config = get_config("tiny")
    store = HostStageStore(config, [(0, 2), (2, 6)], [0, 1], seed=0, lr=1e-3, compute_dtype=DTYPES[precision],
                           device=CpuDevice(check=False))
    reference = dict(build_model(config).named_parameters())
    n, tensors = 0, 0
    for st in store.stages.values():
        for name, p, slot in zip(st.names, st.master_params, st.slots):
            assert p.data_ptr() == st.master[slot.offset:].data_ptr()  # a view of the flat buffer
            assert torch.equal(p, reference[name])  # the reference trainer's initial weights
            assert torch.equal(st.compute[slot.offset:slot.offset + slot.numel].view(slot.shape),
                               p.detach().to(DTYPES[precision]))
        st.attach_master_grads()
        st.master_grad.zero_()
        st.optimizer.step()  # AdamW state exists from the first step on
        n += st.master.numel()
        tensors += len(st.slots)
    # ... plus AdamW's step counter, one fp32 scalar per parameter tensor.
    assert store.host_bytes() == n * HOST_BYTES_PER_PARAM[precision] + 4 * tensors
