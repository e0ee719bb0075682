"""The precisions a run computes in: their names, torch dtypes and bytes per element, in one table."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)


def default_precision(on_gpus: bool) -> str:
    """bf16 where GPUs compute (every card we target has it), fp32 on CPU workers."""
    return "bf16" if on_gpus else "fp32"


def element_bytes(precision: str) -> int:
    """Bytes per element of ``precision`` (a profile's ``dtype``)."""
    return DTYPES[precision].itemsize
