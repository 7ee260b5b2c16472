"""Host cost of the ops' Python paths on a machine without a GPU: the CUDA implementations run on
CPU tensors with kernel launches replaced by no-ops ("stand-in"), inside a real training step.

    python -m benchmarks.host_standin [--steps 20] [--profile]
    python -m benchmarks.host_standin --warm-check   # compile what `tileops check` loads, no GPU
    python -m benchmarks.host_standin --floor        # ops' Python paths beside what Python itself costs

Builds examples/train_gpt.py's GPT at full depth and width (12 layers, d=768) with a tiny batch
(d=128, 1 x 32 tokens, so the CPU's own math is small; same op count per step), routes every tileops op's CPU dispatch to its
CUDA implementation (allocations, checks, views, kernel lookup: everything but the GPU work), and
times the step in the `torch` and `tileops` modes (`--ln` and `--linears` torch and ours). The difference is
the Python path our ops add per step, the quantity that makes eager training host-bound on an
H200 (benchmarks.profile_train --host). Outputs are garbage (no kernel runs): only times count.
--profile prints a cProfile of the tileops step by own time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tilelang_ops  # noqa: F401  (registers every op)
from tilelang_ops import _library, runtime, tuning
from tilelang_ops.ops import attention as attention_ops
from tilelang_ops.runtime import KernelDef


def install_standin(compile_kernels: bool = False) -> None:
    """Every tileops op's CPU kernel becomes its CUDA implementation with no-op launches.
    compile_kernels: the kernels are still compiled (sm_90a, into $TILELANG_CACHE_DIR), only not
    launched: `--warm-check` uses this to fill the cache with what `tileops check` loads."""
    runtime.arch_for_device = lambda device: "sm_90a"
    runtime.sm_count = lambda device: 132
    # a dynamic walk's tile counter lives on a CUDA device; the launch is a no-op anyway
    attention_ops._with_tile_counter = lambda launch, config, device: launch
    runtime.launcher = lambda compiled: (lambda *args: None)
    if not compile_kernels:
        KernelDef.compile = lambda self, config, arch, **static: None  # no compile; the launcher is a no-op
    tuning.resolve_config = lambda tunable, shape, dtype, device: tunable.default(shape, dtype)

    # Ops with an autograd formula call impls[backend] directly for plain tensors
    # (_library._no_grad_path); the others (the backward ops) reach the dispatcher's CPU kernel.
    cpu, cuda = torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA
    for obj in _library.OPS:
        impl = obj.impls.get(cuda)
        if impl is not None:
            obj.impls[cpu] = impl
            _library._LIB.impl(obj.name, impl, "CPU")


def _step_fn(tg, mode: str, ln: str, linears: str = "cublas"):
    # 12 layers as in the real model (the op count per step is what matters), narrow and short
    # so that the CPU's own math stays small; no optimizer step (the same in every mode).
    args = tg.parse_args(["--mode", mode, "--device", "cpu", "--batch", "1", "--seq", "32", "--dim", "128", "--heads", "2", "--ln", ln, "--linears", linears])
    model, step_fn = tg.build(args, mode)
    x = torch.randint(0, 256, (1, 32))
    y = torch.randint(0, 256, (1, 32))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def time_step(step, steps: int) -> float:
    for _ in range(3):
        step()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class _Noop(torch.autograd.Function):
    """The least a Python autograd formula costs: one input, one fresh output, nothing saved."""

    @staticmethod
    def forward(ctx, a):
        return a.new_empty(a.shape)

    @staticmethod
    def backward(ctx, g):
        return g


class _LikeAttention(torch.autograd.Function):
    """flash_attn_with_lse's autograd shape with no work: three inputs, two fresh outputs, five
    tensors saved."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return dout, None, None


def floor() -> None:
    """µs per call, on this CPU: ops through the stand-in (everything but the GPU work) next to
    what Python and the dispatcher cost with no work at all (the C `_FunctionBase.apply` our
    grad-recording path calls, and a Library op whose kernel returns at once). Where an op is
    close to its floor, only a C++ path cuts further."""
    lib = torch.library.Library("tileops_floor", "FRAGMENT")
    lib.define("noop(Tensor a) -> Tensor")
    lib.impl("noop", lambda a: a, "CPU")
    lib.impl("noop", lambda keyset, a: a, "Autograd", with_keyset=True)  # as ours: a Python Autograd kernel
    install_standin()
    bf = torch.bfloat16
    q = torch.randn(1, 128, 8, 128, dtype=bf)
    qr = q.clone().requires_grad_()
    x = torch.randn(8, 1024, dtype=bf)
    a = torch.randn(1024, dtype=bf)
    noop_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Noop)
    attn_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LikeAttention)
    ops = torch.ops.tileops
    rows = [
        ("torch.add (CPU, 1024 elements)", lambda: torch.add(a, a)),
        ("Library op, Python Autograd kernel returning its input", lambda: torch.ops.tileops_floor.noop(x)),
        ("x.new_empty(m, n)", lambda: x.new_empty(8, 1024)),
        ("autograd.Function: 1 in, 1 out, none saved (C apply)", lambda: noop_apply(qr)),
        ("autograd.Function: 3 in, 2 out, 5 saved (C apply)", lambda: attn_apply(qr, q, q)),
        ("tileops.add (1024 elements)", lambda: ops.add(a, a)),
        ("tileops.flash_attn", lambda: ops.flash_attn(q, q, q)),
        ("tileops.flash_attn_with_lse", lambda: ops.flash_attn_with_lse(q, q, q)),
        ("tileops.flash_attn, grad-recording", lambda: ops.flash_attn(qr, q, q)),
    ]
    from benchmarks._timing import host_us

    for name, fn in rows:
        print(f"{name:55s} {host_us(fn):6.2f} µs")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--warm-check", action="store_true", help="compile (sm_90a) every kernel `tileops check` loads on a GPU, then exit")
    p.add_argument("--warm-overhead", action="store_true", help="compile (sm_90a) every kernel benchmarks.overhead and diag_backward_host load, then exit")
    p.add_argument("--floor", action="store_true", help="the ops' Python paths beside bare dispatch and autograd.Function costs, then exit")
    a = p.parse_args(argv)
    if a.floor:
        return floor()
    if a.warm_overhead:
        from benchmarks import diag_backward_host, overhead

        install_standin(compile_kernels=True)
        for _, op, args, _ in overhead.cases("cpu"):
            op.op(*(args() if callable(args) else args))
        for _, ours, _ in diag_backward_host.cases("cpu"):
            ours()
        print(f"{runtime.compiled_count()} kernels loaded or compiled")
        return
    if a.warm_check:
        from tilelang_ops.ops import ALL_OPS

        install_standin(compile_kernels=True)
        calls = [(case, shape, dt) for case in ALL_OPS for dt in case.dtypes for shape in case.shapes]
        for case, shape, dt in calls:
            case.op(*case.make_inputs(shape, dt, torch.device("cpu")))
        print(f"{len(calls)} check calls: {runtime.compiled_count()} kernels loaded or compiled")
        return
    from benchmarks.profile_train import _train_gpt

    tg = _train_gpt()
    torch.manual_seed(0)
    ref = {("torch", "torch", "torch"): time_step(_step_fn(tg, "torch", "torch"), a.steps)}
    install_standin()
    for ln, linears in (("torch", "torch"), ("tileops", "torch"), ("tileops", "cublas")):
        ref[("tileops", ln, linears)] = time_step(_step_fn(tg, "tileops", ln, linears), a.steps)
    for (mode, ln, linears), ms in ref.items():
        print(f"{mode:8s} ln={ln:8s} linears={linears:7s} {ms:7.2f} ms per step (host, CPU stand-in)")
    if a.profile:
        import cProfile
        import pstats

        step = _step_fn(tg, "tileops", "tileops")
        time_step(step, 2)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
