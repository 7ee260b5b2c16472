"""torch.ops.tileops.flash_attn_qkvpacked*: one (B, S, 3, H, D) input, one gradient.

Judged as test_attention.py judges flash_attn: against float64 attention of the three slices
(reference.flash_attn with autograd), by relative error; the GPU tests run the kernel that writes
dq, dk and dv into the slices of one packed gradient.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

import tilelang_ops

from .helpers import DEVICES, requires_cuda
from .test_attention import _baseline_errors, _check, _deterministic_algorithms, _launch_recorder, _poisoned_pools, _ref

DTYPES = [torch.bfloat16, torch.float16]


def _qkv(B, S, H, D, dtype, device, requires_grad=True):
    return torch.randn(B, S, 3, H, D, dtype=dtype, device=device).requires_grad_(requires_grad)


def _run_and_check(B, S, H, D, dtype, device, causal, scale=None):
    qkv = _qkv(B, S, H, D, dtype, device)
    out, lse = tilelang_ops.flash_attn_qkvpacked(qkv, causal, scale, return_lse=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous()
    q, k, v = qkv.detach().unbind(2)
    ref_out, ref_lse, ref_grads = _ref(q, k, v, causal, scale, dout)
    base = _baseline_errors(q, k, v, causal, scale, dout, ref_out, ref_lse, ref_grads)
    _check(out, lse, ref_out, ref_lse, dtype, dqkv.unbind(2), ref_grads, base)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 17, 4, 64), (1, 9, 2, 256)])
def test_qkvpacked_cpu_matches_reference(shape, dtype, causal):
    _run_and_check(*shape, dtype, "cpu", causal)


@given(
    b=st.integers(1, 2), s=st.integers(1, 40), h=st.integers(1, 3), d=st.sampled_from([64, 128]),
    causal=st.booleans(), dtype=st.sampled_from(DTYPES),
)
def test_qkvpacked_cpu_fuzz(b, s, h, d, causal, dtype):
    _run_and_check(b, s, h, d, dtype, "cpu", causal)


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_same_as_unbound_flash_attn(device):
    # the packed ops compute what flash_attn computes on the three slices; the gradient is theirs stacked
    qkv = _qkv(2, 33, 4, 64, torch.bfloat16, device)
    out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)
    ref, ref_lse = torch.ops.tileops.flash_attn_with_lse(*qkv.detach().unbind(2), True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert torch.equal(torch.ops.tileops.flash_attn_qkvpacked(qkv.detach(), True), ref)  # inference variant
    dout = torch.randn_like(out)
    dqkv = torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv.detach(), out, lse, True, None)
    grads = torch.ops.tileops.flash_attn_backward(dout, *qkv.detach().unbind(2), out, lse, True, None)
    for name, a, b in zip(("dq", "dk", "dv"), dqkv.unbind(2), grads):
        if name == "dq" and device != "cpu":  # fp32 atomics in run order on CUDA: equal up to the last bits
            torch.testing.assert_close(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_opcheck(device):
    for shape, causal, scale in [((1, 17, 2, 64), True, None), ((2, 9, 4, 64), False, 0.2)]:
        qkv = _qkv(*shape, torch.bfloat16, device)
        opcheck(torch.ops.tileops.flash_attn_qkvpacked_with_lse.default, (qkv, causal, scale))
        opcheck(torch.ops.tileops.flash_attn_qkvpacked.default, (qkv, causal, scale))
        out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv.detach(), causal, scale)
        dout = torch.randn_like(out)
        opcheck(torch.ops.tileops.flash_attn_qkvpacked_backward.default, (dout, qkv.detach(), out, lse, causal, scale, None))
        opcheck(torch.ops.tileops.flash_attn_qkvpacked_backward.default, (dout, qkv.detach(), out, lse, causal, scale, torch.randn_like(lse)))


def test_qkvpacked_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(2, 7, 3, 8, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)
        dqkv = torch.ops.tileops.flash_attn_qkvpacked_backward(out, qkv, out, lse, True, None)
        inf = torch.ops.tileops.flash_attn_qkvpacked(qkv)
    assert out.shape == inf.shape == (2, 7, 8, 128) and lse.shape == (2, 8, 7) and lse.dtype == torch.float32
    assert dqkv.shape == qkv.shape


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_empty(device):
    qkv = _qkv(2, 0, 4, 64, torch.bfloat16, device)
    out = tilelang_ops.flash_attn_qkvpacked(qkv)
    out.sum().backward()
    assert out.shape == (2, 0, 4, 64) and qkv.grad.shape == qkv.shape


class _Attn(torch.nn.Module):
    """x -> one QKV projection -> packed attention -> projection, as a GPT block's attention."""

    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.heads, C // self.heads)
        return self.proj(tilelang_ops.flash_attn_qkvpacked(qkv, causal=True).reshape(B, S, C))


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_torch_compile_fullgraph(device):
    # fullgraph=True raises on a graph break; forward and backward through the compiled module
    torch._dynamo.reset()
    m = _Attn().to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 19, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    eager = m(x)
    (gx,) = torch.autograd.grad(eager.float().sum(), x)
    compiled = torch.compile(m, fullgraph=True)
    out = compiled(x)
    (gx_c,) = torch.autograd.grad(out.float().sum(), x)
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gx_c, gx, atol=2e-2, rtol=2e-2)


def _bad(d):
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, dtype=dt, device=d)  # noqa: E731
    return [
        ("wrong rank", (r(1, 8, 3, 2),), {}, ValueError, "qkv: expected 5-D"),
        ("not three", (r(1, 8, 2, 2, 64),), {}, ValueError, "needs 3 at dim 2"),
        ("float32", (r(1, 8, 3, 2, 64, dt=torch.float32),), {}, TypeError, "qkv: dtype float32 is not supported"),
        ("head dim 96", (r(1, 8, 3, 2, 96),), {}, ValueError, "qkv: head dim 96 is not supported"),
        ("bad scale", (r(1, 8, 3, 2, 64),), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", range(5))
def test_qkvpacked_bad_input(device, idx):
    name, args, kwargs, exc, msg = _bad(device)[idx]
    with pytest.raises(exc, match=msg):
        tilelang_ops.flash_attn_qkvpacked(*args, **kwargs)
    with pytest.raises(exc, match=msg):
        tilelang_ops.flash_attn_qkvpacked(*args, **kwargs, return_lse=True)


@pytest.mark.parametrize("det", [False, True], ids=["fast", "deterministic"])
def test_qkvpacked_backward_launches(det, monkeypatch):
    # The CUDA backward's kernels and their arguments (checked against each PrimFunc's parameters):
    # the fast path is the fused kernel writing the packed gradient's slices; the deterministic one
    # is flash_attn_backward's, then a stack.
    from tilelang_ops.ops import attention as ops

    launched = _launch_recorder(monkeypatch)
    # a contiguous qkv's slices go to the kernels as they are: no copy
    monkeypatch.setattr(ops, "aligned16", lambda t: pytest.fail("copied a slice of a contiguous qkv"))
    # (up to SMALL_BWD_KEYS tokens both are one kernel, flash_bwd_small: tests/test_attention.py)
    qkv = _qkv(2, ops.SMALL_BWD_KEYS + 5, 4, 64, torch.bfloat16, "cpu", requires_grad=False)
    out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)
    with _deterministic_algorithms(det):
        dqkv = ops._packed_bwd_cuda(torch.randn_like(out), qkv, out, lse, True, None, None)
    assert launched == (["flash_bwd_prep", "flash_bwd", "flash_bwd_dq"] if det else ["flash_bwd_fused"])
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 1, 2, 64), (1, 17, 2, 64), (2, 1000, 8, 128), (1, 129, 4, 256), (1, 4097, 2, 64)])
def test_qkvpacked_cuda_poisoned_outputs(shape, causal):
    """Every element of out, lse and the packed gradient is written (tails, one-row sequences)."""
    B, S, H, D = shape
    dtype = torch.bfloat16
    qkv = _qkv(B, S, H, D, dtype, "cuda", requires_grad=False)
    dout = torch.randn(B, S, H, D, dtype=dtype, device="cuda")
    q, k, v = qkv.unbind(2)
    ref_out, ref_lse, ref_grads = _ref(q, k, v, causal, None, dout)
    with _poisoned_pools(64 << 20) as poisoned:
        out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, causal)
        dqkv = torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv, out, lse, causal, None)
        torch.cuda.synchronize()
    missed = [n for n, t in zip(("out", "lse", "dqkv"), (out, lse, dqkv)) if not poisoned(t)]
    assert not missed, f"poison did not reach {missed}: the test could not see an unwritten element"
    base = _baseline_errors(q, k, v, causal, None, dout, ref_out, ref_lse, ref_grads)
    _check(out, lse, ref_out, ref_lse, dtype, dqkv.unbind(2), ref_grads, base)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkvpacked_cuda_matches_reference(dtype, causal):
    _run_and_check(2, 1000, 4, 64, dtype, "cuda", causal)


@pytest.mark.gpu
@requires_cuda
def test_qkvpacked_cuda_strided_input_and_deterministic():
    # qkv as a view of a wider projection (strides beyond the packed layout) is read in place; under
    # torch.use_deterministic_algorithms the backward is bitwise repeatable
    wide = torch.randn(2, 300, 3 * 4 * 64 + 64, dtype=torch.bfloat16, device="cuda")
    qkv = wide[..., : 3 * 4 * 64].view(2, 300, 3, 4, 64)
    out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)
    dout = torch.randn_like(out)
    q, k, v = qkv.unbind(2)
    ref_out, ref_lse, ref_grads = _ref(q, k, v, True, None, dout)
    fast = torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv, out, lse, True, None)
    _check(out, lse, ref_out, ref_lse, torch.bfloat16, fast.unbind(2), ref_grads, _baseline_errors(q, k, v, True, None, dout, ref_out, ref_lse, ref_grads))
    with _deterministic_algorithms(True):
        a = torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv, out, lse, True, None)
        b = torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv, out, lse, True, None)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, fast, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_qkvpacked_cuda_graph_capture():
    # forward and backward captured in one CUDA graph and replayed on new inputs
    qkv = _qkv(2, 256, 4, 64, torch.bfloat16, "cuda", requires_grad=False)
    dout = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16, device="cuda")

    def step():
        out, lse = torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)
        return out, torch.ops.tileops.flash_attn_qkvpacked_backward(dout, qkv, out, lse, True, None)

    step()  # compile and warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, dqkv = step()
    qkv.copy_(torch.randn_like(qkv))
    g.replay()
    torch.cuda.synchronize()
    q, k, v = qkv.unbind(2)
    ref_out, ref_lse, ref_grads = _ref(q, k, v, True, None, dout)
    _check(out, torch.ops.tileops.flash_attn_qkvpacked_with_lse(qkv, True)[1], ref_out, ref_lse, torch.bfloat16, dqkv.unbind(2), ref_grads,
           _baseline_errors(q, k, v, True, None, dout, ref_out, ref_lse, ref_grads))
