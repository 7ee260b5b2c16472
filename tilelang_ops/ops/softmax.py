"""torch.ops.tileops.softmax / log_softmax and their backward ops.

Reading order: validation → kernel resolution and launch → ops (CPU reference) with their CUDA
impl and fake → autograd.

Layout: the kernels reduce over the last dim of a contiguous (M, N) view. Another `dim` is moved
last with `movedim(dim, -1).contiguous()` and the result moved back and made contiguous: two extra
copies of the tensor (documented cost; the last dim is the fast path). A non-contiguous input is
copied once with `.contiguous()`. Outputs are always contiguous, on every device and in the fake.
"""
from __future__ import annotations

import torch

from .. import reference, runtime, tuning
from .._library import custom_op
from ._checks import TL_DTYPE, check_rows, check_same, check_tensor, ready

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _norm_dim(name: str, t: torch.Tensor, dim: int) -> int:
    nd = max(t.dim(), 1)  # a 0-d tensor has one valid dim, like torch.softmax
    if not -nd <= dim < nd:
        raise IndexError(f"dim: {dim} is out of range for {name} of shape {tuple(t.shape)} (expected in [{-nd}, {nd - 1}])")
    return dim % nd


def _check_fwd(x, dim) -> int:
    if x.dtype not in DTYPES:
        check_tensor("x", x, DTYPES, contiguous=False)
    return _norm_dim("x", x, dim)


def _check_bwd(grad, y, dim) -> int:
    if not (grad.dtype in DTYPES and y.dtype is grad.dtype and grad.shape == y.shape and grad.device == y.device):
        check_tensor("grad", grad, DTYPES, contiguous=False)
        check_tensor("y", y, DTYPES, contiguous=False)
        check_same(("grad", "y"), grad, y, shape=True)
    return _norm_dim("y", y, dim)


# ---------------------------------------------------------------------------------------------
# kernel resolution and launch
# ---------------------------------------------------------------------------------------------
# (kind, backward, N, dtype, device index, row-count bucket) -> (config, compiled kernels).
# Resolved once per row length and bucket, so a call is a dict lookup and one or two launches.
_plans: dict[tuple, tuple] = {}
_BUCKETS = ("few", "some", "many")  # M < 2 rows per SM, < 4 rows per SM (K.LOOP_ROWS_PER_SM), more


def _bucket(m: int, sms: int) -> int:
    # The default schedule depends on M only through these thresholds (K.default_config).
    return (m >= 2 * sms) + (m >= 4 * sms)


def _plan(kind: str, backward: bool, m: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    bucket = _bucket(m, runtime.sm_count(device))
    key = (kind, backward, n, dtype, device.index, bucket)
    plan = _plans.get(key)
    if plan is None:
        cfg = tuning.resolve_config(TUNABLES[_op_name(kind, backward)], (m, n), dtype, device)  # tuned ▸ default
        plan = _plans[key] = (cfg, _compile(cfg, kind, backward, n, dtype, device))
    return plan


def _compile(cfg, kind: str, backward: bool, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    from ..kernels import softmax as K  # imports tilelang (~2 s): only on the first CUDA call

    arch, tl_dtype = runtime.arch_for_device(device), TL_DTYPE[dtype]
    return tuple(runtime.launcher(k.compile(c, arch, **st)) for k, c, st in K.schedule_kernels(cfg, n, tl_dtype, kind, backward))


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(M, N) contiguous, 16-byte aligned view with `dim` last; copies only when it must."""
    if t.dim() == 2 and dim == 1:  # the common case: no reshape/view (~1 µs each)
        return ready(t)
    if t.dim() == 0:
        t = t.reshape(1)
    elif dim != t.dim() - 1:
        t = t.movedim(dim, -1)  # reduction dim last: one copy in the .contiguous() below
    t = ready(t)
    return t.view(-1, t.shape[-1])


def _from_rows(out2d: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    if like.dim() == 2 and dim == 1:
        return out2d
    if like.dim() == 0:
        return out2d.view(())
    if dim == like.dim() - 1:
        return out2d.view(like.shape)
    moved = like.movedim(dim, -1).shape
    return out2d.view(moved).movedim(-1, dim).contiguous()  # second copy of the other-dim path


def _launch(kind: str, backward: bool, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """a = x (fwd) or grad (bwd), b = y (bwd); both (M, N) contiguous. Returns (M, N)."""
    m, n = a.shape
    check_rows(m)
    cfg, kernels = _plan(kind, backward, m, n, a.dtype, a.device)
    return _run(cfg, kernels, backward, a, b)


def _run(cfg, kernels: tuple, backward: bool, a: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None = None):
    out = torch.empty_like(a) if out is None else out  # first, so it takes the block a same-size request freed last
    if not cfg.partials:  # one launch, no partials buffer
        kernels[0](a, b, out) if backward else kernels[0](a, out)
        return out
    m, n = a.shape
    b = a if b is None else b  # forward kernels ignore their second input
    chunks = -(-n // cfg.chunk)
    p0 = torch.empty(m, chunks, dtype=torch.float32, device=a.device)  # per-chunk partials: M*chunks*8 bytes
    p1 = torch.empty_like(p0)
    if cfg.schedule != "split":  # csplit: one launch, a cluster per row exchanges partials through p0/p1
        kernels[0](a, b, p0, p1, out)
        return out
    kernels[0](a, b, p0, p1)  # stats: reads the row once
    kernels[1](a, b, p0, p1, out)  # apply: folds partials, re-reads (L2) and writes
    return out


def _cuda_forward(kind: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _from_rows(_launch(kind, False, _as_rows(x, dim), None), x, dim)


def _cuda_backward(kind: str, grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    if y.numel() == 0:
        return torch.empty(y.shape, dtype=y.dtype, device=y.device)
    return _from_rows(_launch(kind, True, _as_rows(grad, dim), _as_rows(y, dim)), y, dim)


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------
@custom_op("softmax", schema="(Tensor x, int dim=-1) -> Tensor")
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = _check_fwd(x, dim)
    return reference.softmax(x, dim)


@softmax.register_kernel("cuda")
def _(x, dim=-1):
    return _cuda_forward("softmax", x, _check_fwd(x, dim))


@softmax.register_fake
def _(x, dim=-1):
    _check_fwd(x, dim)
    return x.new_empty(x.shape)


@custom_op("log_softmax", schema="(Tensor x, int dim=-1) -> Tensor")
def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dim = _check_fwd(x, dim)
    return reference.log_softmax(x, dim)


@log_softmax.register_kernel("cuda")
def _(x, dim=-1):
    return _cuda_forward("log_softmax", x, _check_fwd(x, dim))


@log_softmax.register_fake
def _(x, dim=-1):
    _check_fwd(x, dim)
    return x.new_empty(x.shape)


@custom_op("softmax_backward", schema="(Tensor grad, Tensor y, int dim) -> Tensor")
def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """dx = y * (grad - sum(grad * y, dim)), y = softmax(x, dim)."""
    dim = _check_bwd(grad, y, dim)
    return reference.softmax_backward(grad, y, dim)


@softmax_backward.register_kernel("cuda")
def _(grad, y, dim):
    return _cuda_backward("softmax", grad, y, _check_bwd(grad, y, dim))


@softmax_backward.register_fake
def _(grad, y, dim):
    _check_bwd(grad, y, dim)
    return y.new_empty(y.shape)


@custom_op("log_softmax_backward", schema="(Tensor grad, Tensor y, int dim) -> Tensor")
def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """dx = grad - exp(y) * sum(grad, dim), y = log_softmax(x, dim)."""
    dim = _check_bwd(grad, y, dim)
    return reference.log_softmax_backward(grad, y, dim)


@log_softmax_backward.register_kernel("cuda")
def _(grad, y, dim):
    return _cuda_backward("log_softmax", grad, y, _check_bwd(grad, y, dim))


@log_softmax_backward.register_fake
def _(grad, y, dim):
    _check_bwd(grad, y, dim)
    return y.new_empty(y.shape)


# ---------------------------------------------------------------------------------------------
# autograd: save only the output y; the backward is itself a tileops op
# ---------------------------------------------------------------------------------------------
def _setup(ctx, inputs, output):
    ctx.dim = inputs[1] if len(inputs) > 1 else -1
    ctx.save_for_backward(output)


def _softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return softmax_backward.from_backward(grad, y, ctx.dim), None


def _log_softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return log_softmax_backward.from_backward(grad, y, ctx.dim), None


softmax.register_autograd(_softmax_grad, setup_context=_setup)
log_softmax.register_autograd(_log_softmax_grad, setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# tuning: `tileops tune --op softmax` (shape = (M, N); the key is N and the M bucket)
# ---------------------------------------------------------------------------------------------
def _op_name(kind: str, backward: bool) -> str:
    return f"{kind}_backward" if backward else kind


def _default_sms() -> int:
    return runtime.sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132


def _make_tunable(kind: str, backward: bool) -> tuning.Tunable:
    def key(shape, dtype, device):
        m, n = shape
        return {"n": n}, _BUCKETS[_bucket(m, runtime.sm_count(device))]

    def default(shape, dtype):
        from ..kernels import softmax as K

        m, n = shape
        return K.default_config(n, TL_DTYPE[dtype], kind, backward, m, _default_sms())

    def space(shape, dtype):
        from ..kernels import softmax as K

        return K.search_space(shape[1], TL_DTYPE[dtype], kind, backward, runtime.sm_of(runtime.default_arch()))

    def runner(cfg, shape, dtype, device):
        kernels = _compile(cfg, kind, backward, shape[1], dtype, device)
        a = torch.randn(shape, dtype=dtype, device=device)
        b = torch.softmax(torch.randn(shape, device=device), -1).to(dtype) if backward else None
        out = torch.empty_like(a)
        return lambda: _run(cfg, kernels, backward, a, b, out)

    eight_m = 8 * 2**20
    presets = {
        "default": [(eight_m // n, n) for n in (128, 1024, 8192, 32768, 65536, 262144)] + [(32768, 8192), (4096, 32768)],
        "quick": [(eight_m // n, n) for n in (1024, 32768, 262144)],
    }
    return tuning.Tunable(
        op=_op_name(kind, backward), presets=presets, dtypes=DTYPES[::-1],  # bf16 first: what `tune` defaults to
        key=key, search_space=space, default=default, runner=runner,
    )


TUNABLES = {t.op: t for t in (_make_tunable(k, bwd) for k in ("softmax", "log_softmax") for bwd in (False, True))}
