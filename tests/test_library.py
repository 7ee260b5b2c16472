"""_library.custom_op's autograd kernel: the direct call must never bypass what sits between
autograd and the backend (dispatch modes, fake and functional tensors), and the grad path must
see every argument, defaults included."""
from __future__ import annotations

import pytest
import torch

import tilelang_ops  # noqa: F401
from tilelang_ops.ops import softmax as softmax_ops

from .helpers import DEVICES, RecordOps, rel_err


@pytest.mark.parametrize("grad", [False, True])
def test_dispatch_modes_see_the_op(grad):
    a = torch.randn(37, requires_grad=grad)
    b = torch.randn(37)
    with RecordOps() as mode:
        out = torch.ops.tileops.add(a, b)
    assert "tileops.add.default" in mode.ops, mode.ops
    assert torch.equal(out, a + b)


def test_fake_tensors_take_the_fake_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 300, dtype=torch.bfloat16)
        y = torch.ops.tileops.softmax(x, -1)
        q = torch.empty(1, 9, 2, 64, dtype=torch.bfloat16, requires_grad=True)
        o = torch.ops.tileops.flash_attn(q, q, q, True)
    assert type(y).__name__ == "FakeTensor" and y.shape == x.shape
    assert type(o).__name__ == "FakeTensor" and o.shape == q.shape


def test_direct_path_is_taken_for_plain_tensors(monkeypatch):
    # The autograd kernel calls the registered implementation itself (no second dispatch):
    # replacing the entry in `impls` must change what a plain call runs.
    calls = []
    impls = softmax_ops.softmax.impls
    cpu = torch._C.DispatchKey.CPU
    real = impls[cpu]
    monkeypatch.setitem(impls, cpu, lambda *args: calls.append(len(args)) or real(*args))
    x = torch.randn(3, 40)
    torch.ops.tileops.softmax(x, -1)
    assert len(calls) == 1  # (x,): the dispatcher drops arguments equal to their defaults


def _spy_backward_impl(monkeypatch, device: str) -> list:
    """Calls that reach softmax_backward's implementation without the dispatcher (its registered
    kernel is the original function; `impls` is what from_backward calls)."""
    from tilelang_ops import _library

    if device == "cuda" and _library._fast():
        pytest.skip("CUDA ops run through the C++ call path: formulas reach its kernels through the dispatcher (tests/test_fastpath.py)")
    calls = []
    impls = softmax_ops.softmax_backward.impls
    key = torch._C.DispatchKey.CUDA if device == "cuda" else torch._C.DispatchKey.CPU
    real = impls[key]
    monkeypatch.setitem(impls, key, lambda *args: calls.append(1) or real(*args))
    return calls


def _softmax_grad(device, **backward_kwargs):
    x = torch.randn(6, 50, device=device, requires_grad=True)
    w = torch.randn(6, 50, device=device)
    (torch.ops.tileops.softmax(x, -1) * w).sum().backward(**backward_kwargs)
    x2 = x.detach().clone().requires_grad_()
    (torch.softmax(x2, -1) * w).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-5
    return x


@pytest.mark.parametrize("device", DEVICES)
def test_backward_formulas_call_the_implementation_directly(monkeypatch, device):
    calls = _spy_backward_impl(monkeypatch, device)
    _softmax_grad(device)
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_backward_formulas_dispatch_under_modes_profiler_and_subclasses(monkeypatch, device):
    # What sits between autograd and the kernel must still see the backward op.
    calls = _spy_backward_impl(monkeypatch, device)
    with RecordOps() as mode:
        _softmax_grad(device)
    assert "softmax_backward" in mode.tileops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _softmax_grad(device)
    assert any(e.name == "tileops::softmax_backward" for e in prof.events())

    seen = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    y = torch.softmax(torch.randn(4, 30, device=device), -1)
    g = torch.randn(4, 30, device=device)
    softmax_ops.softmax_backward.from_backward(g.as_subclass(Sub), y, -1)
    assert "tileops.softmax_backward.default" in seen
    assert calls == []
    softmax_ops.softmax_backward.from_backward(g, y, -1)  # the same call, plain: direct
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_backward_formulas_dispatch_when_recording_a_double_backward(monkeypatch, device):
    # create_graph=True: the backward op's own (missing) autograd decides, as before
    calls = _spy_backward_impl(monkeypatch, device)
    x = torch.randn(4, 30, device=device, requires_grad=True)
    y = torch.ops.tileops.softmax(x, -1)
    try:
        torch.autograd.grad((y * y).sum(), x, create_graph=True)
    except RuntimeError:
        pass
    assert calls == []


def test_grad_path_skips_function_apply_but_records_the_same_node(monkeypatch):
    # The grad-recording call goes to the C apply directly (Function.apply's Python preamble is
    # ~1.5 us); the recorded node must be the op's own backward, giving the same gradient.
    called = []
    fn_cls = type(torch.ops.tileops.softmax(torch.randn(2, 3, requires_grad=True), -1).grad_fn)._forward_cls
    monkeypatch.setattr(fn_cls, "apply", classmethod(lambda cls, *a: called.append(1) or None))
    x = torch.randn(5, 17, requires_grad=True)
    y = torch.ops.tileops.softmax(x, -1)
    assert not called and type(y.grad_fn)._forward_cls is fn_cls
    w = torch.randn(5, 17)
    (y * w).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (torch.softmax(x2, -1) * w).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-5


def test_functorch_transforms_still_go_through_function_apply():
    # Under torch.func the fast path steps aside: Function.apply decides (it asks for a
    # setup_context staticmethod, which the op's Function does not define).
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: torch.ops.tileops.softmax(t, -1).pow(2).sum())(x)


def test_dead_functorch_wrapper_is_unwrapped_before_the_grad_path():
    # A tensor that escaped a finished torch.func.grad is a dead wrapper. The grad path calls the
    # C apply without Function.apply's unwrap: functorch's wrapper key, dispatched before
    # Autograd, must have unwrapped it already — the op sees a plain tensor, and the gradient
    # lands where a native op's does (on the unwrapped tensor).
    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or (t * t).sum())(torch.randn(4, 8, requires_grad=True))
    dead = leaked[0]
    unwrapped = torch._C._functorch.unwrap_if_dead(dead)
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead) and unwrapped is not dead
    seen = []
    impl = softmax_ops.softmax.impls[torch._C.DispatchKey.CPU]
    softmax_ops.softmax.impls[torch._C.DispatchKey.CPU] = lambda *a: seen.append(torch._C._functorch.is_functorch_wrapped_tensor(a[0])) or impl(*a)
    try:
        y = torch.ops.tileops.softmax(dead, -1)
    finally:
        softmax_ops.softmax.impls[torch._C.DispatchKey.CPU] = impl
    assert seen == [False] and y.grad_fn is not None
    w = torch.randn(4, 8)
    (y * w).sum().backward()
    ref = unwrapped.detach().clone().requires_grad_()
    (torch.softmax(ref, -1) * w).sum().backward()
    assert unwrapped.grad is not None and rel_err(unwrapped.grad, ref.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_grad_path_fills_dropped_defaults(device):
    # softmax(x) with dim left at its default: the dispatcher drops it, setup_context must still
    # see dim=-1 (the backward reduces over it).
    x = torch.randn(4, 33, device=device, requires_grad=True)
    y = torch.ops.tileops.softmax(x)
    (y * torch.arange(33.0, device=device)).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (torch.softmax(x2, -1) * torch.arange(33.0, device=device)).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_grad_goes_through_the_lse_op(device):
    q, k, v = (torch.randn(1, 17, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = torch.ops.tileops.flash_attn(q, k, v, True)
    assert "flash_attn_with_lse" in type(out.grad_fn).__name__
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    with torch.no_grad():
        assert torch.ops.tileops.flash_attn(q, k, v, True).grad_fn is None


def test_strided_qkv_are_saved_as_they_are():
    # q, k, v unbound from a packed projection are strided views. The kernels read such strides
    # directly, so autograd saves the views themselves (no copy, forward or backward).
    qkv = torch.randn(2, 17, 3, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = tilelang_ops.flash_attn(q, k, v, causal=True)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5 and [t.data_ptr() for t in saved[:3]] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    out.float().sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def test_inductor_gets_explicit_fallbacks():
    """Once Inductor compiles a graph with a tileops op, every tileops op has an explicit fallback
    lowering with the layout constraint Inductor would pick itself (torch 2.11's implicit path
    stringifies the arguments' IR, which hung the GPT example's first compiled backward)."""
    from torch._inductor import lowering as IL
    from torch._library.utils import get_layout_constraint_tag

    from tilelang_ops import _library

    torch._dynamo.reset()
    x = torch.randn(4, 33, requires_grad=True)
    f = torch.compile(lambda t: torch.ops.tileops.softmax(t * 2, -1).sum(), fullgraph=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(torch.softmax(x * 2, -1).sum(), x)[0])
    assert _library._inductor_fallbacks_done and len(_library.OPS) >= 20
    for op in _library.OPS:
        assert op.op in IL.lowerings, op.qualname
        want = IL.tag_to_layout_constraint(get_layout_constraint_tag(op.op, with_default=True))
        assert IL.maybe_layout_constraints(op.op) is want, op.qualname


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


# (name, forward on CPU leaves -> a tensor to backprop, the backward ops its formula must call directly)
_FORMULAS = [
    ("softmax", lambda: torch.ops.tileops.softmax(_leaf(4, 33), -1), ["softmax_backward"]),
    ("log_softmax", lambda: torch.ops.tileops.log_softmax(_leaf(4, 33), -1), ["log_softmax_backward"]),
    ("gemm", lambda: torch.ops.tileops.gemm(_leaf(5, 24, dtype=torch.bfloat16), _leaf(24, 16, dtype=torch.bfloat16)), ["gemm_nt", "gemm_tn"]),
    ("gemm_nt", lambda: torch.ops.tileops.gemm_nt(_leaf(5, 24, dtype=torch.bfloat16), _leaf(16, 24, dtype=torch.bfloat16)), ["gemm", "gemm_tn"]),
    ("linear", lambda: torch.ops.tileops.linear(_leaf(5, 24, dtype=torch.bfloat16), _leaf(16, 24, dtype=torch.bfloat16), _leaf(16, dtype=torch.bfloat16), "none"), ["bias_grad", "gemm", "gemm_tn"]),
    ("linear gelu_tanh", lambda: torch.ops.tileops.linear(_leaf(5, 24, dtype=torch.bfloat16), _leaf(16, 24, dtype=torch.bfloat16), _leaf(16, dtype=torch.bfloat16), "gelu_tanh"), ["linear", "act_grad", "gemm", "gemm_tn"]),
    ("mlp", lambda: torch.ops.tileops.mlp(_leaf(5, 24, dtype=torch.bfloat16), _leaf(32, 24, dtype=torch.bfloat16), _leaf(32, dtype=torch.bfloat16), _leaf(16, 32, dtype=torch.bfloat16), _leaf(16, dtype=torch.bfloat16), "gelu_tanh")[0],
     ["gemm_act_grad", "bias_grad", "gemm", "gemm_tn"]),
    ("layer_norm", lambda: torch.ops.tileops.layer_norm(_leaf(4, 40), _leaf(40), _leaf(40))[0], ["layer_norm_backward"]),
    ("add_layer_norm", lambda: torch.ops.tileops.add_layer_norm(_leaf(4, 40), _leaf(4, 40), _leaf(40), _leaf(40))[1], ["add_layer_norm_backward"]),
    ("flash_attn", lambda: torch.ops.tileops.flash_attn(*(_leaf(1, 9, 2, 64, dtype=torch.bfloat16) for _ in range(3))), ["flash_attn_backward"]),
    ("flash_attn_qkvpacked", lambda: torch.ops.tileops.flash_attn_qkvpacked(_leaf(1, 9, 3, 2, 64, dtype=torch.bfloat16)), ["flash_attn_qkvpacked_backward"]),
]


@pytest.mark.parametrize("forward, backward_ops", [f[1:] for f in _FORMULAS], ids=[f[0] for f in _FORMULAS])
def test_every_backward_formula_calls_its_ops_directly(monkeypatch, forward, backward_ops):
    # A formula that went back to torch.ops.tileops.X would pass every gradient test but pay the
    # dispatcher's crossing on each call: the CPU implementations must be reached directly.
    from tilelang_ops import _library

    by_name = {op.name: op for op in _library.OPS}
    called = []
    for name in backward_ops:
        impls = by_name[name].impls
        real = impls[torch._C.DispatchKey.CPU]
        monkeypatch.setitem(impls, torch._C.DispatchKey.CPU, lambda *a, _n=name, _f=real: called.append(_n) or _f(*a))
    out = forward()
    out.backward(torch.randn_like(out))
    assert sorted(set(called)) == sorted(backward_ops), called
