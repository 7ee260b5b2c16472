"""Public functional API: thin, documented wrappers over torch.ops.tileops.*."""
from __future__ import annotations

import math

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


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` on tensor cores, float32 accumulation, output in the inputs' dtype.

    Args:
        a: (M, K) or batched (B, M, K); float16 or bfloat16.
        b: (K, N), or (B, K, N) with the same B. A 2-D ``b`` with a 3-D ``a`` folds the batch
            into M (one kernel launch).

    Returns:
        (M, N) or (B, M, N) in ``a.dtype``. Differentiable (backward: ``gemm_nt`` / ``gemm_tn``).

    M and B are symbolic (one compiled kernel per (K, N, dtype)); K and N not multiples of 8 are
    zero-padded on the host (a copy), because TMA needs 16-byte row strides. Non-contiguous inputs
    are copied, except a ``b`` that is the transpose of a contiguous (N, K) tensor, which is read
    in place by the "nt" kernel.
    """
    return torch.ops.tileops.gemm(a, b)


BACKENDS = ("tilelang", "cublas")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none", backend: str = "tilelang") -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in one kernel (bias and activation fused into the epilogue).

    Args:
        x: (..., in_features), float16 or bfloat16 (float32 falls back to PyTorch math; under
            autocast, inputs are cast to the autocast dtype first).
        weight: (out_features, in_features), same dtype and device.
        bias: (out_features,) or None.
        activation: "none" | "relu" | "gelu" (erf) | "gelu_tanh" | "silu".
        backend: "tilelang" (our GEMM kernels) or "cublas": the three GEMMs (forward, dX, dW) by
            PyTorch (cuBLAS/cuBLASLt, bias in its epilogue) and the bias gradient by our column-sum
            kernel (``torch.ops.tileops.bias_grad``; PyTorch's ``sum(0)`` reads the gradient at
            about half the bandwidth). For shapes where cuBLAS's GEMM is faster than ours;
            activation "none" only.

    Returns:
        (..., out_features) in x's dtype. Differentiable in x, weight and bias. When autograd
        will need it (gelu / gelu_tanh / silu and an input requires grad), the forward kernel also
        writes the pre-activation z (one extra (..., out_features) tensor, saved for backward);
        relu saves nothing extra (it uses the output), none saves nothing. The "cublas" backend
        saves x and weight, as ``F.linear`` does.
    """
    check_backend(backend, activation)
    return _linear(x, weight, bias, activation, backend)


def _linear(x, weight, bias, activation: str, backend: str) -> torch.Tensor:
    """`linear` after its argument checks (`nn.Linear` runs them once, at construction)."""
    if torch.is_autocast_enabled(x.device.type):
        x, weight, bias = _autocast(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        from . import reference
        from .ops._checks import check_activation

        check_activation(activation)
        return reference.activation(torch.nn.functional.linear(x, weight, bias), activation)
    if backend == "cublas":
        return _CublasLinear.apply(x, weight, bias)
    from .ops.gemm import linear_auto

    return linear_auto(x, weight, bias, activation)


def _autocast(*ts):
    """The tensors (None kept) in the autocast dtype of the first one's device type."""
    dt = torch.get_autocast_dtype(ts[0].device.type)
    return tuple(t.to(dt) if t is not None else None for t in ts)


def check_backend(backend: str, activation: str) -> None:
    """Raises ValueError for an unknown backend, or "cublas" with an activation."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not supported; supported: {', '.join(BACKENDS)}")
    if backend == "cublas" and activation != "none":
        raise ValueError(f"backend: 'cublas' serves activation 'none' only (got {activation!r}); use backend='tilelang' for a fused activation")


class _CublasLinear(torch.autograd.Function):
    """x @ Wᵀ + b with PyTorch's GEMMs (cuBLAS) and our bias gradient. A plain autograd.Function:
    torch.compile traces it (and the tileops op inside its backward) without a graph break.
    forward(ctx, ...) rather than a separate setup_context: with one, every `apply` binds the
    arguments through inspect.signature (~20 µs of host time per call)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        dx = gy @ weight if ctx.needs_input_grad[0] else None
        dw = gy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = torch.ops.tileops.bias_grad(gy2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, activation: str = "gelu_tanh") -> torch.Tensor:
    """``act(x @ w1.T + b1) @ w2.T + b2``: a Linear-activation-Linear block under one autograd formula.

    The forward is two `linear` kernels (bias and activation in the first one's epilogue, which
    also writes the pre-activation z for backward). The backward's gain over two `linear` calls:
    the GEMM that computes the hidden layer's output gradient (dy @ w2) multiplies by act'(z) and
    sums the first bias's gradient in its epilogue (``torch.ops.tileops.gemm_act_grad``), so no
    separate pass over the (tokens, hidden) gradient runs.

    Args:
        x: (..., in_features), float16 or bfloat16 (float32: PyTorch math; autocast as `linear`).
        w1: (hidden, in_features); b1: (hidden,) or None.
        w2: (out_features, hidden); b2: (out_features,) or None.
        activation: "relu" | "gelu" | "gelu_tanh" | "silu".

    Returns:
        (..., out_features) in x's dtype, differentiable in x, w1, b1, w2 and b2. Saved for
        backward: x, w1, w2, the hidden activations h and the pre-activation z (what two `linear`
        layers save too).
    """
    if torch.is_autocast_enabled(x.device.type):
        x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    if x.dtype == torch.float32 and w1.dtype == torch.float32 and w2.dtype == torch.float32:
        from . import reference
        from .ops.gemm import check_grad_activation

        check_grad_activation(activation, "mlp")
        h = reference.activation(torch.nn.functional.linear(x, w1, b1), activation)
        return torch.nn.functional.linear(h, w2, b2)
    return torch.ops.tileops.mlp(x, w1, b1, w2, b2, activation)[0]


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """``dy.sum(0)`` for a 2-D float16 / bfloat16 ``dy`` (M, N): (N,) in dy's dtype, summed in
    fp32 in a fixed order (deterministic). A linear layer's bias gradient, at the copy bandwidth
    on CUDA (one read of dy; one host call, two kernels: per-block partials, then their fold)."""
    return torch.ops.tileops.bias_grad(dy)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / sum(exp(x), dim)``, numerically stable; a drop-in for ``torch.softmax(x, dim)``.

    Args:
        x: tensor of any shape (0-d and empty included), float32 / float16 / bfloat16.
        dim: the reduced dim, negative counts from the end. The last dim is the fast path; any
            other dim is moved last and back (two extra copies of ``x``), and a non-contiguous
            ``x`` is copied once.

    Returns:
        A contiguous tensor like ``x``: fp32 math, rounded once to ``x.dtype``. Same edge values
        as PyTorch: a row of all -inf, or with a +inf or NaN, gives NaN.
        On CUDA a TileLang kernel runs on the current stream (each distinct row length compiles
        once; the row count is symbolic); elsewhere the PyTorch reference. Differentiable: the
        backward is ``torch.ops.tileops.softmax_backward`` and saves only the output.
    """
    return torch.ops.tileops.softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - logsumexp(x, dim)``; a drop-in for ``torch.log_softmax(x, dim)``.

    Args:
        x: tensor of any shape, float32 / float16 / bfloat16.
        dim: the reduced dim (see :func:`softmax` for the cost of a dim other than the last).

    Returns:
        A contiguous tensor like ``x`` (fp32 math, one rounding). Differentiable through
        ``torch.ops.tileops.log_softmax_backward``, which saves only the output.
    """
    return torch.ops.tileops.log_softmax(x, dim)


# ---------------------------------------------------------------- attention
def flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False
):
    """FlashAttention in flash-attn's ``flash_attn_func`` layout (``torch.ops.tileops.flash_attn``).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16; headdim 64, 128 or 256.
        k: (batch, seqlen_k, nheads_kv, headdim), same dtype and device; nheads % nheads_kv == 0
            (GQA/MQA: query head h uses kv head h // (nheads // nheads_kv); K/V are not repeated).
        v: same shape as k.
        causal: mask aligned to the bottom-right corner, as flash-attn >= 2.1: query i sees key j
            iff j <= i + seqlen_k - seqlen_q. Rows that see no key (seqlen_q > seqlen_k) output 0.
        softmax_scale: finite, > 0; default 1 / sqrt(headdim).
        return_lse: also return lse.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype, contiguous.
        lse (if return_lse): (batch, nheads, seqlen_q) float32, natural log of the softmax
            denominator, log(sum_j exp(softmax_scale * q_i . k_j)); -inf for rows that see no key.

    Differentiable in q, k, v (and through lse). Sequence lengths, batch and head counts are
    symbolic: one compiled kernel per (headdim, dtype, causal, GQA ratio, softmax_scale).
    Strided inputs whose last dim is contiguous (q, k, v unbound from a packed QKV projection,
    SDPA's layout transposed) are read as they are, forward and backward; other layouts are copied.
    Backward determinism: by default dQ is accumulated with fp32 atomics (fastest), so dQ can differ
    in the last bits between runs; dK and dV are deterministic. Under
    ``torch.use_deterministic_algorithms(True)`` the CUDA backward is bitwise deterministic (dq, dk,
    dv identical run to run on the same device and inputs): dQ comes from a separate kernel that
    recomputes the scores per query block instead of using atomics, which costs backward time
    (measured cost: docs/benchmarks.md, "Deterministic backward"). The flag is read when the
    backward runs.
    """
    if return_lse:
        return torch.ops.tileops.flash_attn_with_lse(q, k, v, causal, softmax_scale)
    return torch.ops.tileops.flash_attn(q, k, v, causal, softmax_scale)


def flash_attn_qkvpacked(qkv: torch.Tensor, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Self-attention over one packed projection, flash-attn's ``flash_attn_qkvpacked_func``
    (``torch.ops.tileops.flash_attn_qkvpacked``).

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim), float16 or bfloat16; headdim 64, 128 or 256 —
            e.g. ``linear(x, w_qkv).view(B, S, 3, H, D)``. Any strides with the last dim
            contiguous are read in place.
        causal, softmax_scale, return_lse: as :func:`flash_attn` (seqlen_q = seqlen_k here).

    Returns:
        out: (batch, seqlen, nheads, headdim); lse (if return_lse) as :func:`flash_attn`.

    Same kernels and results as ``flash_attn(*qkv.unbind(2), ...)``, but differentiable in qkv
    with one gradient: the backward writes dq, dk and dv into one (batch, seqlen, 3, nheads,
    headdim) tensor, where unbind + flash_attn has autograd stack three gradients (a copy of the
    whole gradient). Under ``torch.use_deterministic_algorithms(True)``, or with a gradient
    flowing into lse, the backward runs :func:`flash_attn`'s and stacks.
    """
    if return_lse:
        return torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, causal, softmax_scale)
    return torch.ops.tileops.flash_attn_qkvpacked(qkv, causal, softmax_scale)


def _sdpa_supported(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    from .ops.attention import DTYPES, HEADDIMS

    tensors = (query, key, value)
    if attn_mask is not None or dropout_p != 0.0:
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if any(t.dtype != query.dtype or t.device != query.device for t in tensors) or query.dtype not in DTYPES:
        return False
    (B, H, Sq, D), (Bk, Hk, Sk, Dk) = query.shape, key.shape
    if key.shape != value.shape or Bk != B or Dk != D or D not in HEADDIMS or 0 in (B, H, Sq, Hk, Sk):
        return False
    if Hk != H and not (enable_gqa and H % Hk == 0):
        return False
    if is_causal and Sq != Sk:  # SDPA's causal mask is top-left aligned, ours bottom-right
        return False
    return scale is None or (isinstance(scale, float) and math.isfinite(scale) and scale > 0)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` ((B, H, S, D) layout).

    Runs ``torch.ops.tileops.flash_attn`` (on any device: TileLang on CUDA, the PyTorch reference
    elsewhere) when ALL of these hold, and otherwise calls PyTorch's SDPA with the same arguments:
      - ``attn_mask is None`` and ``dropout_p == 0.0``;
      - query, key, value are 4-D, one dtype (float16 or bfloat16), one device;
      - key and value have the same shape, the same batch and head dim as query, and head dim
        64, 128 or 256 (SDPA's value head dim may differ; ours may not);
      - no dimension is 0;
      - key heads == query heads, or ``enable_gqa`` and query heads % key heads == 0;
      - ``is_causal`` only when seqlen_q == seqlen_k: SDPA aligns its causal mask to the top-left
        corner, flash-attn (and this library) to the bottom-right; they agree only when square;
      - ``scale`` is None or a finite positive float.
    Results therefore always follow SDPA's semantics. Inputs are passed to the kernel as
    (B, S, H, D) transposed views (read in place, no copy); the output is a (B, H, S, D) view of a
    (B, S, H, D) tensor, as with SDPA's flash backend.
    """
    if not _sdpa_supported(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs
        )
    out = torch.ops.tileops.flash_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal, scale)
    return out.transpose(1, 2)


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` in one kernel, optionally writing
    its output in another dtype.

    Args:
        x: (..., *normalized_shape), float32 / float16 / bfloat16.
        normalized_shape: int or tuple, the trailing dims normalized over (flattened into one; a
            non-contiguous x is copied). Rows up to 16384 elements on CUDA.
        weight, bias: normalized_shape-shaped, x's dtype or float32, or None.
        eps: added to the (biased) variance.
        out_dtype: dtype of the result (None: x's). E.g. ``torch.bfloat16`` for an fp32 residual
            stream that feeds a Linear under bf16 autocast: the Linear would cast it anyway, so
            the result is the same and the separate cast kernel is gone.

    Returns:
        Tensor of x's shape. Math in float32; differentiable in x, weight and bias (backward: one
        host call, deterministic). Autocast does not change this op's dtypes.
    """
    shape = _norm_shape(x, normalized_shape)
    if len(shape) == 1:
        return torch.ops.tileops.layer_norm(x, weight, bias, eps, out_dtype)[0]
    y = torch.ops.tileops.layer_norm(_rows(x, shape), _flat(weight), _flat(bias), eps, out_dtype)[0]
    return y.view(x.shape)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; (h, F.layer_norm(h, ...))`` in one kernel: a pre-norm block's residual
    add and the next norm (FlashAttention's `dropout_add_layer_norm` with prenorm, without dropout).

    h stays in x's dtype (the residual stream, e.g. float32); residual may be narrower (a bf16
    branch output under autocast; a wider one raises). The backward is one kernel too: h's
    gradient from the stream is added to the norm's, and the branch's gradient is written in the
    branch's dtype, so the add and the cast kernels a separate `x + residual` costs are gone.
    Other arguments and the result y: as `layer_norm`.
    """
    shape = _norm_shape(x, normalized_shape)
    if len(shape) == 1:
        h, y = torch.ops.tileops.add_layer_norm(x, residual, weight, bias, eps, out_dtype)[:2]
        return h, y
    h, y = torch.ops.tileops.add_layer_norm(_rows(x, shape), _rows(residual, shape), _flat(weight), _flat(bias), eps, out_dtype)[:2]
    return h.view(x.shape), y.view(x.shape)


def _norm_shape(x, normalized_shape) -> tuple:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape: {shape} does not match the trailing dims of x's shape {tuple(x.shape)}")
    return shape


def _rows(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    return t.reshape(*t.shape[: t.dim() - len(shape)], -1)


def _flat(t):
    return None if t is None else t.reshape(-1)
