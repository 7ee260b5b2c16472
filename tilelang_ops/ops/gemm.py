"""GEMM and fused Linear + bias + activation: torch.ops.tileops.{gemm, gemm_nt, gemm_tn, linear,
linear_preact, act_grad, bias_grad, gemm_act_grad, mlp}.

Reading order: config → kernel call → ops (each with its fake and autograd right under it) →
public helpers (`last_config`, `config_for`).

What is static and what is symbolic: the token/row count M (and a batch dim) is symbolic, so a
layer compiles once; N and K — the weight's shape — are baked into the kernel. For `gemm_tn`
(weight gradients) the output (P, N) is static and the reduction over tokens is symbolic.

Alignment: TMA needs 16-byte row strides, i.e. the static dims (K and N; P for gemm_tn) a
multiple of 8 elements in fp16/bf16. Other sizes are handled by zero-padding those dims on the
host (one copy of each operand that needs it, and the output is sliced back with one more copy):
correct for any size, at full speed only for multiples of 8. Non-contiguous operands are copied
with `.contiguous()`, except that `gemm(a, b)` with `b` a transposed view of a contiguous (N, K)
tensor runs the "nt" kernel on it without a copy. Views not 16-byte aligned are cloned.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import reference, runtime, tuning
from .._library import custom_op
from ._checks import TL_DTYPE, check_activation, check_same, check_tensor, ready

DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = reference.ACTIVATIONS
# Activations whose derivative needs the pre-activation z (relu's needs only the output's sign).
NEEDS_PREACT = ("gelu", "gelu_tanh", "silu")
_ALIGN = 8  # elements: 16 bytes of fp16/bf16, TMA's row-stride granule

# ---------------------------------------------------------------- config

# Config resolution (cold path, once per static key and M bucket): pinned by `set_config` ▸
# tuned-config cache (`tileops tune --op gemm`, tilelang_ops/tuning.py) ▸ the kernel family's
# default table (kernels/gemm.py: default_config, DEFAULT_OVERRIDES).
# Tuning key: (layout, N, K; rows for "tn") after padding, plus the bucket of the symbolic M
# (tokens: rows for "nn"/"nt", the reduction for "tn"): M <= 1536, <= 6144, larger. Each bucket
# resolves its own kernel lazily (at most 3 per static key; equal configs share one compile); a
# call pays two integer compares to pick it.
TUNED: dict[tuple, object] = {}
_last: dict[str, tuple] = {}


def _bucket(m: int) -> int:
    # Same thresholds as kernels.gemm.m_bucket / M_BUCKET_BOUNDS (inlined: this is the hot path).
    return 0 if m <= 1536 else (1 if m <= 6144 else 2)


def config_for(layout: str, n: int, k: int, dtype: torch.dtype, arch: str | None = None, rows: int = 0, m: int | None = None, batched: bool = False, board: str | None = None):
    """The default-table (or `set_config`-pinned) GemmConfig for these static dims.

    n: output columns; k: reduction length ("nn"/"nt"); rows: output rows ("tn"); m: the symbolic
    token count (rows for "nn"/"nt", reduction for "tn"; None = the largest bucket); board: a
    device name whose own table entries come first (None: the current CUDA device's, if any). The
    config a CUDA call actually used, tuned cache included, is `last_config()`.
    """
    from ..kernels import gemm as K

    arch = arch or runtime.default_arch()
    bucket = 2 if m is None else _bucket(m)
    cfg = TUNED.get((arch, layout, rows, n, k, dtype, bucket)) or TUNED.get((arch, layout, rows, n, k, dtype))
    return _servable(cfg if cfg is not None else K.default_config(arch, n, layout, rows if layout == "tn" else k, bucket, board or runtime.default_board()), layout, batched)


def _servable(cfg, layout: str, batched: bool):
    """`cfg` as a kernel of this call can run it: split-K serves 2-D weight gradients only (a
    batched call, or a split config pinned for another layout, runs unsplit)."""
    return dataclasses.replace(cfg, split_k=1) if cfg.split_k > 1 and (batched or layout != "tn") else cfg


def set_config(layout: str, n: int, k: int, dtype: torch.dtype, config, arch: str = "sm_90a", rows: int = 0, bucket: int | None = None) -> None:
    """Pin `config` for these static dims in this process (and drop resolved kernels so it applies):
    for every M bucket, or only for `bucket` (0: M <= 1536, 1: <= 6144, 2: larger)."""
    TUNED[(arch, layout, rows, n, k, dtype) + (() if bucket is None else (bucket,))] = config
    _kernels.clear()


def last_config(op: str = "matmul"):
    """(kernel name, config, static dims) that served the most recent CUDA launch of that kernel
    ("matmul" for every GEMM variant, "act_grad" for the activation backward); None before any."""
    return _last.get(op)


# tuning.Tunable: shape = (layout, M, N, K) of op(A)[M×K] @ op(B)[K×N]; for "tn" M (the output
# rows) is static and K (tokens) symbolic.
def _tune_static(shape):
    layout, m, n, k = shape
    return dict(layout=layout, n=_up(n), k=0 if layout == "tn" else _up(k), rows=_up(m) if layout == "tn" else 0)


def _tune_runner(config, shape, dtype, device):
    from ..kernels import gemm as K

    layout, m, n, k = shape
    st = _tune_static(shape)
    kern = K.matmul_kernel.compile(config, runtime.arch_for_device(device), **st, dtype=TL_DTYPE[dtype], batched=False, bias=False, activation="none", save_preact=False)
    a = torch.randn(*((k, st["rows"]) if layout == "tn" else (m, st["k"])), dtype=dtype, device=device)
    b = torch.randn(*((st["n"], st["k"]) if layout == "nt" else (k if layout == "tn" else st["k"], st["n"])), dtype=dtype, device=device)
    c = torch.empty(st["rows"] if layout == "tn" else m, st["n"], dtype=dtype, device=device)
    launch = _with_workspace(kern, config, st["rows"], st["n"])
    return lambda: launch(a, b, c)


def _tune_default(shape, dtype):
    from ..kernels import gemm as K

    layout, m, n, k = shape
    st = _tune_static(shape)
    return K.default_config(runtime.default_arch(), st["n"], layout, st["rows"] if layout == "tn" else st["k"], _bucket(k if layout == "tn" else m), runtime.default_board())


def _tune_space(shape, dtype):
    from ..kernels import gemm as K

    sm = runtime.sm_of(runtime.default_arch())
    space = K.SEARCH_SPACE + (K.TN_SPLIT_SPACE if shape[0] == "tn" else [])
    return [c for c in space if K.matmul_kernel.min_sm_for(c) <= sm]  # Hopper-only schedules left out elsewhere


def _bucket_name(shape) -> str:
    from ..kernels import gemm as K

    layout, m, n, k = shape
    return K.M_BUCKET_NAMES[_bucket(k if layout == "tn" else m)]


TUNABLE = tuning.Tunable(
    op="gemm",
    presets={
        "default": [("nn", 8192, 8192, 8192), ("nn", 4096, 14336, 4096), ("nt", 8192, 14336, 4096), ("tn", 4096, 4096, 16384)],
        # a LLaMA-style MLP (d=4096, hidden=14336): forward, dX and dW GEMMs
        "mlp": [("nt", 8192, 14336, 4096), ("nt", 8192, 4096, 14336), ("nn", 8192, 4096, 14336), ("nn", 8192, 14336, 4096),
                ("tn", 14336, 4096, 8192), ("tn", 4096, 14336, 8192)],
    },
    dtypes=(torch.bfloat16, torch.float16),
    key=lambda shape, dtype, device: (_tune_static(shape), _bucket_name(shape)),
    search_space=_tune_space,
    default=_tune_default,
    runner=_tune_runner,
)


# ---------------------------------------------------------------- kernel call

# (static key, M bucket) -> (compiled kernel, config). Resolved once per bucket; a call is then
# two integer compares, a dict lookup and a launch.
_kernels: dict[tuple, tuple] = {}


def _resolve_config(device, arch, layout, rows, n, k, dtype, bucket, batched):
    """A kernel's schedule (cold path): pinned (`set_config`) ▸ tuned cache or an autotune run
    (TILEOPS_AUTOTUNE=1), keyed by the bucket's representative M/K ▸ default table; then what
    this call can run (`_servable`)."""
    from ..kernels import gemm as K

    cfg = TUNED.get((arch, layout, rows, n, k, dtype, bucket)) or TUNED.get((arch, layout, rows, n, k, dtype))
    if cfg is None:
        rep = K.M_BUCKET_REP[bucket]
        shape = (layout, rows, n, rep) if layout == "tn" else (layout, rep, n, k)
        cfg = tuning.resolve_config(TUNABLE, shape, dtype, device)
    return _servable(cfg, layout, batched)


def _matmul_kernel(device, layout, n, k, dtype, rows=0, batched=False, bias=False, activation="none", save_preact=False, m=16384):
    """m: the symbolic token count of this call (rows × batch for "nn"/"nt", the reduction for "tn")."""
    bucket = 0 if m <= 1536 else (1 if m <= 6144 else 2)
    key = (device.index, layout, n, k, dtype, rows, batched, bias, activation, save_preact, bucket)
    hit = _kernels.get(key)
    if hit is None:
        from ..kernels import gemm as K

        arch = runtime.arch_for_device(device)
        cfg = _resolve_config(device, arch, layout, rows, n, k, dtype, bucket, batched)
        static = dict(layout=layout, n=n, k=k, rows=rows, dtype=TL_DTYPE[dtype], batched=batched, bias=bias, activation=activation, save_preact=save_preact)
        if cfg.pipeline == "pingpong":
            # One CTA per SM: a wider grid would run in two waves. (A static the kernel does not
            # change at its default leaves TileLang's disk cache key alone: that hashes the PrimFunc.)
            static["ctas"] = runtime.sm_count(device)
        launch = _with_workspace(runtime.launcher(K.matmul_kernel.compile(cfg, arch, **static)), cfg, rows, n)
        hit = _kernels[key] = (launch, ("matmul", cfg, static))
    _last["matmul"] = hit[1]
    return hit[0]


def _with_workspace(launch, cfg, rows: int, n: int):
    """A split-K kernel takes its fp32 partials (split_k, rows, n) as a last argument: allocated
    per call from torch's caching allocator (on the current stream, so CUDA graphs capture it)."""
    if cfg.split_k == 1:
        return launch
    split = cfg.split_k
    return lambda a, b, c: launch(a, b, c, torch.empty(split, rows, n, dtype=torch.float32, device=c.device))


# Up to this many rows (one row block), the bias gradient is summed by the dz kernel itself (one
# launch, no fp32 partials: the kernels' `single` variant), which is then also faster on the GPU
# (2.5 against 4.0 µs at 8 x 1024, 4.5 against 6.2 at 64 x 4096; at 128 x 4096 7.4 against 6.3:
# benchmarks.diag_single_pass, H200, session 26) besides saving the host a launch (~3 µs).
ACT_GRAD_SINGLE_ROWS = 64
# Up to one CTA's rows of the bias-gradient kernel (kernels.gemm.BiasGradConfig: block_M * steps;
# that module imports tilelang), bias_grad runs its one-kernel variant: the same grid, no partials.
BIAS_GRAD_SINGLE_ROWS = 512


def _act_grad_kernel(device, n, dtype, activation, bias_grad, single=False):
    """(launcher, block_M): dz, and with bias_grad the bias gradient, in one host call (the
    launcher runs two kernels then: dz with per-block_M-rows fp32 partial column sums, and the
    fold of those partials; with single, one kernel and no partials)."""
    key = (device.index, "act_grad", n, dtype, activation, bias_grad, single)
    hit = _kernels.get(key)
    if hit is None:
        from ..kernels import gemm as K

        arch = runtime.arch_for_device(device)
        cfg = K.default_act_grad_config(arch, n)
        static = dict(n=n, dtype=TL_DTYPE[dtype], activation=activation, bias_grad=bias_grad)
        if single:
            static["single"] = True
        hit = _kernels[key] = ((runtime.launcher(K.act_grad_kernel.compile(cfg, arch, **static)), cfg.block_M), ("act_grad", cfg, static))
    _last["act_grad"] = hit[1]
    return hit[0]


def _gemm_act_grad_kernel(device, n, k, dtype, activation, m):
    """(launcher, block_M): dz = (dy @ w) * act'(z) with the bias gradient, one host call (the
    GEMM with fp32 partial column sums per block_M rows, then their fold)."""
    bucket = _bucket(m)
    key = (device.index, "gemm_act_grad", n, k, dtype, activation, bucket)
    hit = _kernels.get(key)
    if hit is None:
        from ..kernels import gemm as K

        arch = runtime.arch_for_device(device)
        # the plain "nn" GEMM's schedule, as the epilogue can take it
        cfg = K.grad_act_config(_resolve_config(device, arch, "nn", 0, n, k, dtype, bucket, False))
        static = dict(layout="nn", n=n, k=k, dtype=TL_DTYPE[dtype], grad_act=activation)
        hit = _kernels[key] = ((runtime.launcher(K.matmul_kernel.compile(cfg, arch, **static)), cfg.block_M), ("matmul", cfg, static))
    _last["matmul"] = hit[1]
    return hit[0]


def _bias_grad_kernel(device, n, dtype, single=False):
    """(launcher, rows per partial): the column sums of an (M, n) tensor in one host call (two
    kernels: fp32 partials per block of rows, then their fold; with single, one kernel summing
    every row, what the op takes for up to `rows per partial` rows)."""
    key = (device.index, "bias_grad", n, dtype, single)
    hit = _kernels.get(key)
    if hit is None:
        from ..kernels import gemm as K

        arch = runtime.arch_for_device(device)
        cfg = K.default_bias_grad_config(arch, n)
        static = dict(n=n, dtype=TL_DTYPE[dtype])
        if single:
            static["single"] = True
        hit = _kernels[key] = ((runtime.launcher(K.bias_grad_kernel.compile(cfg, arch, **static)), cfg.block_M * cfg.steps), ("bias_grad", cfg, static))
    _last["bias_grad"] = hit[1]
    return hit[0]


def _up(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def _prep(t: torch.Tensor, pad_dims: dict[int, int]) -> torch.Tensor:
    """Contiguous, 16-byte aligned, zero-padded to the sizes in `pad_dims` ({dim: size})."""
    pads = []
    for d in range(t.dim() - 1, -1, -1):
        pads += [0, pad_dims.get(d, t.shape[d]) - t.shape[d]]
    if any(pads):
        return F.pad(t, pads)  # a fresh, contiguous, aligned tensor
    return ready(t)


def _fast_2d(layout, a, b, bias=None, activation="none", save_preact=False):
    """The common call in one pass, or None: 2-D operands of one supported dtype and device,
    matching non-empty reduction, static dims multiples of 8 (N, and K or for "tn" the rows P), contiguous and 16-byte
    aligned (bias too). Then (c, z) after one launch; the call is validated by these same
    conditions, so the op skips its separate check. None: the op validates (naming what is
    wrong) and takes the general path. `activation` must already be valid."""
    if not (a.dim() == 2 and b.dim() == 2 and a.dtype in DTYPES and b.dtype is a.dtype and a.device == b.device):
        return None
    M, K = a.shape  # "tn": a is (tokens, P), the output (P, N)
    if layout == "nn":
        kb, N = b.shape
    elif layout == "nt":
        N, kb = b.shape
    else:
        kb, N = b.shape
        M, K = K, M
    # the static dims must be multiples of 8 (16-byte TMA rows): N, and K, or for "tn" the output
    # rows P (its reduction, the token count, is symbolic and may be anything)
    static = M if layout == "tn" else K
    if kb != K or not K or (static | N) & 7 or not (a.is_contiguous() and b.is_contiguous()) or (a.data_ptr() | b.data_ptr()) & 15:
        return None
    if bias is not None and not (
        bias.dtype is a.dtype and bias.dim() == 1 and bias.shape[0] == N and bias.device == a.device
        and bias.is_contiguous() and not bias.data_ptr() & 15
    ):
        return None
    c = a.new_empty(M, N)  # sizes as ints: a tuple argument parses ~0.5 µs slower
    z = a.new_empty(M, N) if save_preact else None
    if M:
        if layout == "tn":
            kern = _matmul_kernel(a.device, "tn", N, 0, a.dtype, M, False, False, "none", False, K)
        else:
            kern = _matmul_kernel(a.device, layout, N, K, a.dtype, 0, False, bias is not None, activation, save_preact, M)
        args = (a, b, c) if bias is None else (a, b, bias, c)
        kern(*args, z) if save_preact else kern(*args)
    return c, z


def _launch_matmul(layout, a, b, bias=None, activation="none", save_preact=False):
    """C (and Z) for 2-D or batched 3-D operands already validated; pads ragged static dims.

    Hot path: `_fast_2d` (no copies, one output allocation, two with save_preact, a dict lookup
    and the launch). Otherwise every operand is made contiguous and aligned, ragged static dims
    are zero-padded and the output is sliced back.
    """
    fast = _fast_2d(layout, a, b, bias, activation, save_preact)
    if fast is not None:
        return fast
    if layout == "tn":
        P, N = a.shape[-1], b.shape[-1]
        rows, n, k = _up(P), _up(N), 0
        padded = rows != P or n != N
        if padded:
            a, b = _prep(a, {a.dim() - 1: rows}), _prep(b, {b.dim() - 1: n})
        out_shape = (*a.shape[:-2], rows, n)
        tokens = a.shape[-2]  # the symbolic reduction
    else:
        K = a.shape[-1]
        N = b.shape[-2] if layout == "nt" else b.shape[-1]
        n, k, rows, P = _up(N), _up(K), 0, a.shape[-2]
        padded = n != N or k != K
        if padded:
            a = _prep(a, {a.dim() - 1: k})
            b = _prep(b, {b.dim() - 2: n, b.dim() - 1: k} if layout == "nt" else {b.dim() - 2: k, b.dim() - 1: n})
        out_shape = (*a.shape[:-1], n)
        tokens = a.numel() // k if k else 0  # batch × M
    a, b = ready(a), ready(b)
    if bias is not None:
        bias = ready(bias) if n == N else _prep(bias, {0: n})
    c = a.new_empty(*out_shape)
    z = a.new_empty(*out_shape) if save_preact else None
    if c.numel():
        kern = _matmul_kernel(a.device, layout, n, k, a.dtype, rows, a.dim() == 3, bias is not None, activation, save_preact, tokens)
        args = (a, b) if bias is None else (a, b, bias)
        kern(*args, c, z) if save_preact else kern(*args, c)
    if padded:  # P: the real output rows
        c = c[..., :P, :N].contiguous()
        z = z[..., :P, :N].contiguous() if z is not None else None
    return c, z


def _k_is_empty(layout, a) -> bool:
    # A zero-length reduction has nothing for TMA to describe; the result is just the epilogue.
    return a.shape[-2] == 0 if layout == "tn" else a.shape[-1] == 0


def _cuda_matmul(layout, a, b, bias=None, activation="none", save_preact=False):
    if _k_is_empty(layout, a):
        return reference.matmul(layout, a, b, bias, activation, save_preact)
    return _launch_matmul(layout, a, b, bias, activation, save_preact)


# ---------------------------------------------------------------- validation


def _check_pair(a, b, op: str) -> None:
    # Fast accept (the common call), else the full check that names what is wrong.
    if a.dtype in DTYPES and b.dtype is a.dtype and a.dim() == 2 and b.dim() == 2 and a.device == b.device:
        if a.shape[-2 if op == "gemm_tn" else -1] == b.shape[-1 if op == "gemm_nt" else -2]:
            return
    check_tensor("a", a, DTYPES, ndim=(2, 3), contiguous=False)
    check_tensor("b", b, DTYPES, ndim=(2, 3), contiguous=False)
    check_same(("a", "b"), a, b)
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        raise ValueError(f"{op}: batched b {tuple(b.shape)} needs a 3-D a with the same batch size; got a {tuple(a.shape)}")
    if op == "gemm_tn" and a.dim() != b.dim():
        raise ValueError(f"gemm_tn: a {tuple(a.shape)} and b {tuple(b.shape)} must both be 2-D or both 3-D")
    ka, kb = (a.shape[-2], b.shape[-2]) if op == "gemm_tn" else (a.shape[-1], b.shape[-1] if op == "gemm_nt" else b.shape[-2])
    if ka != kb:
        expr = {"gemm": "a @ b", "gemm_nt": "a @ b.T", "gemm_tn": "a.T @ b"}[op]
        raise ValueError(f"{op}: shape mismatch for {expr}: a {tuple(a.shape)}, b {tuple(b.shape)} (reduction dims {ka} != {kb})")


_ACTIVATION_SET = frozenset(ACTIVATIONS)
_ACT_GRAD_SET = _ACTIVATION_SET - {"none"}


def _check_bias(x, bias, weight, name: str) -> None:
    if bias is not None:
        check_tensor(name, bias, DTYPES, ndim=1, contiguous=False)
        check_same(("x", name), x, bias)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{name}: shape {tuple(bias.shape)} != (out_features,) = ({weight.shape[0]},)")


def _check_linear(x, weight, bias, activation, names=("weight", "bias")) -> None:
    """names: what the error messages call weight and bias (mlp: w1, b1)."""
    # Fast accept (the common call), else the full check that names what is wrong.
    if (
        x.dtype in DTYPES and weight.dtype is x.dtype and weight.dim() == 2 and x.dim() >= 1
        and x.shape[-1] == weight.shape[1] and x.device == weight.device and activation in _ACTIVATION_SET
        and (bias is None or (bias.dtype is x.dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.device == x.device))
    ):
        return
    wn, bn = names
    check_tensor("x", x, DTYPES, contiguous=False)
    check_tensor(wn, weight, DTYPES, ndim=2, contiguous=False)
    check_same(("x", wn), x, weight)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1-D input (..., in_features), got a 0-D tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: last dim {x.shape[-1]} != {wn}'s in_features {weight.shape[1]} ({wn} is (out_features, in_features) = {tuple(weight.shape)})")
    _check_bias(x, bias, weight, bn)
    check_activation(activation)


def _gemm_out_shape(op, a, b):
    if op == "gemm":
        return (*a.shape[:-1], b.shape[-1])
    if op == "gemm_nt":
        return (*a.shape[:-1], b.shape[-2])
    return (*a.shape[:-2], a.shape[-1], b.shape[-1])


# ---------------------------------------------------------------- gemm: a @ b


@custom_op("gemm")
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_pair(a, b, "gemm")
    return reference.gemm(a, b)


@gemm.register_kernel("cuda")
def _(a, b):
    fast = _fast_2d("nn", a, b)
    if fast is not None:
        return fast[0]
    _check_pair(a, b, "gemm")
    fold = a.dim() == 3 and b.dim() == 2
    if fold:  # shared weight: fold the batch into M (a view when a is contiguous)
        lead = a.shape[:-1]
        a = a.reshape(-1, a.shape[-1])
    if b.dim() == 2 and not b.is_contiguous() and b.t().is_contiguous():
        c = _cuda_matmul("nt", a, b.t())[0]  # b is a transposed (N, K) weight: read it as is, no copy
    else:
        c = _cuda_matmul("nn", a, b)[0]
    return c.view(*lead, b.shape[-1]) if fold else c


@gemm.register_fake
def _(a, b):
    _check_pair(a, b, "gemm")
    return a.new_empty(_gemm_out_shape("gemm", a, b))


def _save_ab(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gemm_backward(ctx, g):
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = gemm_nt.from_backward(g, b)  # (M, N) @ (K, N)ᵀ
    if ctx.needs_input_grad[1]:
        if a.dim() == 3 and b.dim() == 2:
            gb = gemm_tn.from_backward(a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1]))
        else:
            gb = gemm_tn.from_backward(a, g)  # (M, K)ᵀ @ (M, N)
    return ga, gb


gemm.register_autograd(_gemm_backward, setup_context=_save_ab)


# ---------------------------------------------------------------- gemm_nt: a @ bᵀ


@custom_op("gemm_nt")
def gemm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_pair(a, b, "gemm_nt")
    return reference.gemm(a, b.transpose(-1, -2))


@gemm_nt.register_kernel("cuda")
def _(a, b):
    fast = _fast_2d("nt", a, b)
    if fast is not None:
        return fast[0]
    _check_pair(a, b, "gemm_nt")
    if a.dim() == 3 and b.dim() == 2:
        return _cuda_matmul("nt", a.reshape(-1, a.shape[-1]), b)[0].view(*a.shape[:-1], b.shape[0])
    return _cuda_matmul("nt", a, b)[0]


@gemm_nt.register_fake
def _(a, b):
    _check_pair(a, b, "gemm_nt")
    return a.new_empty(_gemm_out_shape("gemm_nt", a, b))


def _gemm_nt_backward(ctx, g):
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = gemm.from_backward(g, b)  # (M, N) @ (N, K)
    if ctx.needs_input_grad[1]:
        if a.dim() == 3 and b.dim() == 2:
            gb = gemm_tn.from_backward(g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]))
        else:
            gb = gemm_tn.from_backward(g, a)  # (M, N)ᵀ @ (M, K)
    return ga, gb


gemm_nt.register_autograd(_gemm_nt_backward, setup_context=_save_ab)


# ---------------------------------------------------------------- gemm_tn: aᵀ @ b (weight gradients)


@custom_op("gemm_tn")
def gemm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_pair(a, b, "gemm_tn")
    return reference.gemm(a.transpose(-1, -2), b)


@gemm_tn.register_kernel("cuda")
def _(a, b):
    fast = _fast_2d("tn", a, b)
    if fast is not None:
        return fast[0]
    _check_pair(a, b, "gemm_tn")
    return _cuda_matmul("tn", a, b)[0]


@gemm_tn.register_fake
def _(a, b):
    _check_pair(a, b, "gemm_tn")
    return a.new_empty(_gemm_out_shape("gemm_tn", a, b))


def _gemm_tn_backward(ctx, g):
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = gemm_nt.from_backward(b, g)  # (R, N) @ (P, N)ᵀ
    if ctx.needs_input_grad[1]:
        gb = gemm.from_backward(a, g)  # (R, P) @ (P, N)
    return ga, gb


gemm_tn.register_autograd(_gemm_tn_backward, setup_context=_save_ab)


# ---------------------------------------------------------------- act_grad: dz = dy · act'(z), db


@custom_op("act_grad")
def act_grad(dy: torch.Tensor, z: torch.Tensor, activation: str, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, db): dz = dy * act'(z) in dy's dtype; db = dz summed over rows (fp32 sum, cast), or an
    empty tensor when bias_grad is False. For relu, z may be the activation's output."""
    _check_act_grad(dy, z, activation)
    return reference.act_grad(dy, z, activation, bias_grad)


def _check_act_grad(dy, z, activation) -> None:
    if dy.dtype in DTYPES and z.dtype is dy.dtype and dy.dim() == 2 and dy.shape == z.shape and dy.device == z.device and activation in _ACT_GRAD_SET:
        return  # fast accept; otherwise the full check names what is wrong
    check_tensor("dy", dy, DTYPES, ndim=2, contiguous=False)
    check_tensor("z", z, DTYPES, ndim=2, contiguous=False)
    check_same(("dy", "z"), dy, z, shape=True)
    if activation not in ACTIVATIONS or activation == "none":
        raise ValueError(f"activation: {activation!r} has no act_grad kernel; supported: {', '.join(ACTIVATIONS[1:])}")


@act_grad.register_kernel("cuda")
def _(dy, z, activation, bias_grad):
    _check_act_grad(dy, z, activation)
    M, N = dy.shape
    dz = dy.new_empty(M, N)
    if dy.numel() == 0:
        return dz, (dy.new_zeros(N) if bias_grad else dy.new_empty(0))
    if bias_grad and M <= ACT_GRAD_SINGLE_ROWS:
        db = dy.new_empty(N)
        _act_grad_kernel(dy.device, N, dy.dtype, activation, True, True)[0](ready(dy), ready(z), dz, db)
        return dz, db
    kern, bm = _act_grad_kernel(dy.device, N, dy.dtype, activation, bias_grad)
    if not bias_grad:
        kern(ready(dy), ready(z), dz)
        return dz, dy.new_empty(0)
    partial = torch.empty(-(-M // bm), N, dtype=torch.float32, device=dy.device)  # (ceil(M/bm), N) column sums
    db = dy.new_empty(N)
    kern(ready(dy), ready(z), dz, partial, db)
    return dz, db


@act_grad.register_fake
def _(dy, z, activation, bias_grad):
    _check_act_grad(dy, z, activation)
    return torch.empty_like(dy, memory_format=torch.contiguous_format), dy.new_empty(dy.shape[1] if bias_grad else 0)


# ---------------------------------------------------------------- bias_grad: dy summed over rows


@custom_op("bias_grad")
def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """dy (M, N) summed over its rows: (N,) in dy's dtype, accumulated in fp32 — a linear layer's
    bias gradient (PyTorch: `dy.sum(0)`). Deterministic (a fixed summation order)."""
    _check_bias_grad(dy)
    return dy.sum(0, dtype=torch.float32).to(dy.dtype)


def _check_bias_grad(dy) -> None:
    if dy.dtype in DTYPES and dy.dim() == 2:
        return
    check_tensor("dy", dy, DTYPES, ndim=2, contiguous=False)


@bias_grad.register_kernel("cuda")
def _(dy):
    _check_bias_grad(dy)
    M, N = dy.shape
    if dy.numel() == 0:
        return dy.new_zeros(N)
    single = M <= BIAS_GRAD_SINGLE_ROWS  # one CTA's rows: the one-kernel variant, no partials
    kern, rows = _bias_grad_kernel(dy.device, N, dy.dtype, single)
    db = dy.new_empty(N)
    if single:
        kern(ready(dy), db)
        return db
    partial = torch.empty(-(-M // rows), N, dtype=torch.float32, device=dy.device)  # one fp32 row per `rows` rows
    kern(ready(dy), partial, db)
    return db


@bias_grad.register_fake
def _(dy):
    _check_bias_grad(dy)
    return dy.new_empty(dy.shape[1])


def _bias_grad_setup(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]


bias_grad.register_autograd(lambda ctx, g: g.expand(ctx.rows, -1), setup_context=_bias_grad_setup)  # a sum's gradient: broadcast


# ---------------------------------------------------------------- linear: act(x @ Wᵀ + b)


def _linear_impl_cuda(x, weight, bias, activation, save_preact):
    """Validated by the caller; (y, z)."""
    if x.dim() == 2:  # no reshape/view round trip (~1 µs each) on the common 2-D call
        return _cuda_matmul("nt", x, weight, bias, activation, save_preact)
    x2 = x.reshape(-1, x.shape[-1])
    y, z = _cuda_matmul("nt", x2, weight, bias, activation, save_preact)
    shape = (*x.shape[:-1], weight.shape[0])
    return y.view(shape), (z.view(shape) if z is not None else None)


@custom_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none") -> torch.Tensor:
    _check_linear(x, weight, bias, activation)
    return reference.linear(x, weight, bias, activation)[0]


@linear.register_kernel("cuda")
def _(x, weight, bias=None, activation="none"):
    if activation in _ACTIVATION_SET:
        fast = _fast_2d("nt", x, weight, bias, activation)
        if fast is not None:
            return fast[0]
    _check_linear(x, weight, bias, activation)
    return _linear_impl_cuda(x, weight, bias, activation, False)[0]


@linear.register_fake
def _(x, weight, bias=None, activation="none"):
    _check_linear(x, weight, bias, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.activation, ctx.has_bias = activation, bias is not None
    # relu's derivative only needs the output's sign: keep y (usually held by the next layer
    # anyway). gelu/silu need z, which this op does not return: backward recomputes it with one
    # fused GEMM. Training code should call linear_preact (functional.linear / nn.Linear do).
    saved = output if activation == "relu" else bias if activation in NEEDS_PREACT else None
    ctx.save_for_backward(x, weight, saved)


def _grads_from_dz(ctx, dz, db, x, weight, gy_shape):
    in_f = weight.shape[1]
    dx = gemm.from_backward(dz, weight).view(*gy_shape[:-1], in_f) if ctx.needs_input_grad[0] else None  # (M, out) @ (out, in)
    dw = gemm_tn.from_backward(dz, x.reshape(-1, in_f)) if ctx.needs_input_grad[1] else None  # (M, out)ᵀ @ (M, in)
    return dx, dw, db


def _linear_backward_common(ctx, gy, x, weight, saved):
    """Gradients of act(x @ Wᵀ + b) given the saved z (gelu/silu), y (relu) or None (none)."""
    out_f = weight.shape[0]
    gy2 = gy.reshape(-1, out_f)
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    if ctx.activation == "none":
        dz, db = gy2, (bias_grad.from_backward(gy2) if need_b else None)
    else:
        # One pass: dz = gy * act'(z) and the bias gradient's column sums (eager runs two).
        dz, db = act_grad.from_backward(gy2, saved.reshape(-1, out_f), ctx.activation, need_b)
        db = db if need_b else None
    return _grads_from_dz(ctx, dz, db, x, weight, gy.shape)


def _linear_backward(ctx, gy):
    x, weight, saved = ctx.saved_tensors
    if ctx.activation in NEEDS_PREACT:
        saved = linear.from_backward(x, weight, saved, "none")  # recompute z (saved = bias here)
    return (*_linear_backward_common(ctx, gy, x, weight, saved), None)


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


# ---------------------------------------------------------------- linear_preact: (act(z), z), for training


@custom_op("linear_preact")
def linear_preact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z) with z = x @ Wᵀ + b and y = act(z), both written by one kernel's epilogue."""
    _check_linear(x, weight, bias, activation)
    return reference.linear(x, weight, bias, activation, save_preact=True)


@linear_preact.register_kernel("cuda")
def _(x, weight, bias, activation):
    if activation in _ACTIVATION_SET:
        fast = _fast_2d("nt", x, weight, bias, activation, True)
        if fast is not None:
            return fast
    _check_linear(x, weight, bias, activation)
    return _linear_impl_cuda(x, weight, bias, activation, True)


@linear_preact.register_fake
def _(x, weight, bias, activation):
    _check_linear(x, weight, bias, activation)
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _linear_preact_setup(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.activation, ctx.has_bias = activation, bias is not None
    ctx.save_for_backward(x, weight, output[1])  # z: the one extra (M, out) tensor the backward needs


def _linear_preact_backward(ctx, gy, gz):
    x, weight, z = ctx.saved_tensors
    if gz is None:  # the usual case: only y = act(z) is used downstream
        return (*_linear_backward_common(ctx, gy, x, weight, z), None)
    if gy is not None and ctx.activation == "none":  # y is z
        return (*_linear_backward_common(ctx, gy + gz, x, weight, z), None)
    # Rare: z itself was used downstream, so its gradient adds to dz (or is dz, if y was not used).
    out_f = weight.shape[0]
    dz = gz.reshape(-1, out_f)
    if gy is not None:
        dz = act_grad.from_backward(gy.reshape(-1, out_f), z.reshape(-1, out_f), ctx.activation, False)[0] + dz
    db = bias_grad.from_backward(dz) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (*_grads_from_dz(ctx, dz, db, x, weight, gz.shape), None)


linear_preact.register_autograd(_linear_preact_backward, setup_context=_linear_preact_setup)


# ---------------------------------------------------------------- gemm_act_grad: (dy @ w) · act'(z), db


@custom_op("gemm_act_grad")
def gemm_act_grad(dy: torch.Tensor, w: torch.Tensor, z: torch.Tensor, activation: str, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, db): dz = (dy @ w) * act'(z) in dy's dtype, from one GEMM whose epilogue applies
    act'(z); db = dz summed over rows, or an empty tensor when bias_grad is False. An MLP's
    up-projection backward: dy (M, out), w the down-projection's (out, hidden) weight, z (M, hidden)
    the saved pre-activation. It saves `act_grad`'s pass over dy @ w, z and dz."""
    _check_gemm_act_grad(dy, w, z, activation)
    g = (dy.float() @ w.float()) * reference.activation_grad(z.float(), activation)
    return g.to(dy.dtype), (g.sum(0).to(dy.dtype) if bias_grad else dy.new_empty(0))


def check_grad_activation(activation: str, what: str) -> None:
    """The activations whose derivative a fused backward applies (all but "none")."""
    if activation not in _ACT_GRAD_SET:
        raise ValueError(f"activation: {activation!r}; {what} supports {', '.join(ACTIVATIONS[1:])}")


def _check_gemm_act_grad(dy, w, z, activation) -> None:
    if (
        dy.dtype in DTYPES and w.dtype is dy.dtype and z.dtype is dy.dtype and dy.dim() == 2 and w.dim() == 2
        and w.shape[0] == dy.shape[1] and z.shape == (dy.shape[0], w.shape[1]) and dy.device == w.device == z.device
        and activation in _ACT_GRAD_SET
    ):
        return  # fast accept; otherwise the full check names what is wrong
    check_tensor("dy", dy, DTYPES, ndim=2, contiguous=False)
    check_tensor("w", w, DTYPES, ndim=2, contiguous=False)
    check_tensor("z", z, DTYPES, ndim=2, contiguous=False)
    check_same(("dy", "w"), dy, w)
    check_same(("dy", "z"), dy, z)
    if w.shape[0] != dy.shape[1]:
        raise ValueError(f"w: shape {tuple(w.shape)} does not match dy {tuple(dy.shape)}: w.shape[0] must be dy.shape[1] = {dy.shape[1]}")
    if z.shape != (dy.shape[0], w.shape[1]):
        raise ValueError(f"z: shape {tuple(z.shape)}, expected (dy.shape[0], w.shape[1]) = {(dy.shape[0], w.shape[1])}")
    check_grad_activation(activation, "gemm_act_grad")


def _fusable_nn(*ts) -> bool:
    """Contiguous, 16-byte aligned 2-D operands whose static dims (every size but the first
    operand's rows) are multiples of 8: what the fused kernel takes without padding."""
    return all(t.is_contiguous() and not t.data_ptr() & 15 for t in ts) and not (ts[0].shape[1] | ts[1].shape[1]) & 7


@gemm_act_grad.register_kernel("cuda")
def _(dy, w, z, activation, bias_grad):
    _check_gemm_act_grad(dy, w, z, activation)
    M, K = dy.shape
    N = w.shape[1]
    if not (M and K and _fusable_nn(dy, w, z)):
        # ragged or unaligned sizes, or nothing to multiply: the GEMM and act_grad's pass
        return act_grad.from_backward(_cuda_matmul("nn", dy, w)[0], z, activation, bias_grad)
    kern, bm = _gemm_act_grad_kernel(dy.device, N, K, dy.dtype, activation, M)
    dz, db = dy.new_empty(M, N), dy.new_empty(N)
    kern(dy, w, z, dz, torch.empty(-(-M // bm), N, dtype=torch.float32, device=dy.device), db)
    return dz, (db if bias_grad else dy.new_empty(0))


@gemm_act_grad.register_fake
def _(dy, w, z, activation, bias_grad):
    _check_gemm_act_grad(dy, w, z, activation)
    return dy.new_empty(dy.shape[0], w.shape[1]), dy.new_empty(w.shape[1] if bias_grad else 0)


# ---------------------------------------------------------------- mlp: act(x @ W1ᵀ + b1) @ W2ᵀ + b2


@custom_op("mlp")
def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, z): z = x @ W1ᵀ + b1 and h = act(z), both written by one kernel's epilogue, then
    y = h @ W2ᵀ + b2. h and z are what the backward needs (the functional form returns y only).
    Under one autograd formula the up-projection's output gradient and act' meet in one GEMM
    (`gemm_act_grad`), which two separate `linear` ops cannot do."""
    _check_mlp(x, w1, b1, w2, b2, activation)
    h, z = reference.linear(x, w1, b1, activation, save_preact=True)
    return reference.linear(h, w2, b2)[0], h, z


def _check_mlp(x, w1, b1, w2, b2, activation) -> None:
    check_grad_activation(activation, "mlp (without an activation, use two linear calls)")
    _check_linear(x, w1, b1, activation, ("w1", "b1"))
    if (
        w2.dtype is x.dtype and w2.dim() == 2 and w2.shape[1] == w1.shape[0] and w2.device == x.device
        and (b2 is None or (b2.dtype is x.dtype and b2.dim() == 1 and b2.shape[0] == w2.shape[0] and b2.device == x.device))
    ):
        return  # fast accept of the second layer; otherwise the full check names what is wrong
    check_tensor("w2", w2, DTYPES, ndim=2, contiguous=False)
    check_same(("x", "w2"), x, w2)
    if w2.shape[1] != w1.shape[0]:
        raise ValueError(f"w2: shape {tuple(w2.shape)}, its in_features must be w1's out_features {w1.shape[0]}")
    _check_bias(x, b2, w2, "b2")


@mlp.register_kernel("cuda")
def _(x, w1, b1, w2, b2, activation):
    _check_mlp(x, w1, b1, w2, b2, activation)
    h, z = _linear_impl_cuda(x, w1, b1, activation, True)
    return _linear_impl_cuda(h, w2, b2, "none", False)[0], h, z


@mlp.register_fake
def _(x, w1, b1, w2, b2, activation):
    _check_mlp(x, w1, b1, w2, b2, activation)
    hidden = (*x.shape[:-1], w1.shape[0])
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty(hidden), x.new_empty(hidden)


def _mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, activation = inputs
    ctx.activation, ctx.has_b1, ctx.has_b2 = activation, b1 is not None, b2 is not None
    ctx.save_for_backward(x, w1, w2, output[1], output[2])  # h for dW2, z for act'


def _plus(a, b):
    """a + b where either gradient may be None (absent)."""
    return b if a is None else a if b is None else a + b


def _mlp_backward(ctx, gy, gh, gz):
    x, w1, w2, h, z = ctx.saved_tensors
    need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
    need_b1 = need_b1 and ctx.has_b1
    out_f, hid = w2.shape
    in_f = w1.shape[1]
    z2 = z.reshape(-1, hid)
    gy2 = gy.reshape(-1, out_f) if gy is not None else None  # None: only h or z used downstream
    dw2 = gemm_tn.from_backward(gy2, h.reshape(-1, hid)) if need_w2 and gy2 is not None else None
    db2 = bias_grad.from_backward(gy2) if need_b2 and ctx.has_b2 and gy2 is not None else None
    if gh is None and gz is None:  # the usual case: one GEMM, act' and db1 in its epilogue
        dz, db1 = gemm_act_grad.from_backward(gy2, w2, z2, ctx.activation, need_b1)
    else:  # rare: h or z itself was used downstream too; their gradients add to dh and dz
        dh = _plus(gemm.from_backward(gy2, w2) if gy2 is not None else None, gh.reshape(-1, hid) if gh is not None else None)
        dz = _plus(act_grad.from_backward(dh, z2, ctx.activation, False)[0] if dh is not None else None, gz.reshape(-1, hid) if gz is not None else None)
        db1 = bias_grad.from_backward(dz) if need_b1 else None
    dx = gemm.from_backward(dz, w1).view(*z.shape[:-1], in_f) if need_x else None
    dw1 = gemm_tn.from_backward(dz, x.reshape(-1, in_f)) if need_w1 else None
    return dx, dw1, (db1 if need_b1 else None), dw2, db2, None


mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def linear_auto(x, weight, bias=None, activation="none"):
    """act(x @ Wᵀ + b), choosing the op: `linear_preact` when autograd will need z, else `linear`."""
    if activation in NEEDS_PREACT and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return torch.ops.tileops.linear_preact(x, weight, bias, activation)[0]
    return torch.ops.tileops.linear(x, weight, bias, activation)

