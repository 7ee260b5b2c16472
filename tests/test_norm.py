"""torch.ops.tileops.layer_norm (+ layer_norm_backward): reference on every device, hypothesis fuzz,
opcheck, fake, torch.compile with backward, modules, bad input, and on the GPU the kernels with
NaN-poisoned outputs, ragged rows, large batches, determinism and CUDA-graph capture.

Tolerances vs a float64 reference (max |err| <= atol + rtol * |ref|, reference.LAYER_NORM_*):
fp32 1e-5 / 1e-5, fp16 4e-3 / 2e-3, bf16 3e-2 / 1.6e-2 on the output (one rounding to the output
dtype dominates: y is O(1) after normalization); the fuzz's rows of 2-3 elements may nearly
coincide, and there atol also allows x - mean's fp32 rounding amplified by rstd (`_close`). Gradients by relative Frobenius error: 1e-4 when
x, dy and the parameters are fp32, 5e-3 with fp16 and 2e-2 with bf16 among them (dy is rounded to
the output dtype, as autograd hands it over).
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

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRAD_REL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _inputs(shape, dtype, device, wdtype=None, affine=(True, True)):
    n = shape[-1]
    x = torch.randn(shape, device=device, dtype=torch.float32) * 3 + 0.5  # off-centre: the mean matters
    w = torch.randn(n, device=device) if affine[0] else None
    b = torch.randn(n, device=device) if affine[1] else None
    wd = wdtype or dtype
    return x.to(dtype), (w.to(wd) if w is not None else None), (b.to(wd) if b is not None else None)


def _ref(x, w, b, eps=1e-5):
    return F.layer_norm(x.double(), x.shape[-1:], None if w is None else w.double(), None if b is None else b.double(), eps)


def _close(out, ref, dtype, x=None, w=None, eps=1e-5):
    """max |out - ref| <= atol + rtol * |ref|; given x (and w), atol per row also allows the rounding
    of x - mean in fp32 (|x| * 2^-24 an element) amplified by rstd: in a row whose elements nearly
    coincide (the fuzz's rows of 2-3) that, not the kernel or reference path, bounds the error."""
    atol, rtol = LAYER_NORM_ATOL[dtype], LAYER_NORM_RTOL[dtype]
    if x is None:
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
        return
    xd = x.double()
    rstd = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    slack = 4 * 2.0**-24 * xd.abs().amax(-1, keepdim=True) * rstd * (w.double().abs() if w is not None else 1.0)
    err = (out.double() - ref).abs()
    bound = atol + slack + rtol * ref.abs()
    assert out.shape == ref.shape and bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g} (max |err| {err.max().item():.3g})"


def _worst(*dtypes):
    return max(GRAD_REL[d] for d in dtypes)


def _grad_errs(leaves, ref, dy, x, w, eps=1e-5):
    """{name: relative Frobenius error} of each gradient taken. Rows of 1-2 elements normalize to
    exactly 0 / +-1 whatever x is, so dx and dweight cancel to ~0 there and their error is taken
    against their natural magnitude instead (dx: ||rstd * dy * w||, dweight: ||sum |dy| over rows||)."""
    lead = tuple(range(x.dim() - 1))
    dyd = dy.double()
    rstd = torch.rsqrt(x.double().var(-1, unbiased=False, keepdim=True) + eps)
    natural = {"dx": (rstd * dyd * (w.double() if w is not None else 1.0)).norm().item(), "dweight": dyd.abs().sum(lead).norm().item(), "dbias": 0.0}
    errs = {}
    for name, got, want in zip(("dx", "dweight", "dbias"), leaves, ref):
        if got is None:
            continue
        assert got.grad.dtype == got.dtype, name
        denom = max(want.grad.norm().item(), natural[name] if x.shape[-1] <= 2 else 0.0, 1e-30)
        errs[name] = (got.grad.double() - want.grad).norm().item() / denom
    return errs


SHAPES = [(1, 1), (1, 768), (17, 768), (3, 5, 1000), (4, 4097), (2, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_reference(device, dtype, shape):
    x, w, b = _inputs(shape, dtype, device)
    y, mean, rstd = torch.ops.tileops.layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert mean.shape == rstd.shape == x.shape[:-1] and mean.dtype == rstd.dtype == torch.float32
    _close(y, _ref(x, w, b), dtype)
    xd = x.double()
    torch.testing.assert_close(mean.double(), xd.mean(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(xd.var(-1, unbiased=False) + 1e-5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,wdtype,out_dtype",
    [
        (torch.float32, torch.float32, torch.bfloat16),  # fp32 residual stream into a bf16 Linear
        (torch.bfloat16, torch.float32, None),  # bf16 activations, fp32 master parameters
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float16, torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True), (False, False)], ids=["wb", "w", "b", "none"])
def test_dtypes_and_affine(device, dtype, wdtype, out_dtype, affine):
    x, w, b = _inputs((37, 1000), dtype, device, wdtype, affine)
    y = tilelang_ops.layer_norm(x, 1000, w, b, out_dtype=out_dtype)
    od = out_dtype or dtype
    assert y.dtype == od
    _close(y, _ref(x, w, b), od)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,wdtype,out_dtype", [(torch.float32, torch.float32, None), (torch.float32, torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16, None), (torch.bfloat16, torch.float32, None), (torch.float16, torch.float16, None)])
@pytest.mark.parametrize("affine", [(True, True), (False, False), (True, False)], ids=["wb", "none", "w"])
@pytest.mark.parametrize("shape", [(33, 768), (2, 3, 4097), (1, 1)], ids=["33x768", "2x3x4097", "1x1"])
def test_gradients_match_float64_autograd(device, dtype, wdtype, out_dtype, affine, shape):
    x, w, b = _inputs(shape, dtype, device, wdtype, affine)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = tilelang_ops.layer_norm(leaves[0], shape[-1], leaves[1], leaves[2], out_dtype=out_dtype)
    dy = torch.randn_like(y)  # in y's dtype, as autograd hands it over
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    _ref(*ref).backward(dy.double())
    tol = _worst(dtype, wdtype, out_dtype or dtype)
    errs = _grad_errs(leaves, ref, dy, x, w)
    assert all(e <= tol for e in errs.values()), errs


FUZZ_N = [1, 2, 3, 17, 64, 100, 768, 1000, 1024, 4097]  # each n is a compiled kernel (warm_norm_cache)


@settings(deadline=None, max_examples=25)
@given(
    lead=st.lists(st.integers(1, 40), min_size=1, max_size=2),
    n=st.sampled_from(FUZZ_N),
    dtype=st.sampled_from(DTYPES),
    affine=st.sampled_from([(True, True), (False, False), (True, False)]),
    device=st.sampled_from(DEVICES),
)
def test_fuzz_shapes_forward_backward(lead, n, dtype, affine, device):
    x, w, b = _inputs((*lead, n), dtype, device, affine=affine)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = tilelang_ops.layer_norm(leaves[0], n, leaves[1], leaves[2])
    _close(y.detach(), _ref(x, w, b), dtype, x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    _ref(*ref).backward(dy.double())
    errs = _grad_errs(leaves, ref, dy, x, w)
    assert all(e <= GRAD_REL[dtype] for e in errs.values()), errs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, b = _inputs((7, 100), torch.float32, device)
    for args in [(x, w, b), (x, None, None, 1e-6), (x.bfloat16(), w, b, 1e-5, torch.float32), (x, w, None, 1e-5, torch.bfloat16)]:
        opcheck(torch.ops.tileops.layer_norm.default, args)
    _, mean, rstd = torch.ops.tileops.layer_norm(x, w, b)
    opcheck(torch.ops.tileops.layer_norm_backward.default, (torch.randn_like(x), x, w, mean, rstd))
    opcheck(torch.ops.tileops.layer_norm_backward.default, (torch.randn_like(x).bfloat16(), x, None, mean, rstd))


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 9, 768)
        w = torch.empty(768)
        y, mean, rstd = torch.ops.tileops.layer_norm(x, w, w, 1e-5, torch.bfloat16)
        assert y.shape == x.shape and y.dtype == torch.bfloat16 and mean.shape == rstd.shape == (4, 9)
        dx, dw, db = torch.ops.tileops.layer_norm_backward(y, x, w, mean, rstd)
        assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == db.shape == (768,)
        dx, dw, db = torch.ops.tileops.layer_norm_backward(y, x.bfloat16(), None, mean, rstd)
        assert dx.dtype == dw.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_forward_and_backward(device):
    torch._dynamo.reset()
    ln = tilelang_ops.nn.LayerNorm(256, device=device)
    lin = torch.nn.Linear(256, 256, device=device)

    def f(x):
        return lin(ln(x)).square().mean()

    x = torch.randn(4, 10, 256, device=device, requires_grad=True)
    explain = torch._dynamo.explain(f)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    loss = torch.compile(f, fullgraph=True)(x)
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    ref = lin(F.layer_norm(x2, (256,), ln.weight, ln.bias))
    ref.square().mean().backward()
    assert rel_err(x.grad, x2.grad) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_module_is_a_drop_in(device):
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm((4, 64), eps=1e-6, device=device)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    ours = tilelang_ops.nn.LayerNorm((4, 64), eps=1e-6, device=device)
    ours.load_state_dict(ref.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 4, 64, device=device)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    shared = tilelang_ops.nn.LayerNorm.from_layer_norm(ref, out_dtype=torch.bfloat16)
    assert shared.weight is ref.weight and shared.bias is ref.bias
    y = shared(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x), atol=3e-2, rtol=1.6e-2)
    assert "out_dtype=torch.bfloat16" in repr(shared)
    nobias = tilelang_ops.nn.LayerNorm(64, bias=False, device=device)
    assert nobias.bias is None and nobias(x).shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_are_not_differentiable(device):
    x = torch.randn(5, 32, device=device, requires_grad=True)
    y, mean, rstd = torch.ops.tileops.layer_norm(x)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        mean.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    y = tilelang_ops.layer_norm(x, 64)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    y, mean, rstd = torch.ops.tileops.layer_norm(torch.randn(3, 0, device=device))
    assert y.shape == (3, 0) and mean.shape == rstd.shape == (3,) and mean.isnan().all()


def _bad_inputs(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device)
    return [
        ("x int", dict(x=x.long()), TypeError, "x: dtype int64"),
        ("x 0-d", dict(x=torch.tensor(1.0, device=device)), ValueError, "at least 1-D"),
        ("weight shape", dict(weight=torch.randn(15, device=device)), ValueError, r"weight: shape \(15,\)"),
        ("weight 2-D", dict(weight=torch.randn(1, 16, device=device)), ValueError, "weight: expected 1-D"),
        ("weight dtype", dict(x=x.bfloat16(), weight=w.half(), bias=None), TypeError, "weight: dtype torch.float16 must be"),
        ("bias dtype", dict(weight=w, bias=w.double()), TypeError, "bias: dtype float64"),
        ("mixed param dtypes", dict(x=x.bfloat16(), weight=w, bias=w.bfloat16()), TypeError, "bias: dtype torch.bfloat16 differs"),
        ("eps", dict(eps=-1.0), ValueError, "eps: -1.0 must be >= 0"),
        ("out_dtype", dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(9))
def test_bad_input_names_the_argument(device, case):
    name, kw, exc, match = _bad_inputs(device)[case]
    args = dict(x=torch.randn(4, 16, device=device), weight=torch.randn(16, device=device), bias=torch.randn(16, device=device), eps=1e-5, out_dtype=None)
    args.update(kw)
    with pytest.raises(exc, match=match):
        torch.ops.tileops.layer_norm(args["x"], args["weight"], args["bias"], args["eps"], args["out_dtype"])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_backward_input(device):
    x = torch.randn(4, 16, device=device)
    _, mean, rstd = torch.ops.tileops.layer_norm(x)
    with pytest.raises(ValueError, match="dy: shape"):
        torch.ops.tileops.layer_norm_backward(torch.randn(4, 15, device=device), x, None, mean, rstd)
    with pytest.raises(ValueError, match=r"mean: shape \(3,\)"):
        torch.ops.tileops.layer_norm_backward(torch.randn_like(x), x, None, mean[:3], rstd)
    with pytest.raises(TypeError, match="rstd: dtype float64"):
        torch.ops.tileops.layer_norm_backward(torch.randn_like(x), x, None, mean, rstd.double())


def test_stand_in_parameters_made_during_graph_capture_are_not_cached(monkeypatch):
    """weight/bias None: the ones/zeros made while a CUDA graph is being captured are filled only
    in its replays, so they must not serve later (eager) calls."""
    from tilelang_ops.ops import norm as N

    x = torch.randn(3, 24)
    monkeypatch.setattr(N, "_params", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    w, b = N._affine(None, None, x)
    assert torch.equal(w, torch.ones(24)) and torch.equal(b, torch.zeros(24)) and not N._params
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    N._affine(None, None, x)
    assert len(N._params) == 1


def test_normalized_shape_must_match():
    with pytest.raises(ValueError, match="normalized_shape"):
        tilelang_ops.layer_norm(torch.randn(4, 16), (8,))
    with pytest.raises(ValueError, match="normalized_shape"):
        tilelang_ops.layer_norm(torch.randn(4, 16), ())


def test_kernels_compile_for_every_representative_row():
    from tilelang_ops.kernels import norm as K

    # default configs hold a row in registers for every supported length without idle lanes
    for n in (1, 7, 64, 768, 1000, 4096, 4097, 8192, 16384):
        for dt in K.DTYPES:
            for backward in (False, True):
                cfg = K.default_config(n, dt, backward)
                k, w = K.row_tile(cfg, n, dt)
                assert k * w >= n and k * K.vec_width(n, dt) <= 2 * K._PER_THREAD, (n, dt, cfg)
                assert cfg.threads % cfg.block_m == 0 and cfg.threads // cfg.block_m >= 32
    assert all(K.fits(c, 768, "float32") for c in K.search_space(768, "float32"))
    from tilelang_ops.ops import norm as N

    assert N.MAX_N == K.MAX_N  # the op layer states the kernels' limit without importing tilelang
    # the measured defaults are among the configs tune/sweep time
    assert K.default_config(768, "float32") in K.search_space(768, "float32")
    assert K.default_config(4096, "bfloat16", True) in K.search_space(4096, "bfloat16")


# ------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    ((1, 768), torch.float32, torch.float32, torch.bfloat16),
    ((17, 768), torch.float32, torch.float32, torch.bfloat16),
    ((16384, 768), torch.float32, torch.float32, torch.bfloat16),  # the training example's shape
    ((1000, 4097), torch.bfloat16, torch.bfloat16, None),  # ragged row: scalar accesses, padded lanes
    ((4096, 4096), torch.bfloat16, torch.bfloat16, None),
    ((333, 16384), torch.float16, torch.float32, None),  # longest row
    ((5, 3), torch.float32, torch.float32, None),
    ((100003, 64), torch.bfloat16, torch.bfloat16, None),  # many rows per CTA of the backward's grid
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{'x'.join(map(str, c[0]))}-{str(c[1])[6:]}-{str(c[2])[6:]}-{str(c[3])[6:]}" for c in GPU_CASES])
def test_cuda_kernels_write_every_element(case):
    """The launchers with NaN-filled outputs (and partials): an element left unwritten fails."""
    from tilelang_ops.ops import norm as N

    shape, dtype, wdtype, out_dtype = case
    n = shape[-1]
    x, w, b = _inputs(shape, dtype, "cuda", wdtype)
    od = out_dtype or dtype
    nan = lambda *s, dtype=torch.float32: torch.full(s, float("nan"), dtype=dtype, device="cuda")  # noqa: E731
    m = x.numel() // n
    y, mean, rstd = nan(m, n, dtype=od), nan(m), nan(m)
    N._fwd_kernel(n, dtype, wdtype, od, 1e-5, x.device)(x, w, b, y, mean, rstd)
    _close(y, _ref(x, w, b), od)
    dy = torch.randn(m, n, device="cuda").to(od)
    launch, ctas, bm = N._bwd_kernel(n, dtype, wdtype, od, x.device)
    dx, dw, db, parts = nan(m, n, dtype=dtype), nan(n, dtype=wdtype), nan(n, dtype=wdtype), nan(2, N.bwd_grid(m, ctas, bm), n)
    launch(dy, x, w, mean, rstd, dx, parts, dw, db)
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    _ref(*ref).backward(dy.double())
    tol = _worst(dtype, wdtype, od)
    for name, got, want in (("dx", dx, ref[0].grad), ("dw", dw, ref[1].grad), ("db", db, ref[2].grad)):
        assert rel_err(got, want) <= tol, (name, rel_err(got, want))
    if m <= 20000:  # the one-CTA variant (the op's for up to SINGLE_STEPS row steps) at any row count
        single = N._bwd_kernel(n, dtype, wdtype, od, x.device, single=True)[0]
        dx, dw, db = nan(m, n, dtype=dtype), nan(n, dtype=wdtype), nan(n, dtype=wdtype)
        single(dy, x, w, mean, rstd, dx, dw, db)
        for name, got, want in (("dx", dx, ref[0].grad), ("dw", dw, ref[1].grad), ("db", db, ref[2].grad)):
            assert rel_err(got, want) <= tol, ("single", name, rel_err(got, want))


@pytest.mark.gpu
@requires_cuda
def test_cuda_matches_torch_in_a_training_step_and_is_deterministic():
    torch.manual_seed(0)
    x, w, b = _inputs((8, 1024, 768), torch.float32, "cuda")
    dy = torch.randn(8, 1024, 768, device="cuda").bfloat16()
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        tilelang_ops.layer_norm(leaves[0], 768, leaves[1], leaves[2], out_dtype=torch.bfloat16).backward(dy)
        grads.append([t.grad for t in leaves])
    for a, c in zip(*grads):
        assert torch.equal(a, c)  # bitwise: no atomics, fixed fold order
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    F.layer_norm(ref[0], (768,), ref[1], ref[2]).backward(dy.float())
    for got, want in zip(grads[0], ref):
        assert rel_err(got, want.grad) < 2e-2


@pytest.mark.gpu
@requires_cuda
def test_cuda_new_batch_size_does_not_recompile():
    from tilelang_ops import runtime

    w = torch.randn(512, device="cuda")
    for m in (3, 300, 3000):
        x = torch.randn(m, 512, device="cuda", requires_grad=True)
        tilelang_ops.layer_norm(x, 512, w, w).sum().backward()
        if m == 3:
            count = runtime.compiled_count()
    assert runtime.compiled_count() == count


@pytest.mark.gpu
@requires_cuda
def test_cuda_row_too_long_is_a_clear_error():
    with pytest.raises(ValueError, match="x: last dim 16385 > 16384"):
        torch.ops.tileops.layer_norm(torch.randn(2, 16385, device="cuda"))


@pytest.mark.gpu
@requires_cuda
def test_cuda_mixed_devices():
    with pytest.raises(ValueError, match="weight: on device cpu"):
        torch.ops.tileops.layer_norm(torch.randn(2, 16, device="cuda"), torch.randn(16))


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_and_current_stream():
    x, w, b = _inputs((64, 768), torch.float32, "cuda")
    xs = x.detach().clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        tilelang_ops.layer_norm(xs, 768, w, b).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, _, _ = torch.ops.tileops.layer_norm(x, w, b, 1e-5, torch.bfloat16)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    _close(y, _ref(x, w, b), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_without_weight_then_eager():
    """The first weight=None call of a length captured in a CUDA graph, then an eager call: the
    eager call must not use the ones/zeros the capture only recorded (never filled)."""
    x = torch.randn(64, 320, device="cuda") * 2 + 1
    torch.ops.tileops.layer_norm(x, torch.ones(320, device="cuda"), torch.zeros(320, device="cuda"))  # compile outside
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, _, _ = torch.ops.tileops.layer_norm(x)
    _close(torch.ops.tileops.layer_norm(x)[0], _ref(x, None, None), torch.float32)
    g.replay()
    torch.cuda.synchronize()
    _close(y, _ref(x, None, None), torch.float32)


def test_tunables_search_their_defaults_and_serve_every_row_count():
    # `tileops tune --op layer_norm[_backward]`: the default is among the candidates at every
    # preset and dtype, and one config per (row length, dtype) serves every row count
    from tilelang_ops.ops import TUNABLES

    for name in ("layer_norm", "layer_norm_backward"):
        t = TUNABLES[name]
        for shape in t.presets["default"]:
            for dtype in t.dtypes:
                space = t.search_space(shape, dtype)
                assert len(space) >= 4 and t.default(shape, dtype) in space, (name, shape, dtype)
        assert t.key((1, 768), torch.bfloat16, None) == t.key((16384, 768), torch.bfloat16, None) == ({"n": 768}, "any")
