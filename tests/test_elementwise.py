"""torch.ops.tileops.add: reference, opcheck, fake, compile, bad input, and the GPU kernel."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

from tilelang_ops.reference import ELEMENTWISE_ATOL, ELEMENTWISE_RTOL

from .helpers import DEVICES, poisoned_cuda_allocation, requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [
    (1,),  # one element: a single ragged tile
    (17,),  # shorter than one vector per thread
    (2048,),  # exactly one full tile
    (1000, 4097),  # many full tiles + ragged tail
    (3, 5, 7),  # n-D input flattened
]


def _close(out, a, b):
    ref = a.double() + b.double()
    torch.testing.assert_close(out.double(), ref, atol=ELEMENTWISE_ATOL[a.dtype], rtol=ELEMENTWISE_RTOL[a.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_matches_reference(device, dtype, shape):
    a = torch.randn(shape, dtype=dtype, device=device)
    b = torch.randn(shape, dtype=dtype, device=device)
    out = torch.ops.tileops.add(a, b)
    assert out.shape == a.shape and out.dtype == dtype and out.device == a.device
    _close(out, a, b)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 2047, 2048, 2049, 4097, 1 << 20, 3 * (1 << 20) + 5, (1 << 22) + 1, 5 * (1 << 22) + 3])
def test_add_cuda_poisoned_output(dtype, n):
    a = torch.randn(n, dtype=dtype, device="cuda")
    b = torch.randn(n, dtype=dtype, device="cuda")
    with poisoned_cuda_allocation(n * a.element_size()) as ptr:
        out = torch.ops.tileops.add(a, b)
    assert out.data_ptr() == ptr, "poison did not reach the output; the test would not catch unwritten elements"
    assert torch.isfinite(out).all()
    _close(out, a, b)
    # bit-exact with the CPU reference path (both round once from float32)
    assert torch.equal(out.cpu(), torch.ops.tileops.add(a.cpu(), b.cpu()))


@pytest.mark.gpu
@requires_cuda
def test_add_tuned_config_per_length_bucket(tmp_path, monkeypatch):
    # a config tuned for long calls serves long calls only; short ones keep the default
    from tilelang_ops import runtime, tuning
    from tilelang_ops.kernels import elementwise as K
    from tilelang_ops.ops import elementwise as E

    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_loaded", None)
    monkeypatch.setattr(E, "_kernels", {})
    dev = torch.device("cuda", torch.cuda.current_device())
    default, tuned = K.default_config("float32"), K.AddConfig(1024, 128)
    assert tuned != default
    key = tuning.entry_key("add", "float32", {}, "n>4M", torch.cuda.get_device_name(dev), runtime.arch_for_device(dev))
    tuning.store(key, dataclasses.asdict(tuned))
    for n in (E.SHORT - 5, E.SHORT + 7):
        a, b = torch.randn(n, device=dev), torch.randn(n, device=dev)
        _close(torch.ops.tileops.add(a, b), a, b)
    served = {k.split("|")[5]: cfg for (op, k), cfg in tuning.SERVED.items() if op == "add" and "|float32|" in k}
    assert served["n>4M"] == tuned and served["n<=4M"] == default


@pytest.mark.gpu
@requires_cuda
def test_add_cuda_misaligned_view():
    base_a = torch.randn(4097, dtype=torch.bfloat16, device="cuda")
    base_b = torch.randn(4097, dtype=torch.bfloat16, device="cuda")
    a, b = base_a[1:], base_b[1:]  # contiguous but 2 bytes off a 16-byte boundary
    _close(torch.ops.tileops.add(a, b), a, b)


@pytest.mark.gpu
@requires_cuda
def test_add_runs_on_current_stream_and_in_cuda_graph():
    a = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    torch.ops.tileops.add(a, b)  # compile + warm outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.ops.tileops.add(a, b)
    torch.cuda.current_stream().wait_stream(s)
    _close(out, a, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = torch.ops.tileops.add(a, b)
    a.copy_(torch.randn_like(a))
    g.replay()
    torch.cuda.synchronize()
    _close(captured, a, b)


@given(n=st.integers(1, 70000), dtype=st.sampled_from(DTYPES), device=st.sampled_from(DEVICES))
def test_add_fuzz_lengths(n, dtype, device):
    a = torch.randn(n, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device)
    _close(torch.ops.tileops.add(a, b), a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_opcheck(device, dtype):
    for shape in [(17,), (33, 65)]:
        a = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
        b = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
        opcheck(torch.ops.tileops.add.default, (a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_add_empty_returns_empty(device):
    a = torch.empty(0, 5, device=device)
    out = torch.ops.tileops.add(a, a)
    assert out.shape == (0, 5)


def test_add_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(7, 3, dtype=torch.bfloat16)
        out = torch.ops.tileops.add(a, a)
    assert out.shape == (7, 3) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_add_backward(device):
    a = torch.randn(5, 9, device=device, requires_grad=True)
    b = torch.randn(5, 9, device=device, requires_grad=True)
    g = torch.randn(5, 9, device=device)
    torch.ops.tileops.add(a, b).backward(g)
    assert torch.equal(a.grad, g) and torch.equal(b.grad, g)


@pytest.mark.parametrize("device", DEVICES)
def test_add_torch_compile_fullgraph_no_graph_break(device):
    import torch._dynamo

    torch._dynamo.reset()

    def f(x, y):
        return torch.ops.tileops.add(x * 2, y).sum()

    x = torch.randn(64, device=device, requires_grad=True)
    y = torch.randn(64, device=device, requires_grad=True)
    explain = torch._dynamo.explain(f)(x, y)
    assert explain.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True)
    compiled(x, y).backward()
    assert torch.allclose(x.grad, torch.full_like(x, 2.0)) and torch.allclose(y.grad, torch.ones_like(y))


BAD_INPUTS = [
    ("integer dtype", lambda d: (torch.ones(4, dtype=torch.int32, device=d), torch.ones(4, dtype=torch.int32, device=d)), TypeError, "a: dtype int32"),
    ("float64", lambda d: (torch.ones(4, dtype=torch.float64, device=d),) * 2, TypeError, "supported: float32, float16, bfloat16"),
    ("dtype mix", lambda d: (torch.ones(4, device=d), torch.ones(4, dtype=torch.bfloat16, device=d)), TypeError, "b: dtype"),
    ("shape mismatch", lambda d: (torch.ones(4, device=d), torch.ones(5, device=d)), ValueError, "b: shape"),
    ("broadcast", lambda d: (torch.ones(4, 3, device=d), torch.ones(3, device=d)), ValueError, "broadcasting"),
    ("non-contiguous", lambda d: (torch.ones(4, 6, device=d).t(), torch.ones(6, 4, device=d)), ValueError, "a: non-contiguous"),
    # rejected by the dispatcher's schema check before our code runs; its message names the type
    ("not a tensor", lambda d: (torch.ones(4, device=d), 3.0), RuntimeError, "Unable to cast 3.0 to Tensor"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_add_bad_input(device, case):
    _, make, exc, msg = case
    with pytest.raises(exc, match=msg):
        torch.ops.tileops.add(*make(device))


@requires_cuda
@pytest.mark.gpu
def test_add_mixed_devices():
    with pytest.raises(ValueError, match="b: on device cpu"):
        torch.ops.tileops.add(torch.ones(4, device="cuda"), torch.ones(4))
