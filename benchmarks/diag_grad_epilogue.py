"""What the act'-fused GEMM's epilogue costs (`tileops.gemm_act_grad`, an MLP's hidden gradient),
variant by variant, side by side with the plain GEMM of the same shape and schedule.

    python -m benchmarks.diag_grad_epilogue [--rounds N]    # on the GPU
    python -m benchmarks.diag_grad_epilogue --warm          # here: compile what it loads (sm_90a)

Why: in session 63 the fused kernel ran 0.166 ms (~6 us per 128x256 CTA on an H100) longer than
the plain GEMM at the MLP shape, which ate most of what removing `act_grad`'s pass saved. Its
epilogue does two things the plain one does not: it reads Z's tile, and it sums C's columns for
the bias gradient. The variants (`kernels.gemm.GRAD_EPILOGUE`) take these apart:
- `prefetch`: Z's tile is loaded into registers (C's fragment layout) before the main loop, so
  the loads are in flight under the k-loop, instead of into C's shared tile after it;
- `serial`: each thread sums one column of the stored tile (no cross-thread reduction), instead
  of 32-row partials reduced across warps eight times.
Contenders in turns (`_timing.named_in_turns`), each the kernel's launcher into preallocated
buffers: `plain` (C = A @ B, no epilogue work), `act_grad` (plain + the separate elementwise
pass, what two `Linear` modules run) and the four fused variants. Every fused variant's C must
equal the first's bitwise and its bias gradient agree to 1e-3. Writes $OUT/diag_grad_epilogue.json
and prints a table last.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from ._timing import first_run, named_in_turns, table, write_json

SHAPES = [(8192, 14336, 4096)]  # (M, N, K): the #3 MLP's dH = dY @ W2 (8192 tokens, d=4096, hidden=14336)
ACT = "gelu_tanh"
VARIANTS = {f"fused p{int(p)} s{int(s)}": dict(prefetch=p, serial=s) for p, s in itertools.product((False, True), repeat=2)}


def _compile(n, k, grad_act, exp=None):
    from tilelang_ops import runtime
    from tilelang_ops.kernels import gemm as K

    cfg = K._HOPPER_LARGE
    static = dict(layout="nn", n=n, k=k, dtype="bfloat16", grad_act=grad_act)
    saved = dict(K.GRAD_EPILOGUE)
    K.GRAD_EPILOGUE.update(exp or {})
    try:  # past KernelDef.compile's per-process cache, whose key does not see GRAD_EPILOGUE
        func = K.matmul_kernel.build(cfg, **static)
        return runtime._tilelang().compile(func, target={"kind": "cuda", "arch": "sm_90a"},
                                           pass_configs=K.matmul_kernel.pass_configs_for(cfg, **static) or None)
    finally:
        K.GRAD_EPILOGUE.clear()
        K.GRAD_EPILOGUE.update(saved)


def kernels(n, k) -> dict:
    out = {"plain": _compile(n, k, "none")}
    for name, exp in VARIANTS.items():
        out[name] = _compile(n, k, ACT, exp)
    return out


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
        mb = -(-M // 128)
        plain = runtime.launcher(ks["plain"])
        c0 = torch.empty(M, N, device=dev, dtype=dt)
        fns = {"plain": lambda: plain(a, b, c0)}
        fns["act_grad"] = lambda: (plain(a, b, c0), torch.ops.tileops.act_grad(c0, z, ACT, True))
        outs = {}
        for name in VARIANTS:
            launch = runtime.launcher(ks[name])
            c = torch.full((M, N), float("nan"), device=dev, dtype=dt)
            part = torch.full((mb, N), float("nan"), device=dev)
            db = torch.full((N,), float("nan"), device=dev, dtype=dt)
            first_run(lambda launch=launch, c=c, part=part, db=db: launch(a, b, z, c, part, db), f"{name} {M}x{N}x{Kd}")
            outs[name] = (c, db)
            fns[name] = lambda launch=launch, c=c, part=part, db=db: launch(a, b, z, c, part, db)
        plain(a, b, c0)
        ref_c, ref_db = torch.ops.tileops.act_grad(c0, z, ACT, True)
        first = next(iter(VARIANTS))
        for name, (c, db) in outs.items():
            if not torch.equal(c, outs[first][0]):
                raise SystemExit(f"{name}: C differs from {first}'s")
            err = ((c.float() - ref_c.float()).norm() / ref_c.float().norm()).item()  # act_grad rounds dy first
            if not err <= 1e-2:
                raise SystemExit(f"{name}: C off act_grad's by {err}")
            err = ((db.float() - ref_db.float()).norm() / ref_db.float().norm()).item()
            if not err <= 1e-2:
                raise SystemExit(f"{name}: bias gradient off by {err}")
        flops = 2.0 * M * N * Kd
        t = named_in_turns(fns, args.rounds)
        rows = [dict(shape=f"{M}x{N}x{Kd}", impl=name, ms=ms, tflops=flops / ms / 1e9, vs_plain=t["plain"][0] / ms,
                     extra_ms=ms - t["plain"][0], rounds_ms=r) for name, (ms, r) in t.items()]
        write_json("diag_grad_epilogue", rows)
        print(table(rows, ["shape", "impl", "ms", "tflops", "vs_plain", "extra_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
