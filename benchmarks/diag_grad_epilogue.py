"""What the act'-fused GEMM's epilogue costs (`tileops.gemm_act_grad`, an MLP's hidden gradient),
side by side with the plain GEMM of the same shape and schedule and with the unfused pass.

    python -m benchmarks.diag_grad_epilogue [--rounds N]    # on the GPU
    python -m benchmarks.diag_grad_epilogue --warm          # here: compile what it loads (sm_90a)

Why: in session 63 the fused kernel ran 0.166 ms (~6 us per 128x256 CTA on an H100) longer than
the plain GEMM at the MLP shape, which ate most of what removing `act_grad`'s pass saved. Its
epilogue does two things the plain one does not: it reads Z's tile, and it sums C's columns for
the bias gradient. Session 64 timed four forms of it here (call3 of its results, the code of
f832062): Z loaded into registers before the main loop, or into C's shared tile after it (kept);
the column sums one column per thread (kept), or 32-row partials reduced across warps.
Contenders in turns (`_timing.named_in_turns`), each a launcher into preallocated buffers:
`plain` (C = A @ B, no epilogue work), `act_grad` (plain + the separate elementwise pass, what two
`Linear` modules run) and `fused` (the shipped kernel). The fused C must match act_grad's to 1e-2
(act_grad rounds A @ B to bf16 first) and so must its bias gradient. Writes
$OUT/diag_grad_epilogue.json and prints a table last.
"""
from __future__ import annotations

import argparse

import torch

from ._timing import first_run, named_in_turns, table, write_json

SHAPES = [(8192, 14336, 4096)]  # (M, N, K): the #3 MLP's dH = dY @ W2 (8192 tokens, d=4096, hidden=14336)
ACT = "gelu_tanh"


def config():
    """The schedule both kernels compile with (the grad_act default's 128 x 256 T.Pipelined tile);
    its block_M sizes the fused kernel's column-sum partials."""
    from tilelang_ops.kernels import gemm as K

    return K._HOPPER_LARGE


def kernels(n, k) -> dict:
    from tilelang_ops.kernels import gemm as K

    static = dict(layout="nn", n=n, k=k, dtype="bfloat16")
    return {"plain": K.matmul_kernel.compile(config(), "sm_90a", **static),
            "fused": K.matmul_kernel.compile(config(), "sm_90a", **static, grad_act=ACT)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warm", action="store_true", help="compile only (no GPU needed)")
    args = p.parse_args(argv)
    for M, N, Kd in SHAPES:
        ks = kernels(N, Kd)
        if args.warm:
            print(f"warm: {list(ks)} at N={N} K={Kd}", flush=True)
            continue
        from tilelang_ops import runtime

        dev = torch.device("cuda", torch.cuda.current_device())
        dt = torch.bfloat16
        a = torch.randn(M, Kd, device=dev, dtype=dt) / Kd**0.5
        b = torch.randn(Kd, N, device=dev, dtype=dt)
        z = torch.randn(M, N, device=dev, dtype=dt)
        mb = -(-M // config().block_M)  # one partial row per row tile
        plain = runtime.launcher(ks["plain"])
        c0 = torch.empty(M, N, device=dev, dtype=dt)
        fns = {"plain": lambda: plain(a, b, c0)}
        fns["act_grad"] = lambda: (plain(a, b, c0), torch.ops.tileops.act_grad(c0, z, ACT, True))
        fused = runtime.launcher(ks["fused"])
        c = torch.full((M, N), float("nan"), device=dev, dtype=dt)
        part = torch.full((mb, N), float("nan"), device=dev)
        db = torch.full((N,), float("nan"), device=dev, dtype=dt)
        first_run(lambda: fused(a, b, z, c, part, db), f"fused {M}x{N}x{Kd}")
        fns["fused"] = lambda: fused(a, b, z, c, part, db)
        plain(a, b, c0)
        ref_c, ref_db = torch.ops.tileops.act_grad(c0, z, ACT, True)
        for what, got, ref in (("C", c, ref_c), ("bias gradient", db, ref_db)):
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()  # NaN (unwritten) fails too
            if not err <= 1e-2:
                raise SystemExit(f"fused: {what} off act_grad's by {err}")
        flops = 2.0 * M * N * Kd
        t = named_in_turns(fns, args.rounds)
        rows = [dict(shape=f"{M}x{N}x{Kd}", impl=name, ms=ms, tflops=flops / ms / 1e9, vs_plain=t["plain"][0] / ms,
                     extra_ms=ms - t["plain"][0], rounds_ms=r) for name, (ms, r) in t.items()]
        write_json("diag_grad_epilogue", rows)
        print(table(rows, ["shape", "impl", "ms", "tflops", "vs_plain", "extra_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
