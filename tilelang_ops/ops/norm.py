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
from ._checks import TL_DTYPE, check_rows, check_same, check_tensor, ready

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


# ---------------------------------------------------------------------------------------------
# kernel resolution and launch
# ---------------------------------------------------------------------------------------------
# (direction, n, dtypes..., eps, device index) -> launcher; resolved once per key.
_kernels: dict[tuple, object] = {}
_params: dict[tuple, tuple] = {}  # (n, dtype, device) -> (ones, zeros): stand-ins for weight / bias None


def compile_kernel(direction: str, n: int, arch: str, config=None, **static):
    """The "fwd" or "bwd" kernel for rows of n, compiled for `arch` (default config unless given);
    static: dtype, wdtype and odtype + eps (fwd) or dydtype (bwd), torch or TileLang dtypes. The
    op, the cache-warming script and the sweep all compile through here (the same cache keys).
    Rows longer than MAX_N are refused here: a length that never compiles is never cached, so every
    call with it gets the error."""
    from ..kernels import norm as K  # imports tilelang (~2 s): only on the first CUDA call

    if n > MAX_N:
        raise ValueError(f"x: last dim {n} > {MAX_N}, the longest row the CUDA kernels hold in registers; use torch.nn.functional.layer_norm")
    static = {k: TL_DTYPE[v] if isinstance(v, torch.dtype) else v for k, v in static.items()}
    config = config or K.default_config(n, static["dtype"], direction == "bwd")
    return (K.layer_norm_fwd if direction == "fwd" else K.layer_norm_bwd).compile(config, arch, n=n, **static)


def bwd_grid(m: int, ctas: int, block_m: int) -> int:
    """CTAs of the backward's row pass for m rows (at most `ctas`): one fp32 dw/db partial row each."""
    return min(ctas, -(-m // block_m))


def _fwd_kernel(n, dtype, wdtype, odtype, eps, device):
    key = ("fwd", n, dtype, wdtype, odtype, eps, device.index)
    k = _kernels.get(key)
    if k is None:
        compiled = compile_kernel("fwd", n, runtime.arch_for_device(device), dtype=dtype, wdtype=wdtype, odtype=odtype, eps=float(eps))
        k = _kernels[key] = runtime.launcher(compiled)
    return k


def _bwd_kernel(n, dtype, wdtype, dydtype, device):
    """(launcher, most CTAs, rows per CTA step): bwd_grid's arguments come with the kernel."""
    key = ("bwd", n, dtype, wdtype, dydtype, device.index)
    k = _kernels.get(key)
    if k is None:
        from ..kernels import norm as K

        cfg = K.default_config(n, TL_DTYPE[dtype], True)
        compiled = compile_kernel("bwd", n, runtime.arch_for_device(device), cfg, dtype=dtype, wdtype=wdtype, dydtype=dydtype)
        k = _kernels[key] = (runtime.launcher(compiled), runtime.sm_count(device) * cfg.ctas_per_sm, cfg.block_m)
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
    odtype = x.dtype if out_dtype is None else out_dtype
    n, dev = x.shape[-1], x.device
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    # Allocated as the kernel takes them, (M, n) and (M,): a 2-D x (the common call) needs no views.
    y = torch.empty(m, n, dtype=odtype, device=dev)
    mean = torch.empty(m, dtype=torch.float32, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0 or n == 0:
        mean.fill_(float("nan")), rstd.fill_(float("nan"))  # torch gives NaN statistics for n = 0
    else:
        check_rows(m)
        w, b = _affine(weight, bias, x)
        x2 = ready(x) if x.dim() == 2 else ready(x).view(m, n)
        _fwd_kernel(n, x.dtype, w.dtype, odtype, eps, dev)(x2, w, b, y, mean, rstd)
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
    n, dev = x.shape[-1], x.device
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    wdtype = x.dtype if weight is None else weight.dtype
    dx = torch.empty(x.shape, dtype=x.dtype, device=dev)
    dw = torch.empty(n, dtype=wdtype, device=dev)
    db = torch.empty(n, dtype=wdtype, device=dev)
    if m == 0 or n == 0:
        return dx, dw.zero_(), db.zero_()
    check_rows(m)
    w = ready(weight) if weight is not None else _affine(None, None, x)[0]
    launch, ctas, bm = _bwd_kernel(n, x.dtype, wdtype, dy.dtype, dev)
    partials = torch.empty(2, bwd_grid(m, ctas, bm), n, dtype=torch.float32, device=dev)
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
