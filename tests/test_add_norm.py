"""torch.ops.tileops.add_layer_norm (+ add_layer_norm_backward): h = x + residual, y = layer_norm(h),
one kernel each way. Reference: the unfused PyTorch composite in float64 (h = x + residual, then
F.layer_norm), on every device; opcheck, fake, torch.compile with backward, the module form, bad
input; on the GPU NaN-poisoned outputs over ragged rows and row lengths, and determinism.

Tolerances as tests/test_norm.py (reference.LAYER_NORM_* on y; gradients by relative Frobenius
error, the loosest dtype among x, residual and the parameters): h is exact up to one rounding to
x's dtype, so it is compared to the rounded composite exactly where x's dtype is float32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import tilelang_ops
from tilelang_ops.reference import LAYER_NORM_ATOL, LAYER_NORM_RTOL

from .helpers import DEVICES, rel_err, requires_cuda

GRAD_REL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (x dtype = the stream, residual dtype, parameter dtype, out_dtype): GPT under autocast first
COMBOS = [
    (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, None),
    (torch.float16, torch.float16, torch.float32, None),
]
COMBO_IDS = ["f32+bf16->bf16", "f32", "bf16", "f16,f32-params"]


def _inputs(shape, combo, device, requires_grad=False):
    xd, rd, wd, _ = combo
    n = shape[-1]
    x = (torch.randn(shape, device=device) * 3 + 0.5).to(xd)  # off-centre: the mean matters
    r = torch.randn(shape, device=device).to(rd)
    w, b = torch.randn(n, device=device).to(wd), torch.randn(n, device=device).to(wd)
    return tuple(t.requires_grad_(requires_grad) for t in (x, r, w, b))


def _composite(x, r, w, b, out_dtype, eps=1e-5):
    """What a model without the fused op computes: the stored h, then the norm, in float64."""
    h = x + r  # x's dtype (the wider one): one rounding, as the kernel
    y = F.layer_norm(h.double(), h.shape[-1:], w.double(), b.double(), eps)
    return h, y


def _check(combo, got_h, got_y, x, r, w, b):
    h, y = _composite(x, r, w, b, combo[3])
    if x.dtype is torch.float32:
        assert torch.equal(got_h, h)
    else:
        torch.testing.assert_close(got_h.double(), x.double() + r.double(), atol=LAYER_NORM_ATOL[x.dtype] * 4, rtol=LAYER_NORM_RTOL[x.dtype])
    assert got_h.dtype is x.dtype and got_y.dtype is (combo[3] or x.dtype)
    out_dt = combo[3] or x.dtype
    torch.testing.assert_close(got_y.double(), y, atol=LAYER_NORM_ATOL[out_dt], rtol=LAYER_NORM_RTOL[out_dt])


SHAPES = [(1, 1), (17, 768), (3, 5, 1000), (4, 4097)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_the_unfused_composite(device, combo, shape):
    x, r, w, b = _inputs(shape, combo, device)
    h, y, mean, rstd = torch.ops.tileops.add_layer_norm(x, r, w, b, 1e-5, combo[3])
    _check(combo, h, y, x, r, w, b)
    assert mean.shape == rstd.shape == shape[:-1] and mean.dtype is rstd.dtype is torch.float32


def _grads(x, r, w, b, out_dtype, fused: bool, with_dh: bool, seed=0):
    """Gradients of a loss using y and (with_dh) h itself, the stream's later use."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    xl, rl, wl, bl = leaves
    if fused:
        h, y = tilelang_ops.add_layer_norm(xl, rl, xl.shape[-1:], wl, bl, 1e-5, out_dtype)
    else:  # float64 composite
        h = xl.double() + rl.double()
        y = F.layer_norm(h, h.shape[-1:], wl.double(), bl.double(), 1e-5)
    g = torch.Generator(device="cpu").manual_seed(seed)
    dy = torch.randn(y.shape, generator=g).to(y.device)
    dh = torch.randn(h.shape, generator=g).to(h.device)
    loss = (y.double() * dy.double()).sum() + ((h.double() * dh.double()).sum() if with_dh else 0)
    loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("with_dh", [True, False], ids=["stream-used", "stream-unused"])
@pytest.mark.parametrize("shape", [(33, 768), (2, 3, 4097)], ids=["33x768", "2x3x4097"])
def test_gradients_match_float64_autograd(device, combo, with_dh, shape):
    x, r, w, b = _inputs(shape, combo, device)
    got = _grads(x, r, w, b, combo[3], True, with_dh)
    want = _grads(x, r, w, b, combo[3], False, with_dh)
    tol = max(GRAD_REL[d] for d in (combo[0], combo[1], combo[2], combo[3] or combo[0]))
    for name, g, ref, leaf in zip(("dx", "dresidual", "dweight", "dbias"), got, want, (x, r, w, b)):
        assert g.dtype is leaf.dtype, name
        assert rel_err(g, ref) <= tol, f"{name}: {rel_err(g, ref):.2e} > {tol:.0e}"


FUZZ_N = [1, 3, 64, 768, 1000]  # each (n, combo) is a compiled kernel on the GPU (warm_norm_cache)


@given(lead=st.sampled_from([(1,), (7,), (2, 33), (300,)]), n=st.sampled_from(FUZZ_N), combo=st.sampled_from(range(len(COMBOS))))
@settings(deadline=None, max_examples=25)
def test_fuzz_shapes(lead, n, combo):
    c = COMBOS[combo]
    for device in DEVICES:
        x, r, w, b = _inputs((*lead, n), c, device)
        h, y = tilelang_ops.add_layer_norm(x, r, n, w, b, 1e-5, c[3])
        _check(c, h, y, x, r, w, b)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, r, w, b = _inputs((5, 64), COMBOS[0], device, requires_grad=True)
    opcheck(torch.ops.tileops.add_layer_norm, (x, r, w, b, 1e-5, torch.bfloat16))
    opcheck(torch.ops.tileops.add_layer_norm, (x, r, None, None))
    h, y, mean, rstd = torch.ops.tileops.add_layer_norm(x.detach(), r.detach(), w.detach(), b.detach())
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    opcheck(torch.ops.tileops.add_layer_norm_backward, (dy, dh, h, w.detach(), mean, rstd, torch.bfloat16))
    opcheck(torch.ops.tileops.add_layer_norm_backward, (dy, None, h, None, mean, rstd, torch.float32))


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, r = torch.empty(2, 3, 8), torch.empty(2, 3, 8, dtype=torch.bfloat16)
        h, y, mean, rstd = torch.ops.tileops.add_layer_norm(x, r, None, None, 1e-5, torch.bfloat16)
        assert h.dtype is torch.float32 and y.dtype is torch.bfloat16 and mean.shape == (2, 3)
        dx, dr, dw, db = torch.ops.tileops.add_layer_norm_backward(y, None, h, None, mean, rstd, torch.bfloat16)
        assert dx.dtype is torch.float32 and dr.dtype is torch.bfloat16 and dw.shape == (8,)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_forward_and_backward(device):
    ln = tilelang_ops.nn.LayerNorm(64).to(device)

    def block(x, branch):
        h, y = ln(x, branch)
        return (y * y).sum() + h.sum()

    x = torch.randn(4, 64, device=device, requires_grad=True)
    r = torch.randn(4, 64, device=device, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    compiled(x, r).backward()
    gx, gr = x.grad.clone(), r.grad.clone()
    x.grad = r.grad = None
    block(x, r).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gr, r.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_module_forward_with_and_without_residual(device):
    ln = tilelang_ops.nn.LayerNorm((4, 16)).to(device)
    x, r = torch.randn(3, 4, 16, device=device), torch.randn(3, 4, 16, device=device)
    h, y = ln(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, ln(x + r))  # normalized over both trailing dims


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(TypeError, match="residual: dtype torch.float32 is wider than x's"):
        torch.ops.tileops.add_layer_norm(x.bfloat16(), x)
    with pytest.raises(ValueError, match="residual"):
        torch.ops.tileops.add_layer_norm(x, torch.randn(4, 15, device=device))
    with pytest.raises(TypeError, match="residual: dtype int64"):
        torch.ops.tileops.add_layer_norm(x, x.long())
    h, y, mean, rstd = torch.ops.tileops.add_layer_norm(x, x)
    with pytest.raises(ValueError, match="dh"):
        torch.ops.tileops.add_layer_norm_backward(y, torch.randn(4, 15, device=device), h, None, mean, rstd, torch.float32)
    with pytest.raises(TypeError, match="residual_dtype"):
        torch.ops.tileops.add_layer_norm_backward(y, None, h, None, mean, rstd, torch.int32)


# ---------------------------------------------------------------- GPU: the kernels themselves
GPU_SHAPES = [(1, 1), (3, 17), (1000, 768), (7, 4097), (100003, 768)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_cuda_every_element_written_and_deterministic(combo):
    """NaN-poisoned outputs (torch.full), kernels called through the op's own launchers."""
    from tilelang_ops.ops import norm as N

    for shape in GPU_SHAPES:
        m, n = shape
        x, r, w, b = _inputs(shape, combo, "cuda")
        odt = combo[3] or x.dtype
        h, y = (torch.full(shape, float("nan"), device="cuda", dtype=d) for d in (x.dtype, odt))
        mean, rstd = (torch.full((m,), float("nan"), device="cuda") for _ in range(2))
        N._fwd_kernel(n, x.dtype, w.dtype, odt, 1e-5, x.device, r.dtype)(x, r, w, b, h, y, mean, rstd)
        _check(combo, h, y, x, r, w, b)
        for with_dh in (True, False):
            dy = torch.randn(shape, device="cuda").to(odt)
            dh = torch.randn(shape, device="cuda").to(x.dtype) if with_dh else None
            launch, ctas, bm = N._bwd_kernel(n, x.dtype, w.dtype, odt, x.device, r.dtype, with_dh)
            outs = [torch.full(shape, float("nan"), device="cuda", dtype=d) for d in (x.dtype, r.dtype)]
            outs += [torch.full((n,), float("nan"), device="cuda", dtype=w.dtype) for _ in range(2)]
            partials = torch.full((2, N.bwd_grid(m, ctas, bm), n), float("nan"), device="cuda")
            launch(dy, h, w, mean, rstd, *([dh] if with_dh else []), outs[0], outs[1], partials, outs[2], outs[3])
            want = [t.to("cuda") for t in tilelang_ops.reference.add_layer_norm_backward(dy.cpu(), None if dh is None else dh.cpu(), h.cpu(), w.cpu(), mean.cpu(), rstd.cpu(), r.dtype)]
            tol = max(GRAD_REL[d] for d in (x.dtype, r.dtype, w.dtype, odt))
            # ... and the one-CTA variant (the op's for up to SINGLE_STEPS row steps), no partials
            single = N._bwd_kernel(n, x.dtype, w.dtype, odt, x.device, r.dtype, with_dh, True)[0]
            outs1 = [torch.full_like(o, float("nan")) for o in outs]
            single(dy, h, w, mean, rstd, *([dh] if with_dh else []), *outs1)
            for variant, got_all in (("partials", outs), ("single", outs1)):
                for name, got, ref_t in zip(("dx", "dresidual", "dweight", "dbias"), got_all, want):
                    assert torch.isfinite(got).all(), f"{shape} {variant} {name}: unwritten or non-finite elements"
                    assert rel_err(got, ref_t) <= tol, f"{shape} {variant} {name}: {rel_err(got, ref_t):.2e}"
            op = lambda: torch.ops.tileops.add_layer_norm_backward(dy, dh, h, w, mean, rstd, r.dtype)  # noqa: E731
            first, again = op(), op()
            assert all(torch.equal(a, o) for a, o in zip(again, first)), "the backward must be deterministic"
            assert all(torch.equal(a, o) for a, o in zip(first, outs1 if m <= N.SINGLE_STEPS * bm else outs)), "the op runs these launchers"
