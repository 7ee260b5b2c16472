"""tilelang_ops: TileLang GPU kernels as PyTorch custom ops (`torch.ops.tileops.*`).

Importing this package registers the ops. CUDA tensors run TileLang kernels (compiled on first
use, cached in memory and on disk); tensors on any other device run the PyTorch reference.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers torch.ops.tileops.*)
from .functional import add, add_layer_norm, gemm, layer_norm, linear, log_softmax, softmax, flash_attn, flash_attn_qkvpacked, scaled_dot_product_attention
from . import nn  # noqa: F401  (tilelang_ops.nn.Linear, fuse_linear_activations)
from .patching import PatchReport, patch, unpatch

__all__ = ["flash_attn", "flash_attn_qkvpacked", "scaled_dot_product_attention", "add", "gemm", "linear", "softmax", "log_softmax", "layer_norm", "add_layer_norm", "nn", "patch", "unpatch", "PatchReport", "__version__"]
