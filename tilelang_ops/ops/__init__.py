"""Op layer: schemas, validation, CUDA/CPU impls, fakes and autograd. No TileLang syntax here.

`ALL_OPS` lists, per op, how `tileops check` exercises it: a few shapes, the dtypes, an input
maker and the reference. A new op adds one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import reference
from . import elementwise
from . import gemm
from . import attention
from . import softmax
from . import norm


@dataclass(frozen=True)
class OpCase:
    name: str
    op: Callable
    make_inputs: Callable[[tuple, torch.dtype, torch.device], tuple]
    reference: Callable
    shapes: tuple
    dtypes: tuple
    atol: dict
    rtol: dict


def _qkv_randn(shape, dtype, device):
    """shape = (B, Sq, Sk, H, HK, D) -> q (B, Sq, H, D), k, v (B, Sk, HK, D)."""
    B, Sq, Sk, H, HK, D = shape
    return tuple(torch.randn(B, s, h, D, dtype=dtype, device=device) for s, h in ((Sq, H), (Sk, HK), (Sk, HK)))


def _two_randn(shape, dtype, device):
    return (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))


ALL_OPS = [
    OpCase(
        "add",
        torch.ops.tileops.add,
        _two_randn,
        lambda a, b: a.double() + b.double(),
        shapes=((1,), (17,), (1000, 4097), (8, 1024, 1024)),
        dtypes=elementwise.DTYPES,
        atol=reference.ELEMENTWISE_ATOL,
        rtol=reference.ELEMENTWISE_RTOL,
    ),
    # gemm family: shapes are (M, K, N); few distinct (K, N) because each is a compiled kernel.
    OpCase(
        "gemm",
        torch.ops.tileops.gemm,
        lambda s, dt, dev: (torch.randn(s[0], s[1], dtype=dt, device=dev), torch.randn(s[1], s[2], dtype=dt, device=dev) * s[1] ** -0.5),
        lambda a, b: a.double() @ b.double(),
        shapes=((1, 64, 128), (1000, 4096, 4096), (333, 100, 72)),  # single row; layer-sized; padded K
        dtypes=gemm.DTYPES,
        atol=reference.GEMM_ATOL,
        rtol=reference.GEMM_RTOL,
    ),
    OpCase(
        "linear_gelu_tanh",
        lambda x, w, b: torch.ops.tileops.linear(x, w, b, "gelu_tanh"),
        lambda s, dt, dev: (
            torch.randn(s[0], s[1], dtype=dt, device=dev),
            torch.randn(s[2], s[1], dtype=dt, device=dev) * s[1] ** -0.5,
            torch.randn(s[2], dtype=dt, device=dev),
        ),
        lambda x, w, b: torch.nn.functional.gelu(x.double() @ w.double().t() + b.double(), approximate="tanh"),
        shapes=((1, 64, 128), (1000, 4096, 4096)),
        dtypes=gemm.DTYPES,
        atol=reference.GEMM_ATOL,
        rtol=reference.GEMM_RTOL,
    ),
    # mlp: shapes are (M, d, hidden), y = W2 gelu_tanh(W1 x + b1) + b2 with W2 (d, hidden)
    OpCase(
        "mlp_gelu_tanh",
        lambda x, w1, b1, w2, b2: torch.ops.tileops.mlp(x, w1, b1, w2, b2, "gelu_tanh")[0],
        lambda s, dt, dev: (
            torch.randn(s[0], s[1], dtype=dt, device=dev),
            torch.randn(s[2], s[1], dtype=dt, device=dev) * s[1] ** -0.5,
            torch.randn(s[2], dtype=dt, device=dev),
            torch.randn(s[1], s[2], dtype=dt, device=dev) * s[2] ** -0.5,
            torch.randn(s[1], dtype=dt, device=dev),
        ),
        lambda *args: reference.mlp(*(t.double() for t in args), "gelu_tanh"),
        shapes=((1, 64, 128), (333, 72, 200)),  # one row; ragged row, column and reduction tiles
        dtypes=gemm.DTYPES,
        atol=reference.GEMM_ATOL,
        rtol=reference.GEMM_RTOL,
    ),
    # gemm_act_grad: shapes are (M, K, N): dz = (dy (M, K) @ w (K, N)) * gelu_tanh'(z (M, N)), the
    # GEMM whose epilogue applies act' (nn.MLP's backward)
    OpCase(
        "gemm_act_grad_gelu_tanh",
        lambda dy, w, z: torch.ops.tileops.gemm_act_grad(dy, w, z, "gelu_tanh", True)[0],
        lambda s, dt, dev: (
            torch.randn(s[0], s[1], dtype=dt, device=dev),
            torch.randn(s[1], s[2], dtype=dt, device=dev) * s[1] ** -0.5,
            torch.randn(s[0], s[2], dtype=dt, device=dev),
        ),
        lambda dy, w, z: (dy.double() @ w.double()) * reference.activation_grad(z.double(), "gelu_tanh"),
        shapes=((1, 64, 128), (333, 72, 200)),
        dtypes=gemm.DTYPES,
        atol=reference.GEMM_ATOL,
        rtol=reference.GEMM_RTOL,
    ),
    # bias_grad: shapes are (M, N); each distinct N is a compiled kernel (M is symbolic).
    OpCase(
        "bias_grad",
        torch.ops.tileops.bias_grad,
        lambda s, dt, dev: (torch.randn(s, dtype=dt, device=dev),),
        lambda dy: dy.double().sum(0),
        shapes=((1, 8), (1000, 768), (4097, 2304)),  # one row; the GPT widths, ragged row counts
        dtypes=gemm.DTYPES,
        atol=reference.GEMM_ATOL,
        rtol=reference.GEMM_RTOL,
    ),
    # attention: shapes are (B, Sq, Sk, H, HK, D); each distinct (D, H // HK) is a compiled kernel.
    OpCase(
        "flash_attn_causal",
        lambda q, k, v: torch.ops.tileops.flash_attn(q, k, v, True),
        _qkv_randn,
        lambda q, k, v: reference.flash_attn(q, k, v, True, q.shape[-1] ** -0.5, torch.float64)[0],
        shapes=((1, 1, 1, 2, 2, 128), (2, 1000, 1000, 8, 2, 128), (1, 300, 4097, 4, 4, 64)),  # one key; GQA tail; Sq < Sk
        dtypes=attention.DTYPES,
        atol=reference.ATTENTION_ATOL,
        rtol=reference.ATTENTION_RTOL,
    ),
    OpCase(  # shapes as above with Sq = Sk and H = HK: qkv (B, S, 3, H, D)
        "flash_attn_qkvpacked_causal",
        lambda qkv: torch.ops.tileops.flash_attn_qkvpacked(qkv, True),
        lambda s, dt, dev: (torch.randn(s[0], s[1], 3, s[3], s[5], dtype=dt, device=dev),),
        lambda qkv: reference.flash_attn(*qkv.unbind(2), True, qkv.shape[-1] ** -0.5, torch.float64)[0],
        shapes=((2, 1000, 1000, 4, 4, 64),),
        dtypes=attention.DTYPES,
        atol=reference.ATTENTION_ATOL,
        rtol=reference.ATTENTION_RTOL,
    ),
    # softmax: shapes are (M, N); each distinct N is a compiled kernel (M is symbolic).
    OpCase(
        "softmax",
        lambda x: torch.ops.tileops.softmax(x, -1),
        lambda s, dt, dev: (torch.randn(s, dtype=dt, device=dev) * 4,),
        lambda x: torch.softmax(x.double(), -1),
        shapes=((1, 1), (17, 1000), (4, 4097), (4096, 8192), (8, 262144)),  # one element; short; odd N; register row; split row
        dtypes=softmax.DTYPES,
        atol=reference.SOFTMAX_ATOL,
        rtol=reference.SOFTMAX_RTOL,
    ),
    OpCase(
        "log_softmax",
        lambda x: torch.ops.tileops.log_softmax(x, -1),
        lambda s, dt, dev: (torch.randn(s, dtype=dt, device=dev) * 4,),
        lambda x: torch.log_softmax(x.double(), -1),
        shapes=((1, 1), (17, 1000), (4, 4097), (8, 262144)),
        dtypes=softmax.DTYPES,
        atol=reference.LOG_SOFTMAX_ATOL,
        rtol=reference.LOG_SOFTMAX_RTOL,
    ),
    # layer_norm: shapes are (M, n); each distinct n is a compiled kernel (M is symbolic).
    OpCase(
        "layer_norm",
        lambda x, w, b: torch.ops.tileops.layer_norm(x, w, b)[0],
        lambda s, dt, dev: (torch.randn(s, dtype=dt, device=dev) * 2 + 1, torch.randn(s[-1], dtype=dt, device=dev), torch.randn(s[-1], dtype=dt, device=dev)),
        lambda x, w, b: torch.nn.functional.layer_norm(x.double(), x.shape[-1:], w.double(), b.double()),
        shapes=((1, 1), (17, 768), (4, 4097), (1000, 4096)),  # one element; GPT-2 width; odd n; Llama width
        dtypes=norm.DTYPES,
        atol=reference.LAYER_NORM_ATOL,
        rtol=reference.LAYER_NORM_RTOL,
    ),
    OpCase(
        "add_layer_norm",
        lambda x, r, w, b: torch.ops.tileops.add_layer_norm(x, r, w, b)[1],
        lambda s, dt, dev: (torch.randn(s, dtype=dt, device=dev) * 2 + 1, torch.randn(s, dtype=dt, device=dev), torch.randn(s[-1], dtype=dt, device=dev), torch.randn(s[-1], dtype=dt, device=dev)),
        lambda x, r, w, b: torch.nn.functional.layer_norm((x + r).double(), x.shape[-1:], w.double(), b.double()),
        shapes=((1, 1), (17, 768), (4, 4097)),
        dtypes=norm.DTYPES,
        atol=reference.LAYER_NORM_ATOL,
        rtol=reference.LAYER_NORM_RTOL,
    ),
]


# What `tileops tune` can tune, by op name.
TUNABLES = {t.op: t for t in [elementwise.TUNABLE, gemm.TUNABLE, attention.TUNABLES["fwd"], attention.TUNABLES["bwd"], attention.TUNABLES["dq"], *softmax.TUNABLES.values(), *norm.TUNABLES.values()]}

# Kernel families whose REPRESENTATIVE lists `tileops export` / `tileops check` compile.
KERNEL_FAMILIES = ["elementwise", "gemm", "attention", "softmax", "norm"]


def all_kernels():
    """(KernelDef, config, static) for every shipped kernel at its representative configs."""
    import importlib

    return [entry for fam in KERNEL_FAMILIES for entry in importlib.import_module(f"tilelang_ops.kernels.{fam}").REPRESENTATIVE]
