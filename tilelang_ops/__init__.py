"""tilelang_ops: TileLang GPU kernels as PyTorch custom ops (`torch.ops.tileops.*`).

Importing this package registers the ops. CUDA tensors run TileLang kernels (compiled on first
use, cached in memory and on disk); tensors on any other device run the PyTorch reference.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers torch.ops.tileops.*)
from .functional import add

__all__ = ["add", "__version__"]
