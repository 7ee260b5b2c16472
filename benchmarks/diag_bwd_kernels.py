"""Where the attention backward's GPU time goes: every kernel of one backward, ours and cuDNN's
(SDPA), by name, at the benchmark's shapes (torch.profiler, ms per backward and share of it).

    python -m benchmarks.diag_bwd_kernels [--case BxH/HKxSxD ...] [--steps 5]     # on a CUDA machine
    python -m benchmarks.diag_bwd_kernels --prep    # the preprocess alone at its configs, GB/s

Ours is three kernels in one host call (preprocess: Delta, lse2, dQ accumulator zeroed; main;
dQ conversion); the first and last are memory-bound passes whose share of the backward says what
folding them into the main kernel could gain. Writes $OUT/diag_bwd_kernels.json, prints a table.
"""
from __future__ import annotations

import argparse

import torch

from ._timing import kernel_ms, table, write_json
from .bench_attention import CASES, _impls, _parse_case


def run(cases, steps: int) -> list[dict]:
    rows = []
    for B, H, HK, S, D in cases:
        for causal in (False, True):
            impls = _impls(B, H, HK, S, D, causal, flex=False, det=False)
            for name in ("tileops", "sdpa_cudnn"):
                make, fwd = impls[name]
                q, k, v = make()
                out = fwd(q, k, v)
                dout = torch.randn_like(out)
                per = kernel_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), steps)
                total = sum(per.values())
                for kname, ms in sorted(per.items(), key=lambda kv: -kv[1]):
                    rows.append({"case": f"{B}x{H}/{HK}x{S}x{D}", "causal": causal, "impl": name, "kernel": kname[:60], "ms": ms, "share": ms / total, "total_ms": total})
                del q, k, v, out, dout
                torch.cuda.empty_cache()
    return rows


def prep(cases) -> list[dict]:
    """The preprocess kernel alone (Delta, lse2, dQ accumulator zeroed) at the former 128-thread
    config and the per-head-dim default, in turns: ms and bytes moved per second."""
    from tilelang_ops import runtime
    from tilelang_ops.kernels import attention as K
    from tilelang_ops.ops.attention import _bwd_scratch

    from ._timing import bench, interleaved

    rows = []
    arch = runtime.arch_for_device(torch.device("cuda", torch.cuda.current_device()))
    for B, H, _, S, D in cases:
        o, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(B, H, S, device="cuda")
        delta, lse2, dq_acc = _bwd_scratch(o, dq_acc=True)  # the op's own scratch layout
        cfgs = list(dict.fromkeys([K.PrepConfig(64, 128), K.prep_config(D), K.PrepConfig(32, 128)]))
        fns = []
        for cfg in cfgs:
            kern = runtime.launcher(K.flash_bwd_prep_kernel.compile(cfg, arch, headdim=D, dtype="bfloat16"))
            fns.append(lambda kern=kern: kern(o, do, lse, delta, lse2, dq_acc))
        times = interleaved(lambda f: bench(f, warmup=10, rep=50), fns)
        moved = 2 * o.numel() * 2 + dq_acc.numel() * 4  # O and dO read, the accumulator written
        for cfg, t in zip(cfgs, times):
            rows.append({"case": f"{B}x{H}x{S}x{D}", "config": f"{cfg.block}x{cfg.threads}", "ms": t, "TB/s": moved / t * 1e-9})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", type=_parse_case)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prep", action="store_true", help="time the preprocess kernel's configs instead")
    a = p.parse_args(argv)
    if a.prep:
        rows = prep(a.case or CASES)
        write_json("diag_bwd_prep", rows)
        print(table(rows, ["case", "config", "ms", "TB/s"]))
        return 0
    rows = run(a.case or CASES, a.steps)
    write_json("diag_bwd_kernels", rows)
    print(table(rows, ["case", "causal", "impl", "kernel", "ms", "share", "total_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
