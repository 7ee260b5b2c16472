"""Public functional API: thin, documented wrappers over torch.ops.tileops.*."""
from __future__ import annotations

import torch


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``a + b``.

    Args:
        a: tensor of any shape, float32 / float16 / bfloat16, contiguous.
        b: same shape, dtype and device as ``a`` (no broadcasting).

    Returns:
        A new tensor like ``a``; computed in float32 and rounded once to ``a.dtype``.
        On CUDA a TileLang kernel runs on the current stream; elsewhere the PyTorch reference.
    """
    return torch.ops.tileops.add(a, b)
