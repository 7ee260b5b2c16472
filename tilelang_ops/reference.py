"""PyTorch reference math and per-dtype tolerances, shared by the CPU path, the tests and the CLI."""
from __future__ import annotations

import torch

# Max abs error allowed vs a float32/float64 reference, per output dtype, for elementwise results:
# a few ulp of the output type at magnitude ~1 (bf16 eps 2^-8, fp16 2^-11, fp32 2^-24).
ELEMENTWISE_ATOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ELEMENTWISE_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Round once from float32, as the kernel does, so CPU and GPU paths give the same bits.
    return (a.float() + b.float()).to(a.dtype)
