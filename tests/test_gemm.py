"""GEMM family: tileops.gemm / gemm_nt / gemm_tn / linear / linear_preact / act_grad / bias_grad, nn.Linear.

Errors are relative Frobenius norms against float32 math on the same (rounded) inputs. On the GPU
the static dims (K, N) come from a small pool — each pair is a compiled kernel, pre-built into
the carried cache by benchmarks/warm_gemm_cache.py — while M (symbolic) is fuzzed freely.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

import tilelang_ops
from tilelang_ops import nn as tnn
from tilelang_ops import reference
from tilelang_ops.ops import gemm as G

from .helpers import DEVICES, HAS_CUDA, RecordOps, poisoned_cuda_allocation, rel_err, requires_cuda

DTYPES = [torch.bfloat16, torch.float16]
ACTS = list(reference.ACTIVATIONS)
TOL = reference.GEMM_REL_ERR

# (K, N) pairs the GPU tests use (kept few: each is a compiled kernel per layout and dtype).
KN_POOL = [
    (64, 128),  # one K step, one narrow N tile
    (72, 200),  # K, N multiples of 8 but not of 16/64: ragged tiles through TMA zero-fill
    (13, 5),  # neither a multiple of 8: host zero-pads to (16, 8)
]
LINEAR_IN_OUT = (72, 200)  # (in_features, out_features) for GPU linear tests
M_CASES = [
    1,  # a single token
    7,  # fewer rows than one wgmma m-tile
    128,  # exactly one block_M
    300,  # several blocks + ragged tail
]


def _randn(*shape, dtype, device, scale=1.0):
    return torch.randn(*shape, dtype=dtype, device=device) * scale


def _check(out, ref, dtype, what=""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: rel err {err:.2e} > {TOL[dtype]:.0e}"


# ---------------------------------------------------------------- forward: gemm and friends


def _gemm_case(m, k, n, dtype, device, layout="nn", batch=None):
    lead = (batch,) if batch else ()
    if layout == "nn":
        a, b = _randn(*lead, m, k, dtype=dtype, device=device), _randn(*lead, k, n, dtype=dtype, device=device)
        return torch.ops.tileops.gemm, a, b, a.float() @ b.float()
    if layout == "nt":
        a, b = _randn(*lead, m, k, dtype=dtype, device=device), _randn(*lead, n, k, dtype=dtype, device=device)
        return torch.ops.tileops.gemm_nt, a, b, a.float() @ b.float().transpose(-1, -2)
    # tn: a (R, P), b (R, N) -> (P, N); R is the symbolic reduction
    a, b = _randn(*lead, m, k, dtype=dtype, device=device), _randn(*lead, m, n, dtype=dtype, device=device)
    return torch.ops.tileops.gemm_tn, a, b, a.float().transpose(-1, -2) @ b.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("m", M_CASES)
@pytest.mark.parametrize("kn", KN_POOL, ids=lambda kn: f"k{kn[0]}n{kn[1]}")
def test_gemm_layouts_match_reference(device, dtype, layout, m, kn):
    op, a, b, ref = _gemm_case(m, *kn, dtype, device, layout)
    _check(op(a, b), ref, dtype, f"{layout} m={m} k,n={kn}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_gemm_batched(device, layout):
    op, a, b, ref = _gemm_case(100, 72, 200, torch.bfloat16, device, layout, batch=3)
    _check(op(a, b), ref, torch.bfloat16, f"batched {layout}")


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_3d_a_2d_b_folds_batch(device):
    a, b = _randn(2, 50, 72, dtype=torch.bfloat16, device=device), _randn(72, 200, dtype=torch.bfloat16, device=device)
    _check(torch.ops.tileops.gemm(a, b), a.float() @ b.float(), torch.bfloat16, "folded")


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_non_contiguous_inputs(device):
    # Copied to contiguous on the host (documented); a transposed (N, K) weight is read in place.
    big = _randn(300, 160, dtype=torch.bfloat16, device=device)
    a = big[:, ::2]  # (300, 80) strided
    w = _randn(200, 72, dtype=torch.bfloat16, device=device)
    _check(torch.ops.tileops.gemm(a[:, :72], w.t()), a[:, :72].float() @ w.float().t(), torch.bfloat16, "strided a, transposed b")
    offset = _randn(1, 72 * 128 + 1, dtype=torch.bfloat16, device=device)[0, 1:].view(72, 128)  # 2 bytes off 16-byte alignment
    _check(torch.ops.tileops.gemm(a[:5, :72].contiguous(), offset), a[:5, :72].float() @ offset.float(), torch.bfloat16, "misaligned b")


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_empty(device):
    a = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    b = _randn(64, 128, dtype=torch.bfloat16, device=device)
    assert torch.ops.tileops.gemm(a, b).shape == (0, 128)
    # zero-length reduction: zeros, like torch
    out = torch.ops.tileops.gemm(torch.empty(5, 0, dtype=torch.bfloat16, device=device), torch.empty(0, 8, dtype=torch.bfloat16, device=device))
    assert out.shape == (5, 8) and (out == 0).all()


@given(
    m=st.integers(1, 700),
    kn=st.sampled_from(KN_POOL) if HAS_CUDA else st.tuples(st.integers(1, 150), st.integers(1, 150)),
    layout=st.sampled_from(["nn", "nt", "tn"]),
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(DEVICES),
)
def test_gemm_fuzz_shapes(m, kn, layout, dtype, device):
    if device == "cuda":
        kn = kn if kn in KN_POOL else KN_POOL[1]
    op, a, b, ref = _gemm_case(m, *kn, dtype, device, layout)
    _check(op(a, b), ref, dtype, f"{layout} m={m} k,n={kn}")


# ---------------------------------------------------------------- forward: linear + activation


def _linear_ref(x, w, b, act):
    return reference.activation(torch.nn.functional.linear(x.float(), w.float(), b.float() if b is not None else None), act)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 100)], ids=["one-token", "few-rows", "batched-3d"])
def test_linear_matches_reference(device, act, shape):
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(*shape, in_f, dtype=torch.bfloat16, device=device)
    w = _randn(out_f, in_f, dtype=torch.bfloat16, device=device, scale=in_f**-0.5)
    b = _randn(out_f, dtype=torch.bfloat16, device=device)
    _check(torch.ops.tileops.linear(x, w, b, act), _linear_ref(x, w, b, act), torch.bfloat16, f"linear {act}")
    y, z = torch.ops.tileops.linear_preact(x, w, b, act)
    _check(y, _linear_ref(x, w, b, act), torch.bfloat16, f"linear_preact y {act}")
    _check(z, _linear_ref(x, w, b, "none"), torch.bfloat16, f"linear_preact z {act}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_no_bias_and_fp16(device, dtype):
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(300, in_f, dtype=dtype, device=device)
    w = _randn(out_f, in_f, dtype=dtype, device=device, scale=in_f**-0.5)
    _check(torch.ops.tileops.linear(x, w, None, "gelu_tanh"), _linear_ref(x, w, None, "gelu_tanh"), dtype, "no bias")


# ---------------------------------------------------------------- backward


def _grads(fn, inputs, g):
    inputs = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*inputs)
    out.backward(g)
    return out, [t.grad if t is not None else None for t in inputs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, 2)], ids=["bf16", "fp16", "bf16-batched"])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_gemm_backward(device, dtype, layout, batch):
    op, a, b, _ = _gemm_case(77, 72, 200, dtype, device, layout, batch)
    ref_op = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.transpose(-1, -2), "tn": lambda a, b: a.transpose(-1, -2) @ b}[layout]
    g = torch.randn(ref_op(a.float(), b.float()).shape, device=device).to(dtype)
    out, (ga, gb) = _grads(op, [a, b], g)
    _, (ra, rb) = _grads(ref_op, [a.float(), b.float()], g.float())
    _check(ga, ra, dtype, f"{layout} da")
    _check(gb, rb, dtype, f"{layout} db")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("entry", ["functional", "op"])
def test_linear_backward(device, act, bias, entry):
    # "functional" trains through linear_preact (z saved); "op" calls tileops.linear directly
    # (gelu/silu then recompute z in backward).
    dtype = torch.bfloat16
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(3, 50, in_f, dtype=dtype, device=device)
    w = _randn(out_f, in_f, dtype=dtype, device=device, scale=in_f**-0.5)
    b = _randn(out_f, dtype=dtype, device=device) if bias else None
    g = torch.randn(3, 50, out_f, device=device).to(dtype)
    fn = tilelang_ops.linear if entry == "functional" else torch.ops.tileops.linear
    _, grads = _grads(lambda x, w, b: fn(x, w, b, act), [x, w, b], g)
    _, refs = _grads(lambda x, w, b: _linear_ref(x, w, b, act), [x.float(), w.float(), b.float() if bias else None], g.float())
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, refs):
        if want is not None:
            _check(got, want, dtype, f"{act} {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_backward_fp16_and_frozen_weight(device):
    dtype = torch.float16
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(64, in_f, dtype=dtype, device=device, scale=0.5).requires_grad_()
    w = _randn(out_f, in_f, dtype=dtype, device=device, scale=in_f**-0.5)  # frozen: no dW GEMM
    b = _randn(out_f, dtype=dtype, device=device).requires_grad_()
    g = torch.randn(64, out_f, device=device).to(dtype)
    tilelang_ops.linear(x, w, b, "gelu_tanh").backward(g)
    xr, br = x.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    _linear_ref(xr, w, br, "gelu_tanh").backward(g.float())
    _check(x.grad, xr.grad, dtype, "dx")
    _check(b.grad, br.grad, dtype, "db")
    assert w.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_grad", [True, False], ids=["db", "no-db"])
@pytest.mark.parametrize("rows", [1, 61, 300])  # CUDA: up to ACT_GRAD_SINGLE_ROWS (64) one kernel, then partials
def test_act_grad(device, act, bias_grad, rows):
    dy = _randn(rows, 200, dtype=torch.bfloat16, device=device)
    z = _randn(rows, 200, dtype=torch.bfloat16, device=device)
    dz, db = torch.ops.tileops.act_grad(dy, z, act, bias_grad)
    want = dy.float() * reference.activation_grad(z.float(), act)
    _check(dz, want, torch.bfloat16, "dz")
    if bias_grad:
        _check(db, want.sum(0), torch.bfloat16, "db")
    else:
        assert db.shape == (0,) and db.dtype == dy.dtype
    zr = z.float().requires_grad_()
    reference.activation(zr, act).backward(dy.float())  # the analytic derivative agrees with autograd
    _check(dz, zr.grad, torch.bfloat16, "dz vs autograd")


class _TirMath:
    """The `T.*` calls of kernels/gemm.py's activation formulas, on float64 torch tensors: the
    formulas the epilogues compile, evaluated here without a GPU (fast-math intrinsics exact)."""

    float32 = staticmethod(float)
    tanh, erf, exp = staticmethod(torch.tanh), staticmethod(torch.erf), staticmethod(torch.exp)
    max = staticmethod(lambda a, b: torch.maximum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)))
    if_then_else = staticmethod(torch.where)
    fast_rcp = staticmethod(torch.reciprocal)
    call_extern = staticmethod(lambda dtype, name, x: {"__tanhf": torch.tanh}[name](x))


@pytest.mark.parametrize("act", ACTS)
def test_epilogue_activation_formulas(act, monkeypatch):
    """The activation and its derivative as the fused kernels write them (`_act`, `_act_grad`, the
    TIR the GEMM epilogues and act_grad compile) against torch's activation and its autograd
    derivative, in float64 over [-10, 10]: a wrong derivative formula fails here, on any machine,
    not only in the GPU tests."""
    from tilelang_ops.kernels import gemm as K

    monkeypatch.setattr(K, "T", _TirMath)
    z = torch.linspace(-10, 10, 4001, dtype=torch.float64)
    zr = z.clone().requires_grad_()
    y = reference.activation(zr, act)
    y.backward(torch.ones_like(z))
    torch.testing.assert_close(torch.as_tensor(K._act(z, act), dtype=torch.float64).expand_as(z), y.detach(), atol=1e-12, rtol=1e-12)
    grad = torch.as_tensor(K._act_grad(z, act), dtype=torch.float64).expand_as(z)
    torch.testing.assert_close(grad, zr.grad, atol=1e-9, rtol=1e-9)


# bias_grad: (M, N) shapes: one row; ragged rows and columns; past one CTA's 512 rows with a
# ragged tail; the GPT widths (QKV 2304, 768) over several partial rows.
BIAS_GRAD_SHAPES = [(1, 8), (17, 200), (1000, 72), (4097, 768), (6337, 2304)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BIAS_GRAD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bias_grad(device, dtype, shape):
    dy = _randn(*shape, dtype=dtype, device=device) + 0.5  # a nonzero mean: the sums do not cancel
    _check(torch.ops.tileops.bias_grad(dy), dy.double().sum(0), dtype, "bias_grad")


@given(m=st.integers(1, 3000), n=st.sampled_from([8, 72, 200, 768]), dtype=st.sampled_from(DTYPES), device=st.sampled_from(DEVICES))
def test_bias_grad_fuzz_shapes(m, n, dtype, device):
    dy = _randn(m, n, dtype=dtype, device=device) + 0.5
    _check(torch.ops.tileops.bias_grad(dy), dy.double().sum(0), dtype, f"bias_grad {m}x{n}")


@pytest.mark.parametrize("device", DEVICES)
def test_bias_grad_strided_and_empty(device):
    big = _randn(300, 400, dtype=torch.bfloat16, device=device)
    _check(torch.ops.tileops.bias_grad(big[:, ::2]), big[:, ::2].double().sum(0), torch.bfloat16, "strided")  # copied (documented)
    out = torch.ops.tileops.bias_grad(torch.empty(0, 24, dtype=torch.bfloat16, device=device))
    assert out.shape == (24,) and (out == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cublas_backend_gradients(device, dtype):
    # backend="cublas": PyTorch's GEMMs, our bias gradient; same parameters as the default backend.
    torch.manual_seed(0)
    lin = tnn.Linear(72, 200, backend="cublas").to(device, dtype)
    assert "backend=cublas" in repr(lin)
    x = _randn(3, 41, 72, dtype=dtype, device=device).requires_grad_()
    g = _randn(3, 41, 200, dtype=dtype, device=device)
    y = lin(x)
    y.backward(g)
    xr = x.detach().double().requires_grad_()
    wr, br = lin.weight.detach().double().requires_grad_(), lin.bias.detach().double().requires_grad_()
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(g.double())
    _check(y, yr, dtype, "y")
    for got, want, what in ((x.grad, xr.grad, "dx"), (lin.weight.grad, wr.grad, "dw"), (lin.bias.grad, br.grad, "db")):
        _check(got, want, dtype, what)


def test_linear_cublas_backend_compiles_and_casts_under_autocast():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    lin = tnn.Linear.from_linear(torch.nn.Linear(72, 200), backend="cublas")  # fp32 master weights
    x = torch.randn(5, 72, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x: lin(x).float().square().mean(), backend=counter, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = step(x)
    loss.backward()
    assert counter.frame_count == 1
    assert lin.weight.grad.dtype == torch.float32 and lin.bias.grad.dtype == torch.float32
    y_ref = torch.nn.functional.linear(x.detach().double(), lin.weight.detach().double(), lin.bias.detach().double())
    db_ref = (2 * y_ref / y_ref.numel()).sum(0)
    assert rel_err(lin.bias.grad, db_ref) < 2e-2


# ---------------------------------------------------------------- GPU: poison, streams, configs


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("m", [1, 129, 700])
@pytest.mark.parametrize("kn", KN_POOL, ids=lambda kn: f"k{kn[0]}n{kn[1]}")
def test_gemm_cuda_poisoned_output(layout, m, kn):
    op, a, b, ref = _gemm_case(m, *kn, torch.bfloat16, "cuda", layout)
    out_shape = ref.shape if kn[1] % 8 == 0 and (layout != "tn" or kn[0] % 8 == 0) else None
    if out_shape is None:
        pytest.skip("padded path writes a padded buffer, then slices")
    with poisoned_cuda_allocation(ref.numel() * 2) as ptr:
        out = op(a, b)
    assert out.data_ptr() == ptr, "poison did not reach the output"
    _check(out, ref, torch.bfloat16, "poisoned")


# examples/train_gpt.py's GEMMs on their own schedules (DEFAULT_OVERRIDES, split-K weight
# gradients): (op, M or the tokens of a "tn", K, N), M past the largest bucket's bound and ragged.
GPT_SHAPES = [
    ("linear", 6337, 3072, 768),  # MLP down-projection + bias: "nt" 768x3072 ping-pong
    ("gemm", 6337, 768, 3072),  # its dX: "nn" 3072x768, 128x128 ping-pong with the TMA-store epilogue
    ("gemm", 6337, 2304, 768),  # the QKV projection's dX: "nn" 768x2304 ping-pong
    ("gemm_tn", 6337, 768, 3072),  # its dW (768 x 3072 over the tokens): split-K
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPT_SHAPES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}")
def test_gpt_shape_schedules_poisoned_output(case):
    op, m, k, n = case
    x = _randn(m, k, dtype=torch.bfloat16, device="cuda")
    if op == "linear":
        w, b = _randn(n, k, dtype=torch.bfloat16, device="cuda", scale=k**-0.5), _randn(n, dtype=torch.bfloat16, device="cuda")
        ref, call = x.float() @ w.float().t() + b.float(), lambda: torch.ops.tileops.linear(x, w, b, "none")
    elif op == "gemm":
        w = _randn(k, n, dtype=torch.bfloat16, device="cuda", scale=k**-0.5)
        ref, call = x.float() @ w.float(), lambda: torch.ops.tileops.gemm(x, w)
    else:  # (tokens, k)ᵀ @ (tokens, n): a weight gradient (k x n)
        y = _randn(m, n, dtype=torch.bfloat16, device="cuda", scale=m**-0.5)
        ref, call = x.float().t() @ y.float(), lambda: torch.ops.tileops.gemm_tn(x, y)
    with poisoned_cuda_allocation(ref.numel() * 2) as ptr:
        out = call()
    assert out.data_ptr() == ptr, "poison did not reach the output"
    _check(out, ref, torch.bfloat16, op)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_linear_activation_elementwise_error_bound(act):
    """The fused epilogues' fast math, element by element, pre-activations z over [-8, 8] and the
    tails: each output within bf16's rounding of the exact value, plus for gelu_tanh 3e-4·|z|
    (`_gelu_tanh`'s tanh.approx: ~2^-11 relative error times 0.5·|z|); silu (rcp.approx and
    ex2.approx) gets no such slack, so a tanh.approx sigmoid, whose error swamps the small outputs
    of z < -4, would fail. The norm-wise checks above would not see a worse approximation confined
    to the small negative outputs."""
    in_f, out_f = LINEAR_IN_OUT
    x = (torch.rand(333, in_f, device="cuda") * 16 - 8).to(torch.bfloat16)
    w = torch.zeros(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    w[torch.arange(out_f), torch.arange(out_f) % in_f] = 1  # z[:, j] = x[:, j % in_f] + b[j], exact in fp32
    b = (torch.randn(out_f, device="cuda") * 0.1).to(torch.bfloat16)
    y = torch.ops.tileops.linear(x, w, b, act)
    z = x.double() @ w.double().t() + b.double()
    if act == "gelu_tanh":
        ref, slack = 0.5 * z * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (z + 0.044715 * z**3))), 3e-4 * z.abs()
    else:
        ref, slack = z * torch.sigmoid(z), 0.0
    excess = (y.double() - ref).abs() - (2**-8 * ref.abs() + slack)
    worst = excess.argmax()
    assert excess.max() <= 0, f"z={z.flatten()[worst]:.4f}: out {y.flatten()[worst]:.6g}, exact {ref.flatten()[worst]:.6g}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("act", ["none", "gelu_tanh"])
def test_linear_cuda_poisoned_output(act):
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(333, in_f, dtype=torch.bfloat16, device="cuda")
    w = _randn(out_f, in_f, dtype=torch.bfloat16, device="cuda", scale=in_f**-0.5)
    b = _randn(out_f, dtype=torch.bfloat16, device="cuda")
    with poisoned_cuda_allocation(333 * out_f * 2) as ptr:
        y = torch.ops.tileops.linear(x, w, b, act)
    assert y.data_ptr() == ptr
    _check(y, _linear_ref(x, w, b, act), torch.bfloat16, "poisoned linear")
    # dz and db in one host call (two kernels), dz alone, and (up to ACT_GRAD_SINGLE_ROWS rows) dz and db in one kernel
    for rows, bias_grad in ((333, True), (333, False), (G.ACT_GRAD_SINGLE_ROWS - 27, True)):
        dy = _randn(rows, out_f, dtype=torch.bfloat16, device="cuda")
        z = x[:rows] @ w.t()
        want = dy.float() * reference.activation_grad(z.float(), "gelu_tanh")
        with poisoned_cuda_allocation(rows * out_f * 2) as ptr:
            dz, db = torch.ops.tileops.act_grad(dy, z, "gelu_tanh", bias_grad)
        assert dz.data_ptr() == ptr
        _check(dz, want, torch.bfloat16, f"poisoned act_grad dz ({rows} rows, bias_grad={bias_grad})")
        if bias_grad:
            _check(db, want.sum(0), torch.bfloat16, f"act_grad db ({rows} rows)")
            # db (a small block, which the allocator may merge and hand to dz first) poisoned by
            # hand: both launchers into NaN-filled outputs (the one-kernel variant at any row count:
            # 333 rows are six row blocks, the last ragged)
            for single in (False, True):
                kern, bm = G._act_grad_kernel(dy.device, out_f, dy.dtype, "gelu_tanh", True, single)
                dz, db = torch.full_like(dz, float("nan")), torch.full((out_f,), float("nan"), dtype=dy.dtype, device="cuda")
                kern(dy, z, dz, *(() if single else (torch.full((-(-rows // bm), out_f), float("nan"), device="cuda"),)), db)
                _check(dz, want, torch.bfloat16, f"NaN-filled act_grad dz ({rows} rows, single={single})")
                _check(db, want.sum(0), torch.bfloat16, f"NaN-filled act_grad db ({rows} rows, single={single})")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", BIAS_GRAD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bias_grad_kernel_writes_every_element(shape):
    # The kernel called directly with NaN-filled partials and output: every partial row (one per
    # block_M * steps rows) and every column must be written, or the NaN reaches db.
    from tilelang_ops.kernels import gemm as K

    m, n = shape
    kern, rows = G._bias_grad_kernel(torch.device("cuda"), n, torch.bfloat16)
    dy = _randn(m, n, dtype=torch.bfloat16, device="cuda") + 0.5
    partial = torch.full((-(-m // rows), n), float("nan"), device="cuda")
    db = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
    kern(dy, partial, db)
    assert rows == K.BiasGradConfig().block_M * K.BiasGradConfig().steps
    _check(partial.sum(0), dy.double().sum(0), torch.bfloat16, "partials")
    _check(db, dy.double().sum(0), torch.bfloat16, "db")
    with poisoned_cuda_allocation(n * 2) as ptr:
        out = torch.ops.tileops.bias_grad(dy)
    assert out.data_ptr() == ptr, "poison did not reach the output"
    _check(out, dy.double().sum(0), torch.bfloat16, "poisoned op output")
    assert torch.equal(out, torch.ops.tileops.bias_grad(dy)), "not deterministic"


# The async pipeline (GemmConfig.pipeline="async": our own mbarrier producer/consumer loop) over
# ragged shapes: more k-steps than stages (the stage ring wraps), ragged K/N/M tiles, every
# epilogue, batched and two CTAs per SM. Kernels are called directly with NaN-filled outputs, so
# an unwritten element fails. (config kwargs, static, Ms)
ASYNC_CASES = [
    (dict(), dict(layout="nn", n=200, k=1000), [1, 129, 700]),
    (dict(), dict(layout="nt", n=200, k=1000, bias=True, activation="gelu_tanh", save_preact=True), [7, 700]),
    (dict(), dict(layout="tn", n=136, k=0, rows=200), [1, 1000]),  # M here is the reduction
    (dict(block_N=128, num_stages=4), dict(layout="nt", n=200, k=1000, bias=True, activation="relu"), [129, 4097]),
    (dict(block_N=128, num_stages=4), dict(layout="nn", n=128, k=72, dtype="float16", batched=True), [17, 300]),
    (dict(block_N=128, num_stages=2, min_blocks=2), dict(layout="nn", n=3072, k=768), [1000, 4097]),
    (dict(block_N=192, num_stages=4), dict(layout="nn", n=3072, k=768), [1, 1000, 1536]),  # M <= 1536's override until session 32
    # 4 stages of 128x256 leave no room for a C tile: the epilogue stores from registers
    (dict(num_stages=4), dict(layout="nt", n=200, k=1000, bias=True, activation="gelu_tanh", save_preact=True), [7, 700]),
    # persistent ping-pong: fewer tiles than CTAs, one, and several per CTA (odd and even counts
    # per consumer warpgroup: M=4097 at n=3072 is 792 tiles, 6 per CTA; 16384 is 3072 tiles)
    (dict(block_N=128, num_stages=6, pipeline="pingpong"), dict(layout="nn", n=200, k=1000), [1, 129, 700, 4097]),
    (dict(block_N=128, num_stages=6, pipeline="pingpong"), dict(layout="nn", n=3072, k=768), [1000, 4097, 16384]),
    (dict(block_N=128, num_stages=6, pipeline="pingpong"), dict(layout="nt", n=200, k=1000, bias=True, activation="gelu_tanh", save_preact=True), [7, 700, 5000]),
    (dict(block_N=128, num_stages=7, swizzle=16, pipeline="pingpong"), dict(layout="nt", n=200, k=1000, bias=True, activation="relu"), [700, 5000]),
    (dict(block_N=128, num_stages=6, pipeline="pingpong", swizzle=0), dict(layout="tn", n=136, k=0, rows=200), [1, 1000]),
    (dict(block_N=128, num_stages=6, pipeline="pingpong"), dict(layout="nn", n=128, k=72, dtype="float16", batched=True), [17, 300, 2000]),
    # ping-pong with the TMA-store epilogue (each warpgroup's own C tile): ragged M and N tiles
    # clipped by the store, the pre-activation's store before C's, batched, "tn"
    (dict(block_N=128, num_stages=5, pipeline="pingpong", tma_store=True), dict(layout="nn", n=200, k=1000), [1, 129, 700, 4097]),
    (dict(block_N=128, num_stages=5, pipeline="pingpong", tma_store=True), dict(layout="nt", n=200, k=1000, bias=True, activation="gelu_tanh", save_preact=True), [7, 700, 5000]),
    (dict(block_N=192, num_stages=3, pipeline="pingpong", tma_store=True), dict(layout="nt", n=3072, k=768, bias=True, activation="gelu_tanh"), [1000, 4097, 16384]),
    (dict(block_N=128, num_stages=5, pipeline="pingpong", swizzle=0, tma_store=True), dict(layout="tn", n=136, k=0, rows=200), [1, 1000]),
    (dict(block_N=128, num_stages=5, pipeline="pingpong", tma_store=True), dict(layout="nn", n=128, k=72, dtype="float16", batched=True), [17, 300, 2000]),
    (dict(block_N=192, num_stages=3, pipeline="pingpong", tma_store=True), dict(layout="nn", n=3072, k=768), [1, 1000, 1536, 4097]),  # shipped (M <= 6144)
]


def async_kernel(case):
    """(config, static) of an ASYNC_CASES entry; benchmarks/warm_gemm_cache.py pre-builds these."""
    import dataclasses

    from tilelang_ops.kernels import gemm as K

    cfg_kw, st_, _ = case
    static = dict(rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)
    static.update(st_)
    return dataclasses.replace(K.GemmConfig(), **{"pipeline": "async", **cfg_kw}), static


def _async_case_id(case):
    cfg, st_, _ = case
    return "-".join([st_["layout"]] + [f"{k}{v}" for k, v in {**cfg, **st_}.items() if k != "layout"])


@pytest.mark.slow
def test_gemm_async_pipeline_source():
    """What makes the async pipeline correct, in its generated code: one wgmma k-step left in
    flight (wait<1>), the stage released only after that wait, and no CTA-wide barrier after the
    barrier init (a __syncthreads inside the role branches would deadlock the producer)."""
    from tilelang_ops.kernels import gemm as K

    cfg = K.GemmConfig(128, 192, 64, 4, 256, 8, "Square", 0, "async")  # 1024x3072x768's default until session 32
    assert cfg.min_sm == 90
    src = K.matmul_kernel.source(cfg, "sm_90a", layout="nn", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)
    assert src.count("__syncthreads()") == 1 and src.index("__syncthreads()") < src.index("fence_barrier_init") + 60
    loop = src[src.index("wait_wgmma<1>"):]
    assert loop.index("empty[") < loop.index("wait_wgmma<0>"), "the stage release must follow wait<1>"
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
    assert "__launch_bounds__(384, 1)" in src


@pytest.mark.slow
def test_gemm_pingpong_source():
    """The ping-pong pipeline's turns in its generated code: warpgroup 1 primes warpgroup 0's
    barrier (2); each warpgroup waits for its turn (bar.sync on 2 + w) before its k-steps and
    passes it (bar.arrive on the other's) after issuing them, before draining (wait<0>); stages are
    released after wait<1>; no CTA-wide barrier after the barrier init (it would deadlock)."""
    from tilelang_ops.kernels import gemm as K

    cfg = K.GemmConfig(128, 128, 64, 6, 256, 8, "Square", 0, "pingpong")
    assert cfg.min_sm == 90
    src = K.matmul_kernel.source(cfg, "sm_90a", layout="nt", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=True, activation="gelu_tanh", save_preact=False)
    assert src.count("__syncthreads()") == 1 and src.index("__syncthreads()") < src.index("fence_barrier_init") + 60
    assert "__launch_bounds__(384, 1)" in src and "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
    wg1_at = src.index("if ((128 <= ((int)threadIdx.x)) && (((int)threadIdx.x) < 256))")
    wg0, wg1 = src[src.index("if (((int)threadIdx.x) < 128)") : wg1_at], src[wg1_at:]
    order0 = ["__sync_thread_partial(2, 256)", "wgmma_ss", "wait_wgmma<1>", "empty[", "__named_barrier_arrive(3, 256)", "wait_wgmma<0>"]
    assert [wg0.index(x) for x in order0] == sorted(wg0.index(x) for x in order0)
    order1 = ["__named_barrier_arrive(2, 256)", "__sync_thread_partial(3, 256)", "wgmma_ss", "wait_wgmma<1>", "empty["]
    assert [wg1.index(x) for x in order1] == sorted(wg1.index(x) for x in order1)
    assert wg1.index("wait_wgmma<1>") < wg1.rindex("__named_barrier_arrive(2, 256)") < wg1.index("wait_wgmma<0>")


@pytest.mark.slow
def test_gemm_pingpong_tma_store_source():
    """GemmConfig.tma_store: each consumer warpgroup stages its C tile in shared memory of its own
    (the two tiles at different offsets, though each is used in one branch only), syncs only its
    own 128 threads (named barrier 4 + w: the other warpgroup is in its main loop), has one
    elected thread issue the TMA store and wait until it has read the tile, and syncs again before
    the tile can be written for the next output tile."""
    import re

    from tilelang_ops.kernels import gemm as K

    cfg = K.GemmConfig(128, 128, 64, 5, 256, 8, "Square", 0, "pingpong", tma_store=True)
    src = K.matmul_kernel.source(cfg, "sm_90a", layout="nt", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=True, activation="gelu_tanh", save_preact=False)
    offsets = dict(re.findall(r"void\* (C_s[01]) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    assert set(offsets) == {"C_s0", "C_s1"} and abs(int(offsets["C_s0"]) - int(offsets["C_s1"])) >= 128 * 128 * 2, offsets
    wg1_at = src.index("if ((128 <= ((int)threadIdx.x)) && (((int)threadIdx.x) < 256))")
    for w, part in enumerate((src[src.index("if (((int)threadIdx.x) < 128)") : wg1_at], src[wg1_at:])):
        epi = part[part.index("wait_wgmma<0>"):]
        order = ["stmatrix", f"C_s{w}", "fence_proxy_async", f"__sync_thread_partial({4 + w}, 128)", "tl_shuffle_elect<128>", "tma_store(", "tma_store_wait<0, true>", f"__sync_thread_partial({4 + w}, 128)"]
        pos = -1
        for x in order:  # each after the previous one
            pos = epi.find(x, pos + 1)
            assert pos >= 0, f"warpgroup {w}'s epilogue: {x!r} missing or out of order ({order})"
        assert f"C_s{1 - w}" not in epi, f"warpgroup {w}'s epilogue touches the other warpgroup's C tile"


def test_gemm_tma_store_is_the_pingpong_epilogue():
    from tilelang_ops.kernels import gemm as K

    with pytest.raises(ValueError, match="tma_store.*pingpong"):
        K.GemmConfig(128, 128, 64, 4, 256, 8, "Square", 0, "async", tma_store=True)


def test_gemm_pingpong_needs_two_consumer_warpgroups():
    from tilelang_ops.kernels import gemm as K

    with pytest.raises(ValueError, match="pingpong.*threads=256"):
        K.matmul_kernel.build(K.GemmConfig(128, 128, 64, 6, 128, 8, "Square", 0, "pingpong"), layout="nn", n=128, k=64, dtype="bfloat16")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ASYNC_CASES, ids=_async_case_id)
def test_gemm_async_pipeline_nan_filled_outputs(case):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the async pipeline is Hopper only (wgmma + TMA)")
    from tilelang_ops.kernels import gemm as K

    cfg, static = async_kernel(case)
    ms = case[2]
    kern = K.matmul_kernel.compile(cfg, "sm_90a", **static)
    dt = getattr(torch, static["dtype"])
    n, k, layout = static["n"], static["k"], static["layout"]
    lead = (3,) if static["batched"] else ()
    for m in ms:
        if layout == "tn":
            a, b = _randn(m, static["rows"], dtype=dt, device="cuda"), _randn(m, n, dtype=dt, device="cuda", scale=m**-0.5)
            ref, out_shape = a.float().t() @ b.float(), (static["rows"], n)
        else:
            a = _randn(*lead, m, k, dtype=dt, device="cuda")
            w = _randn(*lead, n, k, dtype=dt, device="cuda", scale=k**-0.5)
            b = w if layout == "nt" else w.transpose(-1, -2).contiguous()
            ref, out_shape = a.float() @ w.float().transpose(-1, -2), lead + (m, n)
        args = [a, b]
        if static["bias"]:
            bias = _randn(n, dtype=dt, device="cuda")
            args.append(bias)
            ref = ref + bias.float()
        c = torch.full(out_shape, float("nan"), dtype=dt, device="cuda")
        z = torch.full(out_shape, float("nan"), dtype=dt, device="cuda")
        kern(*args, c, *([z] if static["save_preact"] else []))
        torch.cuda.synchronize()
        if static["save_preact"]:
            _check(z, ref, dt, f"m={m} pre-activation")
        _check(c, reference.activation(ref, static["activation"]), dt, f"m={m}")


# Split-K weight gradients (GemmConfig.split_k, "tn" only): (config, output rows P, n, dtype,
# token counts). Ragged tiles (200 x 72 under 192 x 192) and the guarded reduce; 1 and 63 tokens
# leave every slice but the first empty (one k-step of 64); 4097 and 5000 tokens split unevenly.
def _split_cfg(bm, bn, st, th, policy, split):
    import dataclasses

    from tilelang_ops.kernels import gemm as K

    return dataclasses.replace(K.GemmConfig(bm, bn, 64, st, th, 0, policy), split_k=split)


SPLIT_CASES = [
    (_split_cfg(192, 192, 4, 384, "FullRow", 2), 200, 72, "bfloat16", [1, 63, 65, 1000, 5000]),
    (_split_cfg(128, 256, 3, 256, "Square", 3), 384, 512, "float16", [1, 200, 4097]),
]


def split_kernel(case):
    """(config, static) of a SPLIT_CASES entry; benchmarks/warm_gemm_cache.py pre-builds these."""
    cfg, rows, n, dtype, _ = case
    return cfg, dict(layout="tn", n=n, k=0, rows=rows, dtype=dtype, batched=False, bias=False, activation="none", save_preact=False)


def test_gemm_split_k_only_for_weight_gradients():
    from tilelang_ops.kernels import gemm as K

    cfg = _split_cfg(128, 256, 3, 256, "Square", 2)
    for static in (dict(layout="nn", n=128, k=64), dict(layout="tn", n=128, k=0, rows=128, batched=True)):
        with pytest.raises(ValueError, match="split_k=2: only the weight-gradient layout 'tn'"):
            K.matmul_kernel.build(cfg, dtype="bfloat16", **static)
    # The op never hands a split config to a batched or non-"tn" call (the config is narrowed).
    assert "split" not in __import__("tilelang_ops").runtime.config_str(K.GemmConfig())


@pytest.mark.slow
def test_gemm_split_k_source():
    """Two kernels in one host function: the k-slices (blockIdx.z) writing fp32 partials, then
    their sum cast to the output dtype."""
    from tilelang_ops.kernels import gemm as K

    cfg, static = split_kernel(SPLIT_CASES[0])
    src = K.matmul_kernel.source(cfg, "sm_90a", **static)
    assert "matmul_kernel(" in src and "matmul_kernel_1(" in src and "blockIdx.z" in src
    assert "float* __restrict__ P" in src


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[1]}x{c[2]}-{c[3]}-split{c[0].split_k}")
def test_gemm_split_k_nan_filled_outputs_and_op(case):
    """The kernel with NaN-filled output and partials (an unwritten element fails), bitwise
    deterministic; then the op with the config pinned (the workspace comes from the op)."""
    from tilelang_ops.kernels import gemm as K

    cfg, static = split_kernel(case)
    rows, n, dt = static["rows"], static["n"], getattr(torch, static["dtype"])
    kern = K.matmul_kernel.compile(cfg, runtime_arch(), **static)
    G.set_config("tn", n, 0, dt, cfg, arch=runtime_arch(), rows=rows)
    try:
        for m in case[4]:
            a, b = _randn(m, rows, dtype=dt, device="cuda"), _randn(m, n, dtype=dt, device="cuda", scale=m**-0.5)
            ref = a.float().t() @ b.float()
            c = torch.full((rows, n), float("nan"), dtype=dt, device="cuda")
            p = torch.full((cfg.split_k, rows, n), float("nan"), device="cuda")
            kern(a, b, c, p)
            _check(c, ref, dt, f"tokens={m}")
            again = torch.full_like(c, float("nan"))
            kern(a, b, again, torch.full_like(p, float("nan")))
            assert torch.equal(c, again), "split-K must be deterministic"
            out = torch.ops.tileops.gemm_tn(a, b)
            assert torch.equal(out, c) and G.last_config()[1] == cfg
    finally:
        G.TUNED.pop((runtime_arch(), "tn", rows, n, 0, dt), None)
        G._kernels.clear()


def runtime_arch() -> str:
    from tilelang_ops import runtime

    return runtime.arch_for_device(torch.cuda.current_device())


@pytest.mark.gpu
@requires_cuda
def test_gemm_layer_sized_and_last_config():
    a = _randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b = _randn(4096, 4096, dtype=torch.bfloat16, device="cuda", scale=4096**-0.5)
    for m in (1000, 4096, 8191):  # one compiled kernel serves every M
        _check(torch.ops.tileops.gemm(a[:m], b), a[:m].float() @ b.float(), torch.bfloat16, f"m={m}")
    name, cfg, static = G.last_config()
    assert name == "matmul" and static["layout"] == "nn" and static["n"] == 4096 and static["k"] == 4096
    from tilelang_ops.kernels.gemm import GemmConfig

    assert isinstance(cfg, GemmConfig)  # the default table's unless `tileops tune` stored a winner


@pytest.mark.gpu
@requires_cuda
def test_gemm_generated_code_uses_wgmma_and_tma():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper only")
    from tilelang_ops.kernels import gemm as K

    src = K.matmul_kernel.source(G.config_for("nn", 4096, 4096, torch.bfloat16), "sm_90a", layout="nn", n=4096, k=4096, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)
    assert "wgmma" in src and "tma_load" in src and "tma_store" in src


@pytest.mark.gpu
@requires_cuda
def test_linear_runs_on_current_stream_and_in_cuda_graph():
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(256, in_f, dtype=torch.bfloat16, device="cuda")
    w = _randn(out_f, in_f, dtype=torch.bfloat16, device="cuda", scale=in_f**-0.5)
    b = _randn(out_f, dtype=torch.bfloat16, device="cuda")
    torch.ops.tileops.linear(x, w, b, "silu")  # compile + warm outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.ops.tileops.linear(x, w, b, "silu")
    torch.cuda.current_stream().wait_stream(s)
    _check(out, _linear_ref(x, w, b, "silu"), torch.bfloat16, "side stream")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.tileops.linear(x, w, b, "silu")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _check(captured, _linear_ref(x, w, b, "silu"), torch.bfloat16, "graph replay")


@requires_cuda
@pytest.mark.gpu
def test_gemm_mixed_devices():
    with pytest.raises(ValueError, match="b: on device cpu"):
        torch.ops.tileops.gemm(torch.ones(4, 8, device="cuda", dtype=torch.bfloat16), torch.ones(8, 8, dtype=torch.bfloat16))


# ---------------------------------------------------------------- configs


def test_config_table_and_search_space():
    from tilelang_ops.kernels import gemm as K

    big = G.config_for("nn", 4096, 4096, torch.bfloat16, "sm_90a")
    assert (big.block_M, big.block_N, big.block_K, big.num_stages, big.threads) == (128, 256, 64, 3, 256)
    assert G.config_for("nn", 128, 64, torch.bfloat16, "sm_90a").block_N == 128
    assert G.config_for("tn", 4096, 0, torch.bfloat16, "sm_80", rows=4096).num_stages <= 2
    for arch in ("sm_90a", "sm_80"):  # the op's one-kernel threshold is one bias-grad CTA's rows
        cfg = K.default_bias_grad_config(arch, 4096)
        assert G.BIAS_GRAD_SINGLE_ROWS == cfg.block_M * cfg.steps
    assert len(K.SEARCH_SPACE) <= 12 and len(K.REPRESENTATIVE) <= 14  # bounds the compile tests (CI time): one per kernel shape
    assert G.last_config("no-such-kernel") is None


def test_weight_gradients_with_few_tiles_split_k():
    """Split-K only where the unsplit grid leaves SMs idle, and only with a long reduction: the
    slices fill one wave of 132 SMs without starting a second."""
    from tilelang_ops.kernels import gemm as K

    tn = lambda rows, n, m: G.config_for("tn", n, 0, torch.bfloat16, "sm_90a", rows=rows, m=m)  # noqa: E731
    assert (tn(3072, 768, 16384).block_M, tn(3072, 768, 16384).split_k) == (192, 2)  # 64 tiles x 2
    assert (tn(2304, 768, 16384).block_M, tn(2304, 768, 16384).split_k) == (128, 2)  # 54 x 2 beats 48 x 2
    assert tn(768, 768, 16384).split_k == K.MAX_SPLIT_K
    assert tn(3072, 768, 1000).split_k == 1  # a short reduction: not split
    assert tn(4096, 4096, 16384).split_k == 1 and tn(4096, 1024, 16384).split_k == 1  # >= one wave of tiles
    assert G.config_for("tn", 768, 0, torch.bfloat16, "sm_80", rows=3072, m=16384).split_k == 1
    for rows, n in ((3072, 768), (768, 768), (200, 72), (100000, 8)):
        cfg = K.tn_split_config(rows, n)
        if cfg is not None:
            tiles = -(-rows // cfg.block_M) * -(-n // cfg.block_N)
            assert 2 <= cfg.split_k <= K.MAX_SPLIT_K and tiles * cfg.split_k <= K.PERSISTENT_CTAS



def test_tune_space_leaves_out_newer_schedules(monkeypatch):
    """`tileops tune` on an Ampere GPU must not try the Hopper-only (wgmma/TMA/setmaxnreg) schedules."""
    for arch, want_pingpong in (("sm_80", False), ("sm_90a", True), ("sm_100a", True)):
        monkeypatch.setattr(G.runtime, "default_arch", lambda arch=arch: arch)
        space = G._tune_space(("nn", 4096, 4096, 4096), None)
        assert space and any(c.pipeline == "pingpong" for c in space) == want_pingpong, arch
        assert not any(c.split_k > 1 for c in space)  # weight gradients only, and Hopper on:
        assert any(c.split_k > 1 for c in G._tune_space(("tn", 3072, 768, 16384), None)) == want_pingpong


def test_board_overrides_serve_their_board_only(monkeypatch):
    """An entry keyed by a device name wins over the "sm_9" one on that board (most specific
    first there too) and is invisible on any other."""
    from tilelang_ops.kernels import gemm as K

    small = K.GemmConfig(128, 128, 64, 4, 256, 8, "Square")
    board = dataclasses.replace(small, num_stages=5)
    monkeypatch.setitem(K.DEFAULT_OVERRIDES, ("sm_9", "nn", 1, 6144, 6144), small)
    monkeypatch.setitem(K.DEFAULT_OVERRIDES, ("Test GPU", "nn", 1, None, 6144), board)
    cfg = lambda n, brd: G.config_for("nn", n, 6144, torch.bfloat16, "sm_90a", m=4096, board=brd)  # noqa: E731
    assert cfg(6144, "Test GPU") == board  # the board's any-n entry beats the exact "sm_9" one
    assert cfg(5120, "Test GPU") == board
    assert cfg(6144, "Other GPU") == small and cfg(5120, "Other GPU") == K._HOPPER_LARGE
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_90a", m=16384, board="Test GPU") == K._HOPPER_LARGE  # other bucket
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_80", m=4096, board="Test GPU") == K._AMPERE


def test_defaults_answer_for_the_calls_device_on_a_mixed_host(monkeypatch, tmp_path):
    """On a host with an H200 (current, cuda:0) and an H100 (cuda:1), a GEMM resolved for cuda:1
    gets the H100's default, not the current device's (the tables read the current device)."""
    from tilelang_ops import runtime
    from tilelang_ops.kernels import gemm as K

    names, current = {0: "Test H200", 1: "Test H100"}, [0]

    class FakeDevice:  # torch.cuda.device without a GPU: switches the current index
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))  # an empty tuned cache
    monkeypatch.setattr(G.tuning, "_loaded", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: names[current[0] if d is None else getattr(d, "index", d)])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(runtime, "_NAME_BY_DEVICE", {})
    monkeypatch.setattr(runtime, "_ARCH_BY_DEVICE", {})
    h100 = dataclasses.replace(K._HOPPER_LARGE, num_stages=5)
    monkeypatch.setitem(K.DEFAULT_OVERRIDES, ("Test H100", "nn", 1, 6144, 6144), h100)
    shape = ("nn", K.M_BUCKET_REP[1], 6144, 6144)
    assert G.tuning.resolve_config(G.TUNABLE, shape, torch.bfloat16, torch.device("cuda", 1)) == h100
    assert G.tuning.resolve_config(G.TUNABLE, shape, torch.bfloat16, torch.device("cuda", 0)) != h100
    assert current[0] == 0  # the current device is restored
    for device, want in (("cuda:1", 1), (1, 1), ("cuda", 0), (torch.device("cuda"), 0)):  # no index: the current one
        with runtime.on_device(device):
            assert current[0] == want, device


def test_every_default_override_is_reachable():
    """A mistyped key would be silently dead: every entry's key has a known shape, and config_for
    returns the entry for its own board (tag) at a token count of its bucket."""
    from tilelang_ops.kernels import gemm as K

    for key, cfg in K.DEFAULT_OVERRIDES.items():
        tag, layout, bucket, n, k = key
        assert tag == "sm_9" or tag.startswith("NVIDIA "), key
        assert layout in ("nn", "nt", "tn") and bucket in (0, 1, 2) and (n is None or n > 0) and (k is None or k > 0), key
        if n is None or k is None:
            continue
        got = G.config_for(layout, n, 0 if layout == "tn" else k, torch.bfloat16, "sm_90a", rows=k if layout == "tn" else 0, m=K.M_BUCKET_REP[bucket], board=tag)  # board="sm_9": that table alone, on any host
        assert got == G._servable(cfg, layout, False), key


def test_m_buckets_select_configs(monkeypatch):
    """The symbolic token count picks one of three buckets; each resolves (and caches) its own
    kernel; DEFAULT_OVERRIDES and set_config(bucket=) apply per bucket; tuning keys name it.
    (Static dims without a shipped override: 6144x6144, K=640.)"""
    from tilelang_ops.kernels import gemm as K

    for m in (1, 1024, 1536, 1537, 4096, 6144, 6145, 16384, 10**7):
        assert G._bucket(m) == K.m_bucket(m) == (0 if m <= K.M_BUCKET_BOUNDS[0] else 1 if m <= K.M_BUCKET_BOUNDS[1] else 2)
    assert [K.m_bucket(m) for m in K.M_BUCKET_REP] == [0, 1, 2]
    small = K.GemmConfig(128, 128, 64, 4, 256, 8, "Square")
    monkeypatch.setitem(K.DEFAULT_OVERRIDES, ("sm_9", "nn", 0, 6144, 6144), small)
    monkeypatch.setitem(K.DEFAULT_OVERRIDES, ("sm_9", "nt", 1, None, 640), small)
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_90a", m=1024) == small
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_90a", m=4096) == K._HOPPER_LARGE
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_90a") == K._HOPPER_LARGE  # m=None: largest bucket
    assert G.config_for("nt", 3072, 640, torch.bfloat16, "sm_90a", m=4096) == small  # any-n override
    assert G.config_for("nn", 6144, 6144, torch.bfloat16, "sm_80", m=1024) == K._AMPERE  # overrides are Hopper-only
    assert G.TUNABLE.key(("nn", 1024, 6144, 6144), torch.bfloat16, None)[1] == "m<=1536"
    assert G.TUNABLE.key(("tn", 8192, 8192, 16384), torch.bfloat16, None)[1] == "m>6144"  # "tn": tokens = K

    # the op path: one resolved kernel per (static key, bucket), a cheap lookup afterwards
    compiled = []
    monkeypatch.setattr(G.runtime, "arch_for_device", lambda d: "sm_90a")
    monkeypatch.setattr(G.tuning, "resolve_config", lambda tunable, shape, dtype, device: tunable.default(shape, dtype))
    monkeypatch.setattr(G.runtime, "default_arch", lambda: "sm_90a")
    monkeypatch.setattr(K.matmul_kernel.__class__, "compile", lambda self, cfg, arch, **st: compiled.append(cfg) or ("kernel", cfg))
    monkeypatch.setattr(G.runtime, "launcher", lambda kernel: kernel)
    monkeypatch.setattr(G, "_kernels", {})
    monkeypatch.setattr(G, "TUNED", {})
    dev = torch.device("cuda", 0)
    k0 = G._matmul_kernel(dev, "nn", 6144, 6144, torch.bfloat16, m=1000)
    k1 = G._matmul_kernel(dev, "nn", 6144, 6144, torch.bfloat16, m=5000)
    assert k0 == ("kernel", small) and k1 == ("kernel", K._HOPPER_LARGE) and G.last_config()[1] == K._HOPPER_LARGE
    assert G._matmul_kernel(dev, "nn", 6144, 6144, torch.bfloat16, m=1536) is k0 and len(compiled) == 2
    G.set_config("nn", 6144, 6144, torch.bfloat16, K._HOPPER_NARROW, bucket=2)
    assert G._matmul_kernel(dev, "nn", 6144, 6144, torch.bfloat16, m=20000)[1] == K._HOPPER_NARROW
    assert G._matmul_kernel(dev, "nn", 6144, 6144, torch.bfloat16, m=100)[1] == small


def test_pingpong_grid_is_the_device_sm_count(monkeypatch):
    """The persistent grid is one CTA per SM: the op compiles a ping-pong kernel for the device's
    SM count (132 on an H200, 114 on an H100 PCIe), and the kernel's grid is it."""
    from tilelang_ops.kernels import gemm as K

    seen = []
    monkeypatch.setattr(G.runtime, "arch_for_device", lambda d: "sm_90a")
    monkeypatch.setattr(G.tuning, "resolve_config", lambda tunable, shape, dtype, device: tunable.default(shape, dtype))
    monkeypatch.setattr(G.runtime, "default_arch", lambda: "sm_90a")
    monkeypatch.setattr(K.matmul_kernel.__class__, "compile", lambda self, cfg, arch, **st: seen.append((cfg, st)) or "kernel")
    monkeypatch.setattr(G.runtime, "launcher", lambda kernel: kernel)
    monkeypatch.setattr(G, "_kernels", {})
    monkeypatch.setattr(G, "TUNED", {})
    dev = torch.device("cuda", 0)
    for sms in (132, 114):
        monkeypatch.setattr(G.runtime, "sm_count", lambda d, sms=sms: sms)
        G._kernels.clear()
        G._matmul_kernel(dev, "nt", 3072, 768, torch.bfloat16, bias=True, activation="gelu_tanh", m=16384)  # a ping-pong default
        G._matmul_kernel(dev, "nn", 8192, 8192, torch.bfloat16, m=16384)  # an auto default: never ctas
        (pp_cfg, pp_st), (auto_cfg, auto_st) = seen[-2:]
        assert pp_cfg.pipeline == "pingpong" and auto_cfg.pipeline == "auto"
        assert pp_st.get("ctas") == sms and "ctas" not in auto_st
    monkeypatch.undo()  # the real compile
    src = K.matmul_kernel.source(K._PP, "sm_90a", layout="nn", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False, ctas=114)
    assert "min((((M + 127) >> 7) * 24), 114)" in src


# ---------------------------------------------------------------- opcheck, fake, bad input


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_opcheck(device, dtype):
    def t(*s, grad=True):
        return _randn(*s, dtype=dtype, device=device).requires_grad_(grad)

    opcheck(torch.ops.tileops.gemm.default, (t(33, 72), t(72, 200)))
    opcheck(torch.ops.tileops.gemm.default, (t(2, 33, 72), t(2, 72, 200)))
    opcheck(torch.ops.tileops.gemm_nt.default, (t(33, 72), t(200, 72)))
    opcheck(torch.ops.tileops.gemm_tn.default, (t(33, 72), t(33, 200)))
    in_f, out_f = LINEAR_IN_OUT
    opcheck(torch.ops.tileops.linear.default, (t(5, in_f), t(out_f, in_f), t(out_f), "gelu_tanh"))
    opcheck(torch.ops.tileops.linear.default, (t(2, 5, in_f), t(out_f, in_f), None, "none"))
    opcheck(torch.ops.tileops.linear_preact.default, (t(5, in_f), t(out_f, in_f), t(out_f), "silu"))
    opcheck(torch.ops.tileops.act_grad.default, (t(5, out_f, grad=False), t(5, out_f, grad=False), "gelu_tanh", True))
    opcheck(torch.ops.tileops.bias_grad.default, (t(33, out_f),))


def test_gemm_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(7, 72, dtype=torch.bfloat16), torch.empty(72, 200, dtype=torch.bfloat16)
        assert torch.ops.tileops.gemm(a, b).shape == (7, 200)
        assert torch.ops.tileops.gemm_tn(a, torch.empty(7, 200, dtype=torch.bfloat16)).shape == (72, 200)
        x, w = torch.empty(2, 7, 72, dtype=torch.bfloat16), torch.empty(200, 72, dtype=torch.bfloat16)
        y, z = torch.ops.tileops.linear_preact(x, w, None, "gelu")
        assert y.shape == z.shape == (2, 7, 200)


BAD_INPUTS = [
    ("dtype mix", lambda d: torch.ops.tileops.gemm(torch.ones(4, 8, device=d, dtype=torch.bfloat16), torch.ones(8, 8, device=d, dtype=torch.float16)), TypeError, "b: dtype"),
    ("float32", lambda d: torch.ops.tileops.gemm(torch.ones(4, 8, device=d), torch.ones(8, 8, device=d)), TypeError, "supported: float16, bfloat16"),
    ("shape mismatch", lambda d: torch.ops.tileops.gemm(torch.ones(4, 8, device=d, dtype=torch.bfloat16), torch.ones(9, 8, device=d, dtype=torch.bfloat16)), ValueError, "shape mismatch"),
    ("wrong rank", lambda d: torch.ops.tileops.gemm(torch.ones(8, device=d, dtype=torch.bfloat16), torch.ones(8, 8, device=d, dtype=torch.bfloat16)), ValueError, "a: expected 2-D or 3-D tensor, got 1-D"),
    ("batch mismatch", lambda d: torch.ops.tileops.gemm(torch.ones(2, 4, 8, device=d, dtype=torch.bfloat16), torch.ones(3, 8, 8, device=d, dtype=torch.bfloat16)), ValueError, "same batch"),
    ("linear in_features", lambda d: torch.ops.tileops.linear(torch.ones(4, 8, device=d, dtype=torch.bfloat16), torch.ones(16, 9, device=d, dtype=torch.bfloat16)), ValueError, "in_features"),
    ("bias shape", lambda d: torch.ops.tileops.linear(torch.ones(4, 8, device=d, dtype=torch.bfloat16), torch.ones(16, 8, device=d, dtype=torch.bfloat16), torch.ones(15, device=d, dtype=torch.bfloat16)), ValueError, "bias: shape"),
    ("activation", lambda d: torch.ops.tileops.linear(torch.ones(4, 8, device=d, dtype=torch.bfloat16), torch.ones(16, 8, device=d, dtype=torch.bfloat16), None, "tanh"), ValueError, "activation: 'tanh' is not supported"),
    ("module activation", lambda d: tnn.Linear(8, 16, activation="swish"), ValueError, "activation"),
    ("backend", lambda d: tnn.Linear(8, 16, backend="cutlass"), ValueError, "backend: 'cutlass' is not supported; supported: tilelang, cublas"),
    ("cublas + activation", lambda d: tnn.Linear(8, 16, activation="gelu", backend="cublas"), ValueError, "activation 'none' only"),
    ("bias_grad float32", lambda d: torch.ops.tileops.bias_grad(torch.ones(4, 8, device=d)), TypeError, "dy: dtype float32"),
    ("bias_grad rank", lambda d: torch.ops.tileops.bias_grad(torch.ones(2, 4, 8, device=d, dtype=torch.bfloat16)), ValueError, "dy: expected 2-D"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_gemm_bad_input(device, case):
    _, call, exc, msg = case
    with pytest.raises(exc, match=msg):
        call(device)


# ---------------------------------------------------------------- modules, fusion, torch.compile


def test_nn_linear_loads_nn_linear_state_dict():
    ref = torch.nn.Sequential(torch.nn.Linear(72, 200), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(200, 72))
    ours = torch.nn.Sequential(tnn.Linear(72, 200, activation="gelu_tanh"), torch.nn.Identity(), tnn.Linear(200, 72))
    assert list(ref.state_dict()) == list(ours.state_dict())
    ours.load_state_dict(ref.state_dict())  # strict: same keys and shapes
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(9, 72, dtype=torch.bfloat16)
    _check(ours(x), ref.float()(x.float()), torch.bfloat16, "module")
    assert "activation=gelu_tanh" in repr(ours)


def test_fuse_linear_activations_reports_and_preserves_outputs():
    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Residual(torch.nn.Module):  # act applied to a sum, not to a Linear alone: not fusable
        def __init__(self):
            super().__init__()
            self.fc, self.act = torch.nn.Linear(64, 64), torch.nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(x) + x)

    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.ReLU()),
        SwiGLU(),
        Residual(),
    ).to(torch.bfloat16)
    keys = list(model.state_dict())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    before = model(x).float()
    report = tnn.fuse_linear_activations(model)
    assert [(lin, kind) for lin, _, kind in report.fused] == [("0.0", "gelu"), ("0.2", "relu"), ("1.gate_proj", "silu")]
    assert isinstance(model[0][0], tnn.Linear) and isinstance(model[0][1], torch.nn.Identity)
    assert type(model[2].fc) is torch.nn.Linear  # untouched
    assert list(model.state_dict()) == keys
    _check(model(x), before, torch.bfloat16, "fused model")
    assert "fused 3" in str(report)


def _loss_step(m, x):
    return m(x).float().square().mean()


def _compiled_grads_match(model, ref, x, device):
    """`_loss_step` over `model` has no graph break, and its compiled backward gives `ref`'s
    gradients (same parameters in the same order). Returns the compiled step."""
    explain = torch._dynamo.explain(_loss_step)(model, x)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(_loss_step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    compiled(model, x).backward()
    _loss_step(ref, x).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _check(p.grad, q.grad.float(), torch.bfloat16, f"grad {name}")
    return compiled


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_trains_without_graph_breaks(device):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(tnn.Linear(72, 200, activation="gelu_tanh"), tnn.Linear(200, 72, bias=False)).to(device, torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(72, 200), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(200, 72, bias=False)).to(device, torch.bfloat16)
    ref.load_state_dict({k.replace("1.", "2."): v for k, v in model.state_dict().items()})
    x = torch.randn(3, 40, 72, device=device, dtype=torch.bfloat16)
    compiled = _compiled_grads_match(model, ref, x, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = compiled(model, x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_nn_linear_float32_falls_back_and_autocast_casts():
    # float32 has no kernel: the module computes in PyTorch; under autocast inputs are cast first.
    lin = tnn.Linear(72, 200, activation="silu")
    x = torch.randn(4, 72)
    torch.testing.assert_close(lin(x), torch.nn.functional.silu(torch.nn.functional.linear(x, lin.weight, lin.bias)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    _check(y, _linear_ref(x, lin.weight, lin.bias, "silu"), torch.bfloat16, "autocast")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_1d_input(device):
    in_f, out_f = LINEAR_IN_OUT
    x = _randn(in_f, dtype=torch.bfloat16, device=device)
    w = _randn(out_f, in_f, dtype=torch.bfloat16, device=device, scale=in_f**-0.5)
    b = _randn(out_f, dtype=torch.bfloat16, device=device)
    out = tilelang_ops.linear(x, w, b, "relu")
    assert out.shape == (out_f,)
    _check(out, _linear_ref(x, w, b, "relu"), torch.bfloat16, "1-D")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("used", ["y", "z", "both"])
def test_linear_preact_gradients_whichever_output_is_used(device, used):
    # Grads of unused outputs arrive as None (not materialized zeros): each combination takes its
    # own path in the backward and must match float64 autograd.
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s, device=device, dtype=torch.bfloat16) for s in ((19, 40), (24, 40), (24,)))
    gy, gz = torch.randn(19, 24, device=device), torch.randn(19, 24, device=device)

    def grads(fn, dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        y, z = fn(*ins)
        loss = (y.float() * gy).sum() if used != "z" else 0
        loss = loss + ((z.float() * gz).sum() if used != "y" else 0)
        loss.backward()
        return [t.grad for t in ins]

    ours = grads(lambda *a: torch.ops.tileops.linear_preact(*a, "gelu_tanh"), torch.bfloat16)
    ref = grads(lambda *a: reference.linear(*a, "gelu_tanh", save_preact=True), torch.float64)
    for name, o, r in zip(("x", "weight", "bias"), ours, ref):
        _check(o, r, torch.bfloat16, f"d{name} with {used} used")


def test_unused_preactivation_costs_nothing_in_backward():
    # nn.Linear(activation=...) trains through linear_preact; its z output is unused downstream.
    # The backward must be act_grad (with the bias gradient) and two GEMMs: no zero-filled dz
    # gradient, no extra add or bias reduction.
    m = tnn.Linear(40, 24, activation="gelu_tanh").to(torch.bfloat16)
    y = m(torch.randn(7, 40, dtype=torch.bfloat16, requires_grad=True))
    g = torch.randn_like(y)
    with RecordOps() as mode:
        y.backward(g)
    assert [s for s in mode.ops if s.startswith("tileops.")] == ["tileops.act_grad.default", "tileops.gemm.default", "tileops.gemm_tn.default"], mode.ops
    assert not any(s.startswith(("aten.zeros", "aten.add", "aten.fill", "aten.sum")) for s in mode.ops), mode.ops


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("case", ["aligned", "ragged", "strided", "batched"])
@pytest.mark.parametrize("epilogue", ["plain", "bias_preact"])
def test_launch_path_plumbing_with_an_emulated_kernel(monkeypatch, layout, case, epilogue):
    """The CUDA launch path (fast 2-D call and general path: padding, copies, slicing, argument
    order), run on the CPU with the compiled kernel replaced by a reference that checks what the
    kernel would be handed: contiguous, aligned, padded static dims, and the right buffers."""
    if epilogue != "plain" and layout == "tn":
        pytest.skip("the fused epilogue is only on the nn/nt (linear) layouts")
    seen = []

    def fake_kernel(device, lay, n, k, dtype, rows, batched, bias, activation, save_preact, tokens):
        def run(a, b, *rest):
            bias_t = rest[0] if bias else None
            c, z = rest[1 if bias else 0], (rest[-1] if save_preact else None)
            for t in (a, b, bias_t, c, z):
                assert t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0)
            assert a.shape[-1] == (k or rows) and c.shape[-1] == n  # padded static dims
            y, zz = reference.matmul(lay, a, b, bias_t, activation, save_preact)
            c.copy_(y)
            if z is not None:
                z.copy_(zz)
            seen.append(lay)

        return run

    monkeypatch.setattr(G, "_matmul_kernel", fake_kernel)
    m, (k, n) = 33, ((72, 200) if case != "ragged" else (13, 5))
    batch = 3 if case == "batched" else None
    _, a, b, _ = _gemm_case(m, k, n, torch.bfloat16, "cpu", layout, batch)
    if case == "strided":  # a column slice: not contiguous, copied by the general path
        a = torch.cat([a, a], dim=-1)[..., : a.shape[-1]]
    bias = _randn(n, dtype=torch.bfloat16, device="cpu") if epilogue != "plain" else None
    act, preact = ("gelu_tanh", True) if epilogue != "plain" else ("none", False)
    y, z = G._launch_matmul(layout, a, b, bias, act, preact)
    want_y, want_z = reference.matmul(layout, a, b, bias, act, preact)
    assert seen == [layout]
    assert y.shape == want_y.shape and y.is_contiguous()
    _check(y, want_y.float(), torch.bfloat16, "emulated launch")
    if preact:
        _check(z, want_z.float(), torch.bfloat16, "emulated launch z")
    else:
        assert z is None


def test_fast_path_accepts_only_the_plain_call(monkeypatch):
    """`_fast_2d` is both the validation and the launch of the common call: it must launch the
    plain call (with the right buffers, in order) and return None for everything else, so the op
    falls through to its checks (which name the problem) or to the general path (copies, padding)."""
    launched = []

    def fake_kernel(device, lay, n, k, dtype, rows, batched, bias, activation, save_preact, tokens):
        def run(*args):
            launched.append((lay, n, k, rows, bias, save_preact, tokens, [t.shape for t in args]))

        return run

    monkeypatch.setattr(G, "_matmul_kernel", fake_kernel)
    bf = torch.bfloat16
    a, w, bias = torch.randn(33, 64, dtype=bf), torch.randn(40, 64, dtype=bf), torch.randn(40, dtype=bf)
    y, z = G._fast_2d("nt", a, w, bias, "gelu_tanh", True)
    assert launched == [("nt", 40, 64, 0, True, True, 33, [(33, 64), (40, 64), (40,), (33, 40), (33, 40)])]
    assert y.shape == z.shape == (33, 40)
    launched.clear()
    assert G._fast_2d("nn", a, w.t().contiguous())[0].shape == (33, 40)
    assert G._fast_2d("tn", a, torch.randn(33, 16, dtype=bf))[0].shape == (64, 16)  # (tokens, P)ᵀ @ (tokens, N)
    assert [c[0] for c in launched] == ["nn", "tn"] and launched[1][3] == 64 and launched[1][6] == 33
    launched.clear()
    misaligned = torch.randn(33 * 64 + 1, dtype=bf)[1:].view(33, 64)
    near_misses = {
        "dtype mix": ("nt", a, w.float(), None),
        "unsupported dtype": ("nt", a.float(), w.float(), None),
        "3-D input": ("nt", a.unsqueeze(0), w, None),
        "reduction mismatch": ("nt", a, w[:, :56].contiguous(), None),
        "K not a multiple of 8": ("nt", a[:, :60].contiguous(), w[:, :60].contiguous(), None),
        "N not a multiple of 8": ("nt", a, w[:36].contiguous(), None),
        "empty reduction": ("nt", a[:, :0], w[:, :0], None),
        "non-contiguous": ("nt", a.t().contiguous().t(), w, None),
        "misaligned": ("nt", misaligned, w, None),
        "bias length": ("nt", a, w, bias[:32]),
        "bias dtype": ("nt", a, w, bias.float()),
        "tn rows not a multiple of 8": ("tn", a[:, :60].contiguous(), torch.randn(33, 16, dtype=bf), None),
    }
    for name, (layout, x, b, bb) in near_misses.items():
        assert G._fast_2d(layout, x, b, bb) is None, name
    assert not launched


def test_two_cta_register_split_fits_the_launch_allocation():
    # setmaxnreg.inc that the CTA's launch allocation cannot grant waits forever: the derived
    # consumer budget plus the producer's must fit, for every layout a config can ask for.
    from tilelang_ops.runtime import PRODUCER_REGS, warpgroup_regs

    assert warpgroup_regs(256, 2) == 104  # the shipped two-CTA schedules (GPU-measured)
    for threads in (128, 256, 384):
        for blocks in (2, 3, 4):
            total = threads + 128
            launch = min(65536 // (total * blocks), 255) // 8 * 8
            regs = warpgroup_regs(threads, blocks)
            assert regs % 8 == 0 and 24 <= regs <= 240, (threads, blocks, regs)
            assert PRODUCER_REGS * 128 + regs * threads <= launch * total, (threads, blocks, regs)


# ---------------------------------------------------------------- gemm_act_grad and mlp (an MLP block's fused backward)

# (M, K, N) of gemm_act_grad: ragged row and column tiles of the fused kernel (K, N multiples of
# 8); N not a multiple of 8 (the unfused fallback: GEMM, then act_grad).
GEMM_ACT_GRAD_SHAPES = [(1, 64, 128), (300, 72, 200), (17, 64, 1000), (130, 13, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("shape", GEMM_ACT_GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_act_grad(device, act, shape):
    m, k, n = shape
    dy = _randn(m, k, dtype=torch.bfloat16, device=device)
    w = _randn(k, n, dtype=torch.bfloat16, device=device, scale=k**-0.5)
    z = _randn(m, n, dtype=torch.bfloat16, device=device)
    want = (dy.float() @ w.float()) * reference.activation_grad(z.float(), act)
    if device == "cuda":
        with poisoned_cuda_allocation(m * n * 2) as ptr:
            dz, db = torch.ops.tileops.gemm_act_grad(dy, w, z, act, True)
        assert dz.data_ptr() == ptr, "poison did not reach the output"
    else:
        dz, db = torch.ops.tileops.gemm_act_grad(dy, w, z, act, True)
    _check(dz, want, torch.bfloat16, "dz")
    _check(db, want.sum(0), torch.bfloat16, "db")
    dz2, db2 = torch.ops.tileops.gemm_act_grad(dy, w, z, act, False)
    assert torch.equal(dz2, dz), "dz differs between two calls"  # deterministic: no atomics
    assert db2.shape == (0,) and db2.dtype == dy.dtype


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_act_grad_bad_input(device):
    dy = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    w = torch.randn(16, 24, device=device, dtype=torch.bfloat16)
    z = torch.randn(4, 24, device=device, dtype=torch.bfloat16)
    op = torch.ops.tileops.gemm_act_grad
    with pytest.raises(ValueError, match="activation: 'none'"):
        op(dy, w, z, "none", True)
    with pytest.raises(ValueError, match="w: shape"):
        op(dy, w[:8], z, "gelu", True)
    with pytest.raises(ValueError, match="z: shape"):
        op(dy, w, z[:, :8], "gelu", True)
    with pytest.raises(TypeError, match="z: dtype"):
        op(dy, w, z.half(), "gelu", True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_forward_backward(device, act, bias):
    dtype = torch.bfloat16
    d, hid = LINEAR_IN_OUT
    x = _randn(3, 50, d, dtype=dtype, device=device)
    w1 = _randn(hid, d, dtype=dtype, device=device, scale=d**-0.5)
    w2 = _randn(d, hid, dtype=dtype, device=device, scale=hid**-0.5)
    b1, b2 = (_randn(n, dtype=dtype, device=device) if bias else None for n in (hid, d))
    g = torch.randn(3, 50, d, device=device).to(dtype)
    out, grads = _grads(lambda *a: tilelang_ops.functional.mlp(*a, act), [x, w1, b1, w2, b2], g)
    ref, refs = _grads(lambda *a: reference.mlp(*a, act), [t.double() if t is not None else None for t in (x, w1, b1, w2, b2)], g.double())
    _check(out, ref, dtype, f"{act} y")
    for name, got, want in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, refs):
        if want is not None:
            _check(got, want, dtype, f"{act} {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_hidden_outputs_used_downstream(device):
    # the rare backward: h and z of tileops.mlp also feed the loss (their gradients add to dz)
    dtype = torch.bfloat16
    x = _randn(40, 72, dtype=dtype, device=device)
    w1, w2 = _randn(200, 72, dtype=dtype, device=device, scale=0.1), _randn(72, 200, dtype=dtype, device=device, scale=0.1)
    b1, b2 = _randn(200, dtype=dtype, device=device), _randn(72, dtype=dtype, device=device)

    def loss(x, w1, b1, w2, b2, op):
        y, h, z = op(x, w1, b1, w2, b2, "silu")
        return y.float().square().sum() + h.float().sum() + (z.float() * 0.5).sum()

    def ref_op(x, w1, b1, w2, b2, act):
        z = torch.nn.functional.linear(x, w1, b1)
        h = reference.activation(z, act)
        return torch.nn.functional.linear(h, w2, b2), h, z

    ts = [t.requires_grad_() for t in (x, w1, b1, w2, b2)]
    loss(*ts, torch.ops.tileops.mlp).backward()
    rs = [t.detach().double().requires_grad_() for t in ts]
    loss(*rs, ref_op).backward()
    for name, t, r in zip(("dx", "dw1", "db1", "dw2", "db2"), ts, rs):
        _check(t.grad, r.grad, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_module_loads_sequential_weights_and_compiles(device):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(72, 200), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(200, 72)).to(device, torch.bfloat16)
    mlp = tnn.MLP(72, 200, activation="gelu_tanh").to(device, torch.bfloat16)
    mlp.load_state_dict({k.replace("0.", "fc1.").replace("2.", "fc2."): v for k, v in seq.state_dict().items()})
    shared = tnn.MLP.from_linears(seq[0], "gelu_tanh", seq[2])
    assert shared.fc1.weight is seq[0].weight
    _compiled_grads_match(mlp, seq, torch.randn(3, 40, 72, device=device, dtype=torch.bfloat16), device)


def test_mlp_float32_falls_back_and_autocast_casts():
    # float32 has no kernel: the module computes in PyTorch; under autocast inputs are cast first.
    mlp = tnn.MLP(72, 200, activation="silu")
    x = torch.randn(4, 72)
    want = reference.mlp(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, "silu")
    torch.testing.assert_close(mlp(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    _check(y, want, torch.bfloat16, "autocast")


def test_mlp_bad_input():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w1, w2 = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="activation: 'none'"):
        tilelang_ops.functional.mlp(x, w1, None, w2, None, "none")
    with pytest.raises(ValueError, match="w2: shape"):
        tilelang_ops.functional.mlp(x, w1, None, w2[:, :8], None, "gelu")
    with pytest.raises(ValueError, match="b2: shape"):
        tilelang_ops.functional.mlp(x, w1, None, w2, torch.randn(3, dtype=torch.bfloat16), "gelu")
    with pytest.raises(ValueError, match="b1: shape"):
        tilelang_ops.functional.mlp(x, w1, torch.randn(3, dtype=torch.bfloat16), w2, None, "gelu")
    with pytest.raises(ValueError, match="w1's in_features"):
        tilelang_ops.functional.mlp(x, w1[:, :8], None, w2, None, "gelu")
    with pytest.raises(TypeError, match="w2: dtype"):
        tilelang_ops.functional.mlp(x, w1, None, w2.half(), None, "gelu")
    with pytest.raises(ValueError, match="activation: 'tanh'"):
        tnn.MLP(16, 32, activation="tanh")
    with pytest.raises(ValueError, match="fc2: in_features"):
        tnn.MLP.from_linears(torch.nn.Linear(16, 32), "relu", torch.nn.Linear(16, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_opcheck(device):
    x = _randn(5, 72, dtype=torch.bfloat16, device=device).requires_grad_()
    w1 = _randn(200, 72, dtype=torch.bfloat16, device=device, scale=0.1).requires_grad_()
    w2 = _randn(72, 200, dtype=torch.bfloat16, device=device, scale=0.1).requires_grad_()
    b1, b2 = _randn(200, dtype=torch.bfloat16, device=device).requires_grad_(), _randn(72, dtype=torch.bfloat16, device=device).requires_grad_()
    opcheck(torch.ops.tileops.mlp, (x, w1, b1, w2, b2, "gelu_tanh"))
    dy, z = _randn(5, 72, dtype=torch.bfloat16, device=device), _randn(5, 200, dtype=torch.bfloat16, device=device)
    opcheck(torch.ops.tileops.gemm_act_grad, (dy, w2.detach(), z, "silu", True))
