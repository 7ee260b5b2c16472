"""PyTorch reference math and per-dtype tolerances, shared by the CPU path, the tests and the CLI."""
from __future__ import annotations

import torch

# Max abs error allowed vs a float32/float64 reference, per output dtype, for elementwise results:
# a few ulp of the output type at magnitude ~1 (bf16 eps 2^-8, fp16 2^-11, fp32 2^-24).
ELEMENTWISE_ATOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ELEMENTWISE_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Round once from float32, as the kernel does, so CPU and GPU paths give the same bits.
    return (a.float() + b.float()).to(a.dtype)


# ---------------------------------------------------------------- gemm / linear
# GEMM outputs are judged by relative Frobenius error ‖out − ref‖/‖ref‖ against a float32
# reference: one rounding of the output (bf16 2^-9, fp16 2^-12 relative) plus fp32 accumulation
# order, with margin.
GEMM_REL_ERR = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
# Max-abs form for `tileops check` (err ≤ atol + rtol·max|ref|), inputs scaled so |ref| ~ 1.
GEMM_ATOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
GEMM_RTOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


def activation(z: torch.Tensor, act: str) -> torch.Tensor:
    """act(z) in z's dtype (call with float32 for reference math)."""
    if act == "none":
        return z
    if act == "relu":
        return torch.relu(z)
    if act == "gelu":
        return torch.nn.functional.gelu(z)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(z)
    raise ValueError(f"unknown activation {act!r}")


def activation_grad(z: torch.Tensor, act: str) -> torch.Tensor:
    """d act/dz at z (float32 in, float32 out). For relu, z may be the output (same sign)."""
    if act == "none":
        return torch.ones_like(z)
    if act == "relu":
        return (z > 0).to(z.dtype)
    if act == "gelu":
        return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327
    if act == "gelu_tanh":
        k0, k1 = 0.7978845608028654, 0.044715
        t = torch.tanh(k0 * (z + k1 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k0 * (1 + 3 * k1 * z * z)
    if act == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    raise ValueError(f"unknown activation {act!r}")


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 accumulation, rounded once to a.dtype (what the kernel computes)."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


def matmul(layout: str, a, b, bias=None, act: str = "none", save_preact: bool = False):
    """(act(op(a) @ op(b) + bias), z or None) for layout "nn" | "nt" | "tn", float32 math."""
    af, bf = a.float(), b.float()
    if layout == "tn":
        af = af.transpose(-1, -2)
    if layout == "nt":
        bf = bf.transpose(-1, -2)
    z = torch.matmul(af, bf)
    if bias is not None:
        z = z + bias.float()
    y = activation(z, act).to(a.dtype)
    return y, (z.to(a.dtype) if save_preact else None)


def linear(x, weight, bias=None, act: str = "none", save_preact: bool = False):
    """(act(x @ weightᵀ + bias), z) like F.linear + activation; z is empty unless save_preact."""
    z = torch.nn.functional.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    y = activation(z, act).to(x.dtype)
    return y, (z.to(x.dtype) if save_preact else x.new_empty(0))


def mlp(x, w1, b1, w2, b2, act: str):
    """F.linear(act(F.linear(x, w1, b1)), w2, b2) in the inputs' dtype (call with float64 for
    reference math); a bias may be None."""
    F = torch.nn.functional
    return F.linear(activation(F.linear(x, w1, b1), act), w2, b2)


def act_grad(dy, z, act: str, bias_grad: bool):
    """(dy * act'(z) in dy.dtype, column sums of it (float32 sum, cast) or empty)."""
    g = dy.float() * activation_grad(z.float(), act)
    return g.to(dy.dtype), (g.sum(0).to(dy.dtype) if bias_grad else dy.new_empty(0))


# Attention: relative error (‖out − ref‖ / ‖ref‖) allowed vs a float64 reference, for the output and
# each gradient. bf16 keeps 8 mantissa bits (eps 2^-8 ≈ 3.9e-3), fp16 11 (2^-11 ≈ 4.9e-4); P and dS
# are rounded to the input dtype before their GEMMs, as in every FlashAttention.
ATTENTION_REL_ERR = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
# Max-abs form for `tileops check` (err <= atol + rtol * max|ref|), unit-normal q, k, v.
ATTENTION_ATOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
ATTENTION_RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _attention_mask(sq: int, sk: int, causal: bool, device) -> torch.Tensor | None:
    """Bool (sq, sk), True where query i may see key j: j <= i + sk - sq (bottom-right aligned)."""
    if not causal:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return j <= i + (sk - sq)


def flash_attn(q, k, v, causal: bool, scale: float, compute_dtype=torch.float32):
    """Attention in flash-attn's layout, q (B, Sq, H, D), k/v (B, Sk, HK, D), H % HK == 0.

    Returns (out (B, Sq, H, D) in compute_dtype, lse (B, H, Sq) natural log, float32 or wider).
    Rows that see no key give out 0 and lse -inf; differentiable without NaN (the shift m is
    detached and an empty row's sum is replaced by 1), so tests can take gradients through it.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.to(compute_dtype).transpose(1, 2)  # (B, H, Sq, D)
    kh = k.to(compute_dtype).repeat_interleave(groups, dim=2).transpose(1, 2)  # (B, H, Sk, D)
    vh = v.to(compute_dtype).repeat_interleave(groups, dim=2).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    mask = _attention_mask(q.shape[1], k.shape[1], causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    out = (e / l_safe) @ vh
    lse = torch.where(seen, m + torch.log(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    return out.transpose(1, 2), lse


def flash_attn_backward(dout, q, k, v, out, lse, causal: bool, scale: float, dlse=None):
    """Gradients from the saved (out, lse), in float32, as the kernels compute them:
    P = exp(scale * q.k - lse), dS = P * (dO.v - rowsum(dO * O) + dlse), dQ = scale * dS K,
    dK = scale * dS^T Q (summed over the query heads of each kv head), dV = P^T dO.
    Returns (dq, dk, dv) in the input dtype."""
    f = torch.float32
    B, Sq, H, D = q.shape
    Sk, HK = k.shape[1], k.shape[2]
    groups = H // HK
    qh, doh, oh = (t.to(f).transpose(1, 2) for t in (q, dout, out))  # (B, H, Sq, D)
    kh = k.to(f).repeat_interleave(groups, dim=2).transpose(1, 2)  # (B, H, Sk, D)
    vh = v.to(f).repeat_interleave(groups, dim=2).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) * scale
    visible = _attention_mask(Sq, Sk, causal, q.device)
    lse4 = lse.to(f).unsqueeze(-1)
    p = torch.exp(s - lse4)  # rows with lse = -inf give inf here; the selects below drop them
    keep = torch.isfinite(lse4) if visible is None else torch.isfinite(lse4) & visible
    p = torch.where(keep, p, torch.zeros_like(p))
    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * oh).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(f).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = ds @ kh
    dk = ds.transpose(-1, -2) @ qh
    dk = dk.transpose(1, 2).reshape(B, Sk, HK, groups, D).sum(3)
    dv = dv.transpose(1, 2).reshape(B, Sk, HK, groups, D).sum(3)
    return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- softmax / log_softmax
# Max error vs a float64 reference, per dtype, for softmax-family outputs (probabilities <= 1,
# log-probabilities and gradients of magnitude ~1): fp32 accumulation, one rounding to the output
# dtype, plus exp2's ~2 ulp. bf16/fp16 are bounded by the final rounding (eps 2^-8, 2^-11); fp32
# by the row sum, whose relative error grows like sqrt(N) * 2^-24 (~3e-5 at N = 262144, PyTorch's
# own CPU kernel included).
SOFTMAX_ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SOFTMAX_RTOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# log_softmax = x - logsumexp(x) cancels: fp32's absolute error scales with |x| + |lse| (~1e-5 at
# |x| ~ 30, PyTorch's own CPU kernel included), so fp32 gets a wider atol; 16-bit is rounding-bound.
LOG_SOFTMAX_ATOL = {**SOFTMAX_ATOL, torch.float32: 5e-5}
LOG_SOFTMAX_RTOL = SOFTMAX_RTOL


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    # fp32 math, one rounding to x.dtype, contiguous output: the same contract as the kernels.
    return torch.softmax(x.float(), dim).to(x.dtype).contiguous()


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim).to(x.dtype).contiguous()


def softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    g, yf = grad.float(), y.float()
    return (yf * (g - (g * yf).sum(dim, keepdim=True))).to(y.dtype).contiguous()


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    g, yf = grad.float(), y.float()
    return (g - yf.exp() * g.sum(dim, keepdim=True)).to(y.dtype).contiguous()


# ---------------------------------------------------------------- layer_norm
# Max error vs a float64 reference: y is O(1) after normalization, so one rounding to the output
# dtype dominates (bf16 2^-8, fp16 2^-11); fp32 adds the row sums' ~sqrt(n) * 2^-24.
LAYER_NORM_ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LAYER_NORM_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def layer_norm(x, weight, bias, eps: float, out_dtype=None):
    """(y in out_dtype or x.dtype, mean, rstd) over the last dim, float32 math (as the kernels)."""
    xf = x.float()
    mean = xf.mean(-1) if x.shape[-1] else torch.full(x.shape[:-1], float("nan"), device=x.device)
    var = (xf - mean.unsqueeze(-1)).square().mean(-1) if x.shape[-1] else mean.clone()
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).contiguous(), mean.contiguous(), rstd.contiguous()


def add_layer_norm(x, residual, weight, bias, eps: float, out_dtype=None):
    """(h = x + residual in x.dtype, then layer_norm(h)'s y, mean, rstd)."""
    h = (x.float() + residual.float()).to(x.dtype)
    return (h.contiguous(), *layer_norm(h, weight, bias, eps, out_dtype))


def add_layer_norm_backward(dy, dh, h, weight, mean, rstd, residual_dtype):
    """(dx = h's whole gradient (through the norm, plus dh) in h.dtype, the same in
    residual_dtype, dweight, dbias): float32 math."""
    dxn, dw, db = _layer_norm_backward_f32(dy, h, weight, mean, rstd)
    if dh is not None:
        dxn = dxn + dh.float()
    return dxn.to(h.dtype).contiguous(), dxn.to(residual_dtype, copy=True).contiguous(), dw, db  # two tensors, never aliases


def layer_norm_backward(dy, x, weight, mean, rstd):
    """(dx in x.dtype, dweight, dbias in weight's dtype or x's): float32 math."""
    dx, dw, db = _layer_norm_backward_f32(dy, x, weight, mean, rstd)
    return dx.to(x.dtype).contiguous(), dw, db


def _layer_norm_backward_f32(dy, x, weight, mean, rstd):
    """(dx in float32, dweight, dbias in weight's dtype or x's)."""
    n = x.shape[-1]
    xhat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dyf = dy.float()
    g = dyf * weight.float() if weight is not None else dyf
    c1 = (g * xhat).mean(-1, keepdim=True) if n else g.sum(-1, keepdim=True)
    c2 = g.mean(-1, keepdim=True) if n else g.sum(-1, keepdim=True)
    dx = rstd.unsqueeze(-1) * (g - xhat * c1 - c2)
    wdtype = x.dtype if weight is None else weight.dtype
    lead = tuple(range(x.dim() - 1))
    dw = (dyf * xhat).sum(lead) if lead else dyf * xhat
    db = dyf.sum(lead) if lead else dyf
    return dx, dw.to(wdtype).contiguous(), db.to(wdtype).contiguous()
