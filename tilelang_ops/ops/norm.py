"""torch.ops.tileops.layer_norm and layer_norm_backward.

Reading order: validation → kernel resolution and launch → ops (CPU reference) with their CUDA
impl and fake → autograd.

The ops normalize over the last dim (the functional wrapper flattens a multi-dim
`normalized_shape`). Inputs are made contiguous (a non-contiguous x is copied once). Weight and
bias are optional; without them the kernels run with ones / zeros (two small tensors, cached per
(n, dtype, device)). dtypes: x in float32 / float16 / bfloat16; weight and bias one dtype, x's or
float32; the output in `out_dtype` (default x's): an fp32 residual stream can be normalized
straight into the bf16 a following Linear takes under autocast, without the cast kernel.
"""
from __future__ import annotations

import math

import torch

from .. import reference, runtime
from .._library import custom_op
from ._checks import INT32_MAX, TL_DTYPE, check_same, check_tensor, ready

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_N = 16384  # kernels.norm.MAX_N: the longest row the CUDA kernels hold in registers


def _check_param(name: str, t, x: torch.Tensor) -> None:
    if t is None:
        return
    check_tensor(name, t, DTYPES, ndim=1, contiguous=False)
    check_same(("x", name), x, t, dtype=False)
    if t.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: shape {tuple(t.shape)} != (x.shape[-1],) = ({x.shape[-1]},); normalization is over x's last dim")
    if t.dtype is not x.dtype and t.dtype is not torch.float32:
        raise TypeError(f"{name}: dtype {t.dtype} must be x's ({x.dtype}) or float32")


def _check_fwd(x, weight, bias, eps, out_dtype) -> None:
    if (  # fast accept: the common call
        x.dtype in DTYPES and x.dim() >= 1 and weight is not None and bias is not None
        and weight.dtype is bias.dtype and (weight.dtype is x.dtype or weight.dtype is torch.float32)
        and weight.dim() == 1 and bias.dim() == 1 and weight.shape[0] == x.shape[-1] == bias.shape[0]
        and weight.device == x.device and bias.device == x.device and eps >= 0 and (out_dtype is None or out_dtype in DTYPES)
    ):
        return
    check_tensor("x", x, DTYPES, contiguous=False)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1-D (normalization is over the last dim), got a 0-d tensor")
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)
    if weight is not None and bias is not None and weight.dtype is not bias.dtype:
        raise TypeError(f"bias: dtype {bias.dtype} differs from weight's {weight.dtype}; pass both in one dtype")
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"eps: {eps} must be >= 0")
    if out_dtype is not None and out_dtype not in DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} is not supported; supported: float32, float16, bfloat16")


def _check_bwd(dy, x, weight, mean, rstd) -> None:
    lead = x.shape[:-1]
    if (
        dy.dtype in DTYPES and x.dtype in DTYPES and dy.shape == x.shape and mean.dtype is torch.float32
        and rstd.dtype is torch.float32 and mean.shape == lead and rstd.shape == lead
        and dy.device == x.device and mean.device == x.device and rstd.device == x.device
        and (weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.device == x.device
                                and (weight.dtype is x.dtype or weight.dtype is torch.float32)))
    ):
        return
    check_tensor("dy", dy, DTYPES, contiguous=False)
    check_tensor("x", x, DTYPES, contiguous=False)
    check_same(("x", "dy"), x, dy, dtype=False, shape=True)
    _check_param("weight", weight, x)
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(name, t, (torch.float32,), contiguous=False)
        check_same(("x", name), x, t, dtype=False)
        if t.shape != lead:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != x.shape[:-1] = {tuple(lead)}")


def _check_cuda_size(x: torch.Tensor) -> None:
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"x: last dim {n} > {MAX_N}, the longest row the CUDA kernels hold in registers; use torch.nn.functional.layer_norm")
    if x.numel() // max(n, 1) > INT32_MAX:
        raise ValueError(f"x: {x.numel() // n} rows exceed the kernels' int32 row index range ({INT32_MAX})")


# ---------------------------------------------------------------------------------------------
# kernel resolution and launch
# ---------------------------------------------------------------------------------------------
# (direction, n, dtypes..., eps, device index) -> launcher; resolved once per key.
_kernels: dict[tuple, object] = {}
_params: dict[tuple, tuple] = {}  # (n, dtype, device) -> (ones, zeros): stand-ins for weight / bias None


def _compile(name: str, n: int, device: torch.device, **dtypes_and_eps):
    from ..kernels import norm as K  # imports tilelang (~2 s): only on the first CUDA call

    static = {k: TL_DTYPE[v] if isinstance(v, torch.dtype) else v for k, v in dtypes_and_eps.items()}
    kdef = K.layer_norm_fwd if name == "fwd" else K.layer_norm_bwd
    cfg = K.default_config(n, static["dtype"], name == "bwd")
    return cfg, runtime.launcher(kdef.compile(cfg, runtime.arch_for_device(device), n=n, **static))


def _fwd_kernel(n, dtype, wdtype, odtype, eps, device):
    key = ("fwd", n, dtype, wdtype, odtype, eps, device.index)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = _compile("fwd", n, device, dtype=dtype, wdtype=wdtype, odtype=odtype, eps=float(eps))[1]
    return k


def _bwd_kernel(n, dtype, wdtype, dydtype, device):
    key = ("bwd", n, dtype, wdtype, dydtype, device.index)
    k = _kernels.get(key)
    if k is None:
        cfg, launch = _compile("bwd", n, device, dtype=dtype, wdtype=wdtype, dydtype=dydtype)
        k = _kernels[key] = (launch, runtime.sm_count(device) * cfg.ctas_per_sm, cfg.block_m)
    return k


def _affine(weight, bias, x: torch.Tensor) -> tuple:
    """(weight, bias) as the kernels take them: given ones contiguous, missing ones as ones/zeros."""
    if weight is not None and bias is not None:
        return ready(weight), ready(bias)
    dtype = (weight if weight is not None else bias).dtype if (weight is not None or bias is not None) else x.dtype
    key = (x.shape[-1], dtype, x.device)
    pair = _params.get(key)
    if pair is None:
        pair = (torch.ones(x.shape[-1], dtype=dtype, device=x.device), torch.zeros(x.shape[-1], dtype=dtype, device=x.device))
        # Under CUDA-graph capture the fills are recorded, not run: such a pair holds its values
        # only in the graph's replays, so it is not kept for later calls.
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _params[key] = pair
    return (ready(weight) if weight is not None else pair[0]), (ready(bias) if bias is not None else pair[1])


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------
@custom_op("layer_norm", schema="(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05, ScalarType? out_dtype=None) -> (Tensor, Tensor, Tensor)")
def layer_norm(x, weight=None, bias=None, eps=1e-5, out_dtype=None):
    """(y, mean, rstd): y = (x - mean) * rstd * weight + bias over x's last dim, in out_dtype
    (default x.dtype); mean and rstd = 1 / sqrt(var + eps) (biased variance) are float32 of
    shape x.shape[:-1], what the backward needs. Math in float32."""
    _check_fwd(x, weight, bias, eps, out_dtype)
    return reference.layer_norm(x, weight, bias, eps, out_dtype)


@layer_norm.register_kernel("cuda")
def _(x, weight=None, bias=None, eps=1e-5, out_dtype=None):
    _check_fwd(x, weight, bias, eps, out_dtype)
    _check_cuda_size(x)
    odtype = x.dtype if out_dtype is None else out_dtype
    n = x.shape[-1]
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    # Allocated as the kernel takes them, (M, n) and (M,): a 2-D x (the common call) needs no views.
    y = torch.empty(m, n, dtype=odtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        mean.fill_(float("nan")), rstd.fill_(float("nan"))  # torch gives NaN statistics for n = 0
    else:
        w, b = _affine(weight, bias, x)
        x2 = ready(x) if x.dim() == 2 else ready(x).view(m, n)
        _fwd_kernel(n, x.dtype, w.dtype, odtype, eps, x.device)(x2, w, b, y, mean, rstd)
    if x.dim() == 2:
        return y, mean, rstd
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@layer_norm.register_fake
def _(x, weight=None, bias=None, eps=1e-5, out_dtype=None):
    _check_fwd(x, weight, bias, eps, out_dtype)
    lead = x.shape[:-1]
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


@custom_op("layer_norm_backward", schema="(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)")
def layer_norm_backward(dy, x, weight, mean, rstd):
    """(dx, dweight, dbias) of layer_norm from dy (y's gradient, any float dtype) and the saved x,
    weight, mean, rstd: dx in x.dtype, dweight = sum(dy * xhat) and dbias = sum(dy) over the rows
    in weight's dtype (x's without a weight). Deterministic: no atomics."""
    _check_bwd(dy, x, weight, mean, rstd)
    return reference.layer_norm_backward(dy, x, weight, mean, rstd)


@layer_norm_backward.register_kernel("cuda")
def _(dy, x, weight, mean, rstd):
    _check_bwd(dy, x, weight, mean, rstd)
    _check_cuda_size(x)
    n = x.shape[-1]
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    wdtype = x.dtype if weight is None else weight.dtype
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(n, dtype=wdtype, device=x.device)
    db = torch.empty(n, dtype=wdtype, device=x.device)
    if m == 0 or n == 0:
        return dx, dw.zero_(), db.zero_()
    w = ready(weight) if weight is not None else _affine(None, None, x)[0]
    launch, ctas, bm = _bwd_kernel(n, x.dtype, wdtype, dy.dtype, x.device)
    grid = min(ctas, -(-m // bm))  # CTAs of the row pass: one fp32 dw/db partial row each
    partials = torch.empty(2, grid, n, dtype=torch.float32, device=x.device)
    if x.dim() == 2:
        launch(ready(dy), ready(x), w, ready(mean), ready(rstd), dx, partials, dw, db)
    else:
        launch(ready(dy).view(m, n), ready(x).view(m, n), w, ready(mean).view(m), ready(rstd).view(m), dx.view(m, n), partials, dw, db)
    return dx, dw, db


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    _check_bwd(dy, x, weight, mean, rstd)
    wdtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=wdtype), x.new_empty(x.shape[-1:], dtype=wdtype)


# ---------------------------------------------------------------------------------------------
# autograd: save x, weight, mean, rstd (not y); the backward is itself a tileops op
# ---------------------------------------------------------------------------------------------
def _setup(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    # Statistics for the backward, not a differentiable result: a loss built from them raises
    # ("does not require grad") instead of silently missing their gradient.
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None
    dx, dw, db = torch.ops.tileops.layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, (dw if weight is not None else None), (db if ctx.has_bias else None), None, None


layer_norm.register_autograd(_backward, setup_context=_setup)
