"""The precisions a run computes in: their names, torch dtypes and bytes per element, in one table."""

from __future__ import annotations

import torch

from mobius.boundary.errors import InputError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)


def default_precision(on_gpus: bool) -> str:
    """bf16 where GPUs compute (every card we target has it), fp32 on CPU workers."""
    return "bf16" if on_gpus else "fp32"


def element_bytes(precision: str) -> int:
    """Bytes per element of ``precision`` (a profile's ``dtype``)."""
    return DTYPES[precision].itemsize


def use_fp16_accumulation(cuda: bool) -> None:
    """``--fp16-accumulation``: this process's CUDA matrix products in fp16 accumulate in fp16 (the
    command's, for the single backend and the profiler; each worker's).  CPU products ignore it."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "allow_fp16_accumulation"):
        raise InputError(f"--fp16-accumulation: torch {torch.__version__} has no fp16 accumulation "
                         "(torch.backends.cuda.matmul.allow_fp16_accumulation, torch 2.7 and later)")
    if cuda:
        matmul.allow_fp16_accumulation = True
