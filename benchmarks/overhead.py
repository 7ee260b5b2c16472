"""Host overhead per op: median µs per call on small inputs, ours vs torch, and where it goes.

Small inputs, so the number is the launch path (dispatch, validation, kernel lookup, launch), not
GPU work. Columns:
  op_us      `torch.ops.tileops.X(...)`: the whole path a user pays
  impl_us    the op's CUDA implementation called directly (no dispatcher, no autograd kernel)
  launch_us  the compiled host function(s) alone with the same arguments (tvm_ffi: argument
             checks in C, stream, launch) — the floor without changing TileLang
  torch_us   the PyTorch peer
Forward and backward ops; with autograd recording (`requires_grad` inputs) for the ops that have
an autograd formula. `python -m benchmarks.overhead` on a CUDA machine.
"""
from __future__ import annotations

import os
import sys

if "--python-path" in sys.argv:  # before tilelang_ops registers its ops: the Python path's table
    os.environ["TILEOPS_FASTPATH"] = "0"

import torch
import torch.nn.functional as F

import tilelang_ops  # noqa: F401
from benchmarks._timing import host_us, table, write_json
from tilelang_ops import _library, runtime
from tilelang_ops.ops import attention, elementwise, gemm, norm, softmax

CUDA = torch._C.DispatchKey.CUDA


def cases(dev: str = "cuda"):
    bf = torch.bfloat16
    ops = torch.ops.tileops
    a, b = torch.randn(1024, device=dev, dtype=bf), torch.randn(1024, device=dev, dtype=bf)
    x = torch.randn(8, 1024, device=dev, dtype=bf)
    y = torch.softmax(x.float(), -1).to(bf)
    ly = torch.log_softmax(x.float(), -1).to(bf)
    g = torch.randn_like(x)
    w = torch.randn(1024, 1024, device=dev, dtype=bf)
    bias = torch.randn(1024, device=dev, dtype=bf)
    q = torch.randn(1, 128, 8, 128, device=dev, dtype=bf)
    qt = q.transpose(1, 2)
    _, ln_mean, ln_rstd = ops.layer_norm(x, bias, bias)
    xr = x.detach().clone().requires_grad_()
    qr = q.detach().clone().requires_grad_()
    # (name, custom op, args, torch peer)
    yield "add", elementwise.add, (a, b), lambda: torch.add(a, b)
    yield "softmax", softmax.softmax, (x, -1), lambda: torch.softmax(x, -1)
    yield "softmax_backward", softmax.softmax_backward, (g, y, -1), lambda: torch._softmax_backward_data(g, y, -1, bf)
    yield "log_softmax", softmax.log_softmax, (x, -1), lambda: torch.log_softmax(x, -1)
    yield "log_softmax_backward", softmax.log_softmax_backward, (g, ly, -1), lambda: torch._log_softmax_backward_data(g, ly, -1, bf)
    yield "gemm", gemm.gemm, (x, w), lambda: torch.matmul(x, w)
    yield "gemm_nt", gemm.gemm_nt, (x, w), lambda: torch.matmul(x, w.t())
    yield "gemm_tn", gemm.gemm_tn, (x, g), lambda: torch.matmul(x.t(), g)
    yield "linear", gemm.linear, (x, w, bias, "none"), lambda: F.linear(x, w, bias)
    yield "linear gelu_tanh", gemm.linear, (x, w, bias, "gelu_tanh"), lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")
    yield "linear_preact gelu_tanh", gemm.linear_preact, (x, w, bias, "gelu_tanh"), lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    yield "act_grad gelu_tanh", gemm.act_grad, (g, x, "gelu_tanh", True), lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    yield "bias_grad", gemm.bias_grad, (g,), lambda: g.sum(0)
    yield "flash_attn", attention.flash_attn, (q, q, q), lambda: F.scaled_dot_product_attention(qt, qt, qt)
    yield "flash_attn_with_lse", attention.flash_attn_with_lse, (q, q, q), None
    # (args as a callable: built only when the row runs, so `--only` needs no attention kernel)
    yield "flash_attn_backward", attention.flash_attn_backward, lambda: (g.new_empty(q.shape).normal_(), q, q, q, *ops.flash_attn_with_lse(q, q, q)), None
    qkv = torch.randn(1, 128, 3, 8, 128, device=dev, dtype=bf)
    yield "flash_attn_qkvpacked", attention.flash_attn_qkvpacked, (qkv,), lambda: F.scaled_dot_product_attention(qt, qt, qt)
    yield "flash_attn_qkvpacked_backward", attention.flash_attn_qkvpacked_backward, lambda: (g.new_empty(q.shape).normal_(), qkv, *ops.flash_attn_qkvpacked_with_lse(qkv)), None
    yield "layer_norm", norm.layer_norm, (x, bias, bias), lambda: F.layer_norm(x, (1024,), bias, bias)
    yield "layer_norm_backward", norm.layer_norm_backward, (g, x, bias, ln_mean, ln_rstd), lambda: torch.ops.aten.native_layer_norm_backward(g, x, (1024,), ln_mean, ln_rstd, bias, bias, [True, True, True])
    h, _, h_mean, h_rstd = ops.add_layer_norm(x, g, bias, bias)
    yield "add_layer_norm", norm.add_layer_norm, (x, g, bias, bias), lambda: F.layer_norm(x + g, (1024,), bias, bias)
    yield "add_layer_norm_backward", norm.add_layer_norm_backward, (g, g, h, bias, h_mean, h_rstd, bf), None
    # with autograd recording: the forward a training step pays
    yield "softmax (grad)", softmax.softmax, (xr, -1), lambda: torch.softmax(xr, -1)
    yield "linear (grad)", gemm.linear, (xr, w, bias, "none"), lambda: F.linear(xr, w, bias)
    yield "flash_attn (grad)", attention.flash_attn, (qr, q, q), lambda: F.scaled_dot_product_attention(qr.transpose(1, 2), qt, qt)
    yield "layer_norm (grad)", norm.layer_norm, (xr, bias, bias), lambda: F.layer_norm(xr, (1024,), bias, bias)


class _Recorder:
    """Stands in for runtime.launcher while recording: remembers each launch's function and args."""

    def __init__(self):
        self.calls = []
        self.real = runtime.launcher

    def __call__(self, compiled):
        fn = self.real(compiled)

        def record(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return record


def _clear_op_caches() -> None:
    for cache in (elementwise._kernels, gemm._kernels, softmax._plans, attention._kernels, norm._kernels):
        cache.clear()


def launch_only_us(op, args) -> float:
    """µs of the compiled host functions alone, recorded from one call of the op."""
    rec = _Recorder()
    _clear_op_caches()  # kernels stay compiled in runtime's cache: re-resolving only rewraps them
    runtime.launcher = rec
    try:
        op.python_impls[CUDA](*args)  # the Python implementation: the C++ path would launch without it
        torch.cuda.synchronize()
    finally:
        runtime.launcher = rec.real
        _clear_op_caches()
    calls = rec.calls
    return host_us(lambda: [fn(*a) for fn, a in calls]) if calls else None


def measure(name, op, args, peer) -> dict:
    call = lambda: op.op(*args)  # noqa: E731
    impl = op.python_impls[CUDA]
    r = dict(op=name, op_us=host_us(call), impl_us=host_us(lambda: impl(*args)), launch_us=launch_only_us(op, args))
    r["op_us"] = min(r["op_us"], host_us(call))  # again, after the recording pass re-resolved the kernels
    r["torch_us"] = host_us(peer) if peer else None
    return r


def main(rounds: int = 3, only: list[str] | None = None) -> None:
    # Several interleaved rounds, the minimum of each column's medians: the host's clock and
    # neighbours drift over a run, and one round's first rows measured visibly slower.
    all_cases = [(n, op, args() if callable(args) else args, peer) for n, op, args, peer in cases() if not only or any(o in n for o in only)]
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, op, args, peer in all_cases:
            try:
                op.op(*args)
                torch.cuda.synchronize()
                r = measure(name, op, args, peer)
            except Exception as e:  # report and continue: one broken op must not hide the others
                r = dict(op=name, error=f"{type(e).__name__}: {e}"[:160])
            prev = best.setdefault(name, r)
            for k, v in r.items():
                if isinstance(v, float) and (prev.get(k) is None or v < prev[k]):
                    prev[k] = v
    rows = list(best.values())
    for r in rows:
        if r.get("torch_us") and r.get("op_us"):
            r["ratio"] = r["op_us"] / r["torch_us"]
    fast = _library._fast()
    for r in rows:
        r["path"] = "C++" if fast else "Python"
    # TILEOPS_FASTPATH=0 gives the Python path's table, in its own file
    write_json("overhead" if fast else "overhead_python", rows, {"rounds": rounds, "cpp_path": fast})
    print(table(rows, ["op", "path", "op_us", "impl_us", "launch_us", "torch_us", "ratio", "error"]))


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="+", help="only the rows whose name contains one of these (e.g. layer_norm)")
    p.add_argument("--python-path", action="store_true", help="every op on its Python path (TILEOPS_FASTPATH=0)")
    main(only=p.parse_args().only)
