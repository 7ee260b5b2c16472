"""torch.ops.tileops.layer_norm and layer_norm_backward; add_layer_norm and its backward.

Reading order: validation → kernel resolution and launch → ops (CPU reference) with their CUDA
impl and fake → autograd.

The ops normalize over the last dim (the functional wrapper flattens a multi-dim
`normalized_shape`). Inputs are made contiguous (a non-contiguous x is copied once). Weight and
bias are optional; without them the kernels run with ones / zeros (two small tensors, cached per
(n, dtype, device)). dtypes: x in float32 / float16 / bfloat16; weight and bias one dtype, x's or
float32; the output in `out_dtype` (default x's): an fp32 residual stream can be normalized
straight into the bf16 a following Linear takes under autocast, without the cast kernel.

add_layer_norm is a pre-norm block's residual add and the next norm in one pass: h = x + residual
(x's dtype: the residual stream; the residual may be narrower, e.g. a bf16 branch output under
autocast), y = layer_norm(h). Its backward adds h's gradient from the stream (dh) to the norm's
and writes the branch's gradient in the branch's dtype in the same pass: no add or cast kernels.
"""
from __future__ import annotations

import math

import torch

from .. import reference, runtime, tuning
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


def _check_residual(x, residual) -> None:
    if residual.dtype in DTYPES and residual.shape == x.shape and residual.device == x.device and torch.promote_types(x.dtype, residual.dtype) is x.dtype:
        return
    check_tensor("residual", residual, DTYPES, contiguous=False)
    check_same(("x", "residual"), x, residual, dtype=False, shape=True)
    raise TypeError(f"residual: dtype {residual.dtype} is wider than x's ({x.dtype}); h = x + residual is kept in x's dtype (the residual stream): pass the wider tensor as x")


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


def _fwd_kernel(n, dtype, wdtype, odtype, eps, device, rdtype=None):
    """rdtype: add_layer_norm's kernel (residual of that dtype in, h out)."""
    key = ("fwd", n, dtype, wdtype, odtype, eps, device.index, rdtype)
    k = _kernels.get(key)
    if k is None:
        extra = {} if rdtype is None else {"rdtype": TL_DTYPE[rdtype]}
        cfg = tuning.resolve_config(TUNABLES["layer_norm"], (TUNE_ROWS, n), dtype, device)  # tuned ▸ default
        compiled = compile_kernel("fwd", n, runtime.arch_for_device(device), cfg, dtype=dtype, wdtype=wdtype, odtype=odtype, eps=float(eps), **extra)
        k = _kernels[key] = runtime.launcher(compiled)
    return k


# Up to this many row steps (block_m rows each), one CTA runs the whole backward and writes dw, db
# itself (the kernel's `single` variant): no partials, no fold kernel, whose launch costs the host
# more (~4.5 µs on the H200 host) than a few steps take on the GPU.
SINGLE_STEPS = 4


def _bwd_kernel(n, dtype, wdtype, dydtype, device, rdtype=None, dh=False, single=False):
    """(launcher, most CTAs, rows per CTA step): bwd_grid's arguments come with the kernel.
    rdtype: add_layer_norm's backward (dx also written in rdtype; with dh, dh added to dx).
    single: the one-CTA kernel (no partials argument)."""
    key = ("bwd", n, dtype, wdtype, dydtype, device.index, rdtype, dh, single)
    k = _kernels.get(key)
    if k is None:
        cfg = tuning.resolve_config(TUNABLES["layer_norm_backward"], (TUNE_ROWS, n), dtype, device)  # tuned ▸ default
        extra = {} if rdtype is None else {"rdtype": TL_DTYPE[rdtype], "dh": dh}
        if single:
            extra["single"] = True
        compiled = compile_kernel("bwd", n, runtime.arch_for_device(device), cfg, dtype=dtype, wdtype=wdtype, dydtype=dydtype, **extra)
        k = _kernels[key] = (runtime.launcher(compiled), runtime.sm_count(device) * cfg.ctas_per_sm, cfg.block_m)
    return k


# `tileops tune --op layer_norm / layer_norm_backward`: one config per (row length, dtype) serves
# every row count (rows are symbolic), timed at TUNE_ROWS rows; add_layer_norm's kernels (the same
# loops with a residual) take layer_norm's. Presets: the shapes the default table was measured at.
TUNE_ROWS = 16384


def _norm_runner(backward: bool):
    def runner(config, shape, dtype, device):
        m, n = shape
        kern = runtime.launcher(compile_kernel("bwd" if backward else "fwd", n, runtime.arch_for_device(device), config, dtype=dtype, wdtype=dtype, **({"dydtype": dtype} if backward else {"odtype": dtype, "eps": 1e-5})))
        x, w, b = torch.randn(m, n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
        mean, rstd = torch.randn(m, device=device), torch.rand(m, device=device) + 0.5
        out = torch.empty_like(x)
        if not backward:
            return lambda: kern(x, w, b, out, mean, rstd)
        partials = torch.empty(2, bwd_grid(m, runtime.sm_count(device) * config.ctas_per_sm, config.block_m), n, device=device)
        return lambda: kern(torch.randn_like(x), x, w, mean, rstd, out, partials, torch.empty_like(w), torch.empty_like(b))

    return runner


def _norm_tunable(backward: bool) -> tuning.Tunable:
    def space(shape, dtype):
        from ..kernels import norm as K

        return K.search_space(shape[1], TL_DTYPE[dtype])

    def default(shape, dtype):
        from ..kernels import norm as K

        return K.default_config(shape[1], TL_DTYPE[dtype], backward)

    return tuning.Tunable(
        op="layer_norm_backward" if backward else "layer_norm",
        presets={"default": [(TUNE_ROWS, 768), (TUNE_ROWS, 4096)]},
        dtypes=DTYPES[::-1],  # bf16 first: what `tune` defaults to
        key=lambda shape, dtype, device: ({"n": shape[1]}, "any"),
        search_space=space, default=default, runner=_norm_runner(backward),
    )


TUNABLES = {t.op: t for t in (_norm_tunable(False), _norm_tunable(True))}


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


def _as_rows(t: torch.Tensor, m: int, nd: int) -> torch.Tensor:
    """t as the kernels take it, (M, n) rows or (M,) statistics, for an x of rank `nd` (2: as is)."""
    t = ready(t)
    return t if nd == 2 else t.view(m, *t.shape[nd - 1:])


def _fwd_cuda(x, residual, weight, bias, eps, out_dtype) -> tuple:
    """(y, mean, rstd), preceded by h when residual is given (add_layer_norm)."""
    odtype = x.dtype if out_dtype is None else out_dtype
    n, dev = x.shape[-1], x.device
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    # Allocated as the kernel takes them, (M, n) and (M,): a 2-D x (the common call) needs no views.
    h = () if residual is None else (torch.empty(m, n, dtype=x.dtype, device=dev),)
    y = torch.empty(m, n, dtype=odtype, device=dev)
    mean = torch.empty(m, dtype=torch.float32, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0 or n == 0:
        mean.fill_(float("nan")), rstd.fill_(float("nan"))  # torch gives NaN statistics for n = 0
    else:
        check_rows(m)
        w, b = _affine(weight, bias, x)
        x2 = _as_rows(x, m, x.dim())
        if residual is None:
            _fwd_kernel(n, x.dtype, w.dtype, odtype, eps, dev)(x2, w, b, y, mean, rstd)
        else:
            _fwd_kernel(n, x.dtype, w.dtype, odtype, eps, dev, residual.dtype)(x2, _as_rows(residual, m, x.dim()), w, b, *h, y, mean, rstd)
    if x.dim() == 2:
        return (*h, y, mean, rstd)
    return (*(t.view(x.shape) for t in h), y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1]))


@layer_norm.register_kernel("cuda")
def _(x, weight=None, bias=None, eps=1e-5, out_dtype=None):
    _check_fwd(x, weight, bias, eps, out_dtype)
    return _fwd_cuda(x, None, weight, bias, eps, out_dtype)


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


def _bwd_cuda(dy, x, weight, mean, rstd, dh=None, residual_dtype=None) -> tuple:
    """(dx, dw, db); with residual_dtype (add_layer_norm's backward) (dx, dresidual, dw, db)."""
    n, dev, nd = x.shape[-1], x.device, x.dim()
    m = x.numel() // n if n else math.prod(x.shape[:-1])
    wdtype = x.dtype if weight is None else weight.dtype
    # Allocated as the kernel takes them, (M, n), by integer sizes (a torch.Size argument costs ~1 µs
    # more per allocation); viewed as x's shape on return.
    dx = x.new_empty(m, n)
    dr = () if residual_dtype is None else (torch.empty(m, n, dtype=residual_dtype, device=dev),)
    dw = torch.empty(n, dtype=wdtype, device=dev)
    db = torch.empty(n, dtype=wdtype, device=dev)
    if m == 0 or n == 0:
        return dx.view(x.shape), *(t.view(x.shape) for t in dr), dw.zero_(), db.zero_()
    check_rows(m)
    w = ready(weight) if weight is not None else _affine(None, None, x)[0]
    launch, ctas, bm = _bwd_kernel(n, x.dtype, wdtype, dy.dtype, dev, residual_dtype, dh is not None)
    if m <= SINGLE_STEPS * bm:
        launch, partials = _bwd_kernel(n, x.dtype, wdtype, dy.dtype, dev, residual_dtype, dh is not None, True)[0], ()
    else:
        partials = (torch.empty(2, bwd_grid(m, ctas, bm), n, dtype=torch.float32, device=dev),)
    dh_in = () if dh is None else (_as_rows(dh, m, nd),)
    launch(_as_rows(dy, m, nd), _as_rows(x, m, nd), w, _as_rows(mean, m, nd), _as_rows(rstd, m, nd), *dh_in, dx, *dr, *partials, dw, db)
    if nd == 2:
        return dx, *dr, dw, db
    return dx.view(x.shape), *(t.view(x.shape) for t in dr), dw, db


@layer_norm_backward.register_kernel("cuda")
def _(dy, x, weight, mean, rstd):
    _check_bwd(dy, x, weight, mean, rstd)
    return _bwd_cuda(dy, x, weight, mean, rstd)


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
    dx, dw, db = layer_norm_backward.from_backward(dy, x, weight, mean, rstd)
    return dx, (dw if weight is not None else None), (db if ctx.has_bias else None), None, None


layer_norm.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# add_layer_norm: a pre-norm block's residual add and the next norm, one pass each way
# ---------------------------------------------------------------------------------------------
@custom_op("add_layer_norm", schema="(Tensor x, Tensor residual, Tensor? weight=None, Tensor? bias=None, float eps=1e-05, ScalarType? out_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)")
def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, out_dtype=None):
    """(h, y, mean, rstd): h = x + residual in x.dtype (the residual stream; residual may be
    narrower), then layer_norm(h, weight, bias, eps, out_dtype)'s y, mean, rstd."""
    _check_fwd(x, weight, bias, eps, out_dtype)
    _check_residual(x, residual)
    return reference.add_layer_norm(x, residual, weight, bias, eps, out_dtype)


@add_layer_norm.register_kernel("cuda")
def _(x, residual, weight=None, bias=None, eps=1e-5, out_dtype=None):
    _check_fwd(x, weight, bias, eps, out_dtype)
    _check_residual(x, residual)
    return _fwd_cuda(x, residual, weight, bias, eps, out_dtype)


@add_layer_norm.register_fake
def _(x, residual, weight=None, bias=None, eps=1e-5, out_dtype=None):
    _check_fwd(x, weight, bias, eps, out_dtype)
    _check_residual(x, residual)
    lead = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


def _check_add_bwd(dy, dh, h, weight, mean, rstd, residual_dtype) -> None:
    _check_bwd(dy, h, weight, mean, rstd)
    if dh is not None and not (dh.dtype is h.dtype and dh.shape == h.shape and dh.device == h.device):
        check_tensor("dh", dh, DTYPES, contiguous=False)
        check_same(("h", "dh"), h, dh, shape=True)
    if residual_dtype not in DTYPES:
        raise TypeError(f"residual_dtype: {residual_dtype} is not supported; supported: float32, float16, bfloat16")


@custom_op("add_layer_norm_backward", schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, ScalarType residual_dtype) -> (Tensor, Tensor, Tensor, Tensor)")
def add_layer_norm_backward(dy, dh, h, weight, mean, rstd, residual_dtype):
    """(dx, dresidual, dweight, dbias) of add_layer_norm: dx = dh + the norm's gradient of h
    (h.dtype), dresidual the same values in residual_dtype; dh (h's gradient from its other uses)
    may be None."""
    _check_add_bwd(dy, dh, h, weight, mean, rstd, residual_dtype)
    return reference.add_layer_norm_backward(dy, dh, h, weight, mean, rstd, residual_dtype)


@add_layer_norm_backward.register_kernel("cuda")
def _(dy, dh, h, weight, mean, rstd, residual_dtype):
    _check_add_bwd(dy, dh, h, weight, mean, rstd, residual_dtype)
    return _bwd_cuda(dy, h, weight, mean, rstd, dh, residual_dtype)


@add_layer_norm_backward.register_fake
def _(dy, dh, h, weight, mean, rstd, residual_dtype):
    _check_add_bwd(dy, dh, h, weight, mean, rstd, residual_dtype)
    wdtype = h.dtype if weight is None else weight.dtype
    return h.new_empty(h.shape), h.new_empty(h.shape, dtype=residual_dtype), h.new_empty(h.shape[-1:], dtype=wdtype), h.new_empty(h.shape[-1:], dtype=wdtype)


def _add_setup(ctx, inputs, output):
    x, residual, weight, bias = inputs[:4]
    h, _, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.has_bias, ctx.residual_dtype = bias is not None, residual.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _add_backward(ctx, dh, dy, dmean, drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # y unused: h's gradient passes to both inputs unchanged
        return dh, (None if dh is None else dh.to(ctx.residual_dtype)), None, None, None, None
    dx, dr, dw, db = add_layer_norm_backward.from_backward(dy, dh, h, weight, mean, rstd, ctx.residual_dtype)
    return dx, dr, (dw if weight is not None else None), (db if ctx.has_bias else None), None, None


add_layer_norm.register_autograd(_add_backward, setup_context=_add_setup)
