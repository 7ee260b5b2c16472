"""The C++ call path (tilelang_ops/fastpath.py, csrc/fastpath.cpp): a key's later calls replay the
launches its Python implementation made, re-pointed at each call's tensors.

On the CPU the ops are test ops served at the CPU key, whose "kernel" is a C function of the
extension with a compiled kernel's calling convention: it reads and writes only through the
pointers and strides the plan gives it, so a plan pointing at the recorded call's tensors (or
anywhere else) gives wrong numbers. On the GPU every op of ALL_OPS is called on fresh inputs until
it replays, and checked against its float64 reference on every call.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from tilelang_ops import fastpath, runtime

from .helpers import HAS_CUDA, requires_cuda, rel_err

NS = "tileops_fastpath_test"
_lib = torch.library.Library(NS, "DEF")
_names = itertools.count()


@pytest.fixture(scope="module")
def ext():
    e = fastpath.load()
    if e is None:
        if os.environ.get("CI"):  # CI has a compiler: the path must build there
            raise fastpath.load_error()
        pytest.skip(f"the C++ call path does not build here: {fastpath.load_error()}")
    import tvm_ffi
    import tvm_ffi.libinfo

    e.register_test_kernel(tvm_ffi.libinfo.find_libtvm_ffi(), "tileops.test_scale_rowsum")
    return e


@pytest.fixture
def kernel(ext):
    import tvm_ffi

    return runtime.recordable(tvm_ffi.get_global_func("tileops.test_scale_rowsum"))


def test_a_built_module_is_imported_only_for_its_own_source(ext, tmp_path, monkeypatch):
    # a second process imports the built module directly (~10 ms) if its stamp matches the
    # source, torch and Python it was built for; else it builds again
    import shutil

    src = fastpath.build_dir()
    for f in ("tileops_fastpath.so", "tileops_fastpath.stamp"):
        shutil.copy(src / f, tmp_path / f)
    monkeypatch.setattr(fastpath, "build_dir", lambda: tmp_path)
    assert fastpath._import_built() is not None
    (tmp_path / "tileops_fastpath.stamp").write_text("another source")
    assert fastpath._import_built() is None
    (tmp_path / "tileops_fastpath.stamp").unlink()
    assert fastpath._import_built() is None


RECORD_IN_A_FRESH_PROCESS = """
import sys, torch, tvm_ffi, tvm_ffi.libinfo
from tilelang_ops import fastpath, runtime
e = fastpath.load()
e.register_test_kernel(tvm_ffi.libinfo.find_libtvm_ffi(), "tileops.test_scale_rowsum")
kernel = runtime.recordable(tvm_ffi.get_global_func("tileops.test_scale_rowsum"))
lib = torch.library.Library("tileops_fresh", "DEF")
lib.define("op(Tensor x, float alpha) -> (Tensor, Tensor)")
def impl(x, alpha):
    out, rowsum = torch.empty_like(x), x.new_empty(x.shape[0])
    kernel(x, out, rowsum, alpha)
    return out, rowsum
fastpath.register("tileops_fresh", "op", "CPU", impl)
x = torch.randn(4, 8)
for _ in range(3):
    torch.ops.tileops_fresh.op(x, 2.0)
assert fastpath.stats("op")["hits"] >= 1, fastpath.stats("op")
print("torch._dynamo" in sys.modules)
"""


def test_recording_imports_no_compiler(ext):
    # A key's second call records under a TorchDispatchMode; torch wraps a mode's dispatch in
    # torch._dynamo.disable unless told not to, and importing torch._dynamo there cost a warm
    # process's second call 4 s on the H100 host (benchmarks.compile_time, session 49).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RECORD_IN_A_FRESH_PROCESS], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


def _op(impl, schema="(Tensor x, float alpha) -> (Tensor, Tensor)"):
    """A fresh test op served by `impl` through the C++ path: (op, name)."""
    name = f"op{next(_names)}"
    _lib.define(name + schema)
    fastpath.register(NS, name, "CPU", impl)
    return getattr(getattr(torch.ops, NS), name).default, name


def _scale_impl(kernel):
    def impl(x, alpha):
        out, rowsum = torch.empty_like(x), x.new_empty(x.shape[0])
        kernel(x, out, rowsum, alpha)
        return out, rowsum

    return impl


def _check(x, alpha, out, rowsum):
    torch.testing.assert_close(out, x * alpha)
    torch.testing.assert_close(rowsum, x.sum(-1))


def test_replays_the_recorded_launches_on_each_calls_tensors(kernel):
    op, name = _op(_scale_impl(kernel))
    for _ in range(6):
        x = torch.randn(9, 13)[2:7, 3:10]  # a strided view, at another address each call
        _check(x, 1.5, *op(x, 1.5))
    s = fastpath.stats(name)
    # first call: Python; second: Python, recorded; the rest replayed
    assert (s["calls"], s["hits"], s["keys"], s["plans"]) == (6, 4, 1, 1)


def test_key_covers_scalars_strides_alignment_and_aliasing(kernel):
    scale = _scale_impl(kernel)
    op, name = _op(lambda x, y, alpha: scale(x, alpha), "(Tensor x, Tensor y, float alpha) -> (Tensor, Tensor)")
    base = torch.randn(64, 64)

    def calls(x, y, alpha):
        for _ in range(3):
            _check(x, alpha, *op(x, y, alpha))

    # y is not launched with, but its aliasing is in the key: x is y gets a key of its own
    calls(base[:8, :8], torch.randn(3), 2.0)
    calls(base[:8, :8], torch.randn(3), 3.0)  # another alpha
    calls(base[:8, :8].t(), torch.randn(3), 2.0)  # other strides
    calls(base[:8, 1:9], torch.randn(3), 2.0)  # 4 bytes off 16-byte alignment
    x = base[:8, :8]
    calls(x, x, 2.0)  # y aliases x
    assert fastpath.stats(name)["keys"] == 5 and fastpath.stats(name)["hits"] == 5


def test_scalar_type_arguments_reach_python_as_dtypes(kernel):
    scale = _scale_impl(kernel)
    seen = []
    op, name = _op(lambda x, alpha, dt: seen.append(dt) or scale(x, alpha), "(Tensor x, float alpha, ScalarType? dt) -> (Tensor, Tensor)")
    for dt in (torch.bfloat16, torch.bfloat16, None, torch.float32):
        x = torch.randn(3, 4)
        _check(x, 2.0, *op(x, 2.0, dt))
    assert seen == [torch.bfloat16, torch.bfloat16, None, torch.float32]


def test_keys_per_op_are_bounded(kernel):
    # a process seeing ever new shapes keeps at most 4096 keys an op; the rest run on Python
    op, name = _op(_scale_impl(kernel))
    x = torch.randn(2, 3)
    for i in range(4100):
        op(x, float(i))
    for _ in range(3):
        _check(x, -1.0, *op(x, -1.0))
    s = fastpath.stats(name)
    assert s["keys"] == 4096 and s["hits"] == 0 and s["calls"] == 4103


@pytest.mark.slow
def test_concurrent_first_imports_build_once(tmp_path):
    # four processes importing at once on a machine without the built module: one builds, the
    # others wait for it; all load it, and the stamp is whole
    import subprocess
    import sys

    code = "from tilelang_ops import fastpath; assert fastpath.load() is not None, fastpath.load_error()"
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE) for _ in range(4)]
    errors = [p.communicate(timeout=600)[1].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    (d,) = (tmp_path / "ext").iterdir()
    assert (d / "tileops_fastpath.stamp").read_text() == fastpath._stamp()


def test_outputs_as_views_of_one_allocation(kernel):
    def impl(x, alpha):
        buf = x.new_empty(x.shape[0], x.shape[1] + 1)
        out, rowsum = buf[:, 1:], buf[:, 0]
        kernel(x, out, rowsum, alpha)
        return out, rowsum

    op, name = _op(impl)
    for _ in range(4):
        x = torch.randn(5, 7)
        out, rowsum = op(x, 0.5)
        _check(x, 0.5, out, rowsum)
        assert out.untyped_storage().data_ptr() == rowsum.untyped_storage().data_ptr()
        assert out.stride() == (8, 1) and rowsum.stride() == (8,)
    assert fastpath.stats(name)["hits"] == 2


def test_a_tensor_the_op_keeps_is_passed_as_it_is(kernel):
    kept = {}

    def impl(x, alpha):  # the kernel reads a tensor cached across calls (as a tile counter is)
        if "w" not in kept:
            kept["w"] = torch.randn(x.shape)
        w = kept["w"]
        out, rowsum = torch.empty_like(x), x.new_empty(x.shape[0])
        kernel(w, out, rowsum, alpha)
        return out, rowsum

    op, name = _op(impl)
    for i in range(4):
        x = torch.randn(3, 4)
        kept.get("w", torch.empty(0)).mul_(2)  # new contents, same tensor
        out, rowsum = op(x, 1.0)
        _check(kept["w"], 1.0, out, rowsum)
    assert fastpath.stats(name)["hits"] == 2


def test_a_call_doing_other_aten_work_stays_on_the_python_path(kernel):
    def impl(x, alpha):
        x = x.contiguous() if not x.is_contiguous() else x.clone()  # a copy: not replayable
        out, rowsum = torch.empty_like(x), x.new_empty(x.shape[0])
        kernel(x, out, rowsum, alpha)
        return out, rowsum

    op, name = _op(impl)
    for _ in range(6):
        x = torch.randn(4, 6)
        _check(x, 2.0, *op(x, 2.0))
    s = fastpath.stats(name)
    assert (s["hits"], s["plans"], s["python_only"]) == (0, 0, 1)


def test_errors_raise_from_python_with_their_type(kernel):
    def impl(x, alpha):
        if x.shape[-1] > 8:
            raise ValueError(f"x: last dim {x.shape[-1]} > 8")
        return _scale_impl(kernel)(x, alpha)

    op, name = _op(impl)
    for _ in range(4):
        with pytest.raises(ValueError, match="x: last dim 9 > 8"):
            op(torch.randn(2, 9), 1.0)
    x = torch.randn(2, 8)
    for _ in range(3):
        _check(x, 1.0, *op(x, 1.0))
    assert fastpath.stats(name)["plans"] == 1


def test_invalidate_makes_every_key_decide_again(kernel):
    scale = {"by": 1.0}

    def impl(x, alpha):
        return _scale_impl(kernel)(x, alpha * scale["by"])

    op, name = _op(impl)
    x = torch.randn(3, 3)
    for _ in range(3):
        _check(x, 1.0, *op(x, 1.0))
    scale["by"] = 3.0  # what the implementation decides from changed: plans are stale
    fastpath.invalidate()
    _check(x, 3.0, *op(x, 1.0))
    assert fastpath.stats(name)["keys"] == 1 and fastpath.stats(name)["plans"] == 0


def _grad_op(kernel):
    """A test op with an autograd formula, registered as _library registers one: the Python path
    (a torch.autograd.Function whose forward calls setup_context under the recorder's eye) until a
    key's setup is recorded, then the C++ Function. out = alpha * x is differentiable, rowsum is
    marked non-differentiable; setup saves x and out (unused, to test saving) and alpha."""
    impl = _scale_impl(kernel)
    op, name = _op(impl)
    calls = {"python": 0, "backward": 0}

    def setup(ctx, inputs, output):
        x, alpha = inputs
        ctx.save_for_backward(x, output[0], None)
        ctx.alpha = alpha
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, g_out, g_rowsum):
        calls["backward"] += 1
        x, out, none = ctx.saved_tensors
        assert none is None and g_rowsum is None and ctx.needs_input_grad == (True, False)
        torch.testing.assert_close(out, x * ctx.alpha)
        return g_out * ctx.alpha, None

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, alpha):
            calls["python"] += 1
            ctx.set_materialize_grads(False)  # as _library's forward
            out = impl(x, alpha)
            rec = fastpath.setup_recorder
            setup(ctx if rec is None else rec.wrap(ctx, (x, alpha), out), (x, alpha), out)
            return out

        @staticmethod
        def backward(ctx, g_out, g_rowsum):
            return backward(ctx, g_out, g_rowsum)

    fastpath.register_autograd(NS, name, lambda keyset, args: F.apply(*args), backward)
    return op, name, calls


def test_autograd_replays_the_recorded_setup_in_cpp(kernel):
    op, name, calls = _grad_op(kernel)
    for i in range(5):
        x = torch.randn(4, 5, requires_grad=True)
        out, rowsum = op(x, 2.0)
        assert out.requires_grad and not rowsum.requires_grad
        _check(x.detach(), 2.0, out.detach(), rowsum)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        torch.testing.assert_close(x.grad, w * 2.0)
    s = fastpath.grad_stats(name)
    assert (s["calls"], s["hits"], s["specs"]) == (5, 3, 1)
    assert calls == {"python": 2, "backward": 5}  # the C++ Function ran the last three forwards
    with torch.no_grad():  # no gradient to record: the backend kernel, no formula
        for _ in range(3):
            _check(x.detach(), 2.0, *op(x, 2.0))
    assert fastpath.grad_stats(name)["calls"] == 5


def test_autograd_with_a_none_tensor_argument(kernel):
    # a Tensor? argument given None is not an input of the C++ Function (it has no device)
    scale = _scale_impl(kernel)
    op, name = _op(lambda x, y, alpha: scale(x, alpha), "(Tensor x, Tensor? y, float alpha) -> (Tensor, Tensor)")

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, alpha):
            ctx.set_materialize_grads(False)
            out = scale(x, alpha)
            rec = fastpath.setup_recorder
            c = ctx if rec is None else rec.wrap(ctx, (x, y, alpha), out)
            c.alpha = alpha
            c.mark_non_differentiable(out[1])
            return out

        @staticmethod
        def backward(ctx, g_out, g_rowsum):
            assert ctx.needs_input_grad[1] is False and ctx.needs_input_grad[2] is False
            return g_out * ctx.alpha, None, None

    fastpath.register_autograd(NS, name, lambda keyset, args: F.apply(*args), F.backward)
    for _ in range(4):
        x = torch.randn(3, 4, requires_grad=True)
        op(x, None, 2.0)[0].sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert fastpath.grad_stats(name)["hits"] == 2


def test_fake_tensors_take_the_python_path(kernel):
    # torch.compile traces with fake tensors (their data pointer raises): never keyed
    from torch._subclasses.fake_tensor import FakeTensorMode

    scale = _scale_impl(kernel)
    op, name = _op(scale)
    torch.library.register_fake(f"{NS}::{name}", lambda x, alpha: (torch.empty_like(x), x.new_empty(x.shape[0])), lib=_lib)

    def with_grad(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    fastpath.register_autograd(NS, name, with_grad, None, has_setup=False)
    with FakeTensorMode():
        for _ in range(3):
            x = torch.randn(5, 6, requires_grad=True)
            out, rowsum = op(x, 2.0)
            assert out.shape == (5, 6) and rowsum.shape == (5,)
    assert fastpath.grad_stats(name)["calls"] == 0 and fastpath.stats(name)["calls"] == 0


def test_autograd_setup_saving_a_derived_tensor_stays_on_the_python_path(kernel):
    op, name, calls = _grad_op(kernel)

    def setup(ctx, inputs, output):
        rec = fastpath.setup_recorder
        ctx = ctx if rec is None else rec.wrap(ctx, inputs, output)
        ctx.save_for_backward(inputs[0] * 1, output[0], None)  # not an input or an output

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, alpha):
            out = _scale_impl(kernel)(x, alpha)
            setup(ctx, (x, alpha), out)
            ctx.alpha = alpha
            return out

        @staticmethod
        def backward(ctx, g_out, g_rowsum):
            return g_out * ctx.alpha, None

    op2, name2 = _op(_scale_impl(kernel))
    fastpath.register_autograd(NS, name2, lambda keyset, args: F.apply(*args), None)
    for _ in range(5):
        x = torch.randn(3, 3, requires_grad=True)
        op2(x, 3.0)[0].sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    s = fastpath.grad_stats(name2)
    assert (s["hits"], s["specs"], s["python_only"]) == (0, 0, 1)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_cuda
def test_the_path_is_on_for_the_ops():
    from tilelang_ops import _library

    assert _library._fast(), f"the C++ call path is off on this GPU host: {fastpath.load_error()}"


def _all_stats():
    return {n: fastpath.stats(n) for n in fastpath._indices}


def _five_calls(case, device: torch.device, after_call=lambda: None) -> None:
    """Five calls of the op on fresh inputs on `device`, every result against the float64
    reference (the first two run the Python implementation, the last three replay its plan);
    `after_call()` right after each call."""
    shape = case.shapes[min(1, len(case.shapes) - 1)]
    dtype = case.dtypes[-1]
    for _ in range(5):
        inputs = case.make_inputs(shape, dtype, device)
        out = case.op(*inputs)
        after_call()
        ref = case.reference(*inputs)
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        for o, r in zip(outs, refs):
            assert o.device == device
            torch.testing.assert_close(o.double(), r.double(), atol=case.atol[dtype], rtol=case.rtol[dtype])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", __import__("tilelang_ops.ops", fromlist=["ALL_OPS"]).ALL_OPS, ids=lambda c: c.name)
def test_every_op_replays_on_fresh_inputs(case):
    """Five calls, fresh inputs each, every result against the float64 reference: the first two
    run the Python implementation, the last three replay its plan."""
    before = _all_stats()
    _five_calls(case, torch.device("cuda", torch.cuda.current_device()))
    after = _all_stats()
    hits = sum(after[n]["hits"] - before.get(n, {"hits": 0})["hits"] for n in after)
    assert hits >= 3, f"{case.name}: no replayed call ({ {n: after[n] for n in after if after[n] != before.get(n)} })"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one or none here)")
@pytest.mark.parametrize("case", __import__("tilelang_ops.ops", fromlist=["ALL_OPS"]).ALL_OPS, ids=lambda c: c.name)
def test_every_op_on_a_gpu_other_than_the_current_one(case):
    """Inputs on cuda:1 while cuda:0 is current: the launches go to cuda:1 (Python path, then
    replays), results match the reference, and cuda:0 is still current after every call (TileLang's
    host function would leave cuda:1 current; the ops' device guards restore it)."""

    def still_cuda0():
        assert torch.cuda.current_device() == 0, f"{case.name} left cuda:{torch.cuda.current_device()} current"

    with torch.cuda.device(0):
        _five_calls(case, torch.device("cuda", 1), still_cuda0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_training_steps_replay_forward_and_backward(causal):
    """flash_attn, layer_norm and a fused Linear, forward and backward, four steps on fresh
    inputs, each against float32 references: the backward formulas reach the C++ kernels too."""
    ops = torch.ops.tileops
    dev, bf = "cuda", torch.bfloat16
    for _ in range(4):
        q, k, v = (torch.randn(2, 100, 4, 64, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        x = torch.randn(37, 96, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(96, device=dev, dtype=bf, requires_grad=True)
        lw = (torch.randn(64, 96, device=dev, dtype=bf) * 0.1).requires_grad_()
        out = ops.flash_attn(q, k, v, causal)
        y = ops.layer_norm(x, w, None)[0]
        z = ops.linear(y, lw, None, "gelu_tanh")
        g1, g2 = torch.randn_like(out), torch.randn_like(z)
        torch.autograd.backward([out, z], [g1, g2])
        leaves = (q, k, v, x, w, lw)
        ours = [t.grad for t in leaves]
        ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
        rq, rk, rv, rx, rw, rlw = ref_leaves
        rout = torch.nn.functional.scaled_dot_product_attention(rq.transpose(1, 2), rk.transpose(1, 2), rv.transpose(1, 2), is_causal=causal).transpose(1, 2)
        ry = torch.nn.functional.layer_norm(rx, (96,), rw, None)
        rz = torch.nn.functional.gelu(ry.to(bf).float() @ rlw.t(), approximate="tanh")
        torch.autograd.backward([rout, rz], [g1.float(), g2.float()])
        assert rel_err(out, rout) < 1e-2 and rel_err(z, rz) < 2e-2
        for t, r in zip(ours, ref_leaves):
            assert rel_err(t, r.grad) < 2e-2
    stats = _all_stats()
    for n in ("flash_attn_backward", "layer_norm_backward"):
        assert stats[n]["hits"] >= 1, (n, stats[n])


@pytest.mark.gpu
@requires_cuda
def test_a_side_stream_gets_its_own_plan():
    x = torch.randn(8, 4097, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(4):
            y = torch.ops.tileops.softmax(x, -1)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=2e-3, rtol=2e-2)
    for _ in range(4):
        y = torch.ops.tileops.softmax(x, -1)
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=2e-3, rtol=2e-2)
    assert fastpath.stats("softmax")["keys"] >= 2
