"""The one-kernel ("single") variants of the column-sum backward kernels against their two-kernel
form (per-CTA fp32 partials, then a fold kernel): GPU µs of each (CUDA graph replays, host taken
out) and host µs of each launch, over row counts around the op's threshold.

    python -m benchmarks.diag_single_pass          # on a CUDA machine
    python -m benchmarks.diag_single_pass --warm   # compile its kernels (sm_90a) here, no GPU

Ops: act_grad with the bias gradient (single up to gemm.ACT_GRAD_SINGLE_ROWS rows), bias_grad
(single up to one CTA's block_M * steps rows), layer_norm_backward (single up to
norm.SINGLE_STEPS row steps). The single variant saves a launch (~4.5 µs of host time) and the
partials' allocation; it runs on fewer CTAs, so past a few row blocks its GPU time grows: the
thresholds sit where it is still shorter than the host path it saves. Writes $OUT/single_pass.json.
"""
from __future__ import annotations

import sys

import torch

from benchmarks._timing import graph_ms, host_us, table, write_json
from tilelang_ops.ops import gemm as G
from tilelang_ops.ops import norm as N

BF = torch.bfloat16


def _act_grad(m, n):
    dy, z = torch.randn(m, n, device="cuda", dtype=BF), torch.randn(m, n, device="cuda", dtype=BF)
    dz, db = torch.empty_like(dy), torch.empty(n, device="cuda", dtype=BF)
    two, bm = G._act_grad_kernel(dy.device, n, BF, "gelu_tanh", True)
    one = G._act_grad_kernel(dy.device, n, BF, "gelu_tanh", True, True)[0]
    part = torch.empty(-(-m // bm), n, device="cuda")
    return (lambda: one(dy, z, dz, db)), (lambda: two(dy, z, dz, part, db)), m <= G.ACT_GRAD_SINGLE_ROWS


def _bias_grad(m, n):
    dy, db = torch.randn(m, n, device="cuda", dtype=BF), torch.empty(n, device="cuda", dtype=BF)
    two, rows = G._bias_grad_kernel(dy.device, n, BF)
    one = G._bias_grad_kernel(dy.device, n, BF, True)[0]
    part = torch.empty(-(-m // rows), n, device="cuda")
    return (lambda: one(dy, db)), (lambda: two(dy, part, db)), m <= rows


def _ln_bwd(m, n):
    x, dy = torch.randn(m, n, device="cuda", dtype=BF), torch.randn(m, n, device="cuda", dtype=BF)
    w = torch.randn(n, device="cuda", dtype=BF)
    _, mean, rstd = torch.ops.tileops.layer_norm(x, w, w)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)
    two, ctas, bm = N._bwd_kernel(n, BF, BF, BF, x.device)
    one = N._bwd_kernel(n, BF, BF, BF, x.device, single=True)[0]
    part = torch.empty(2, N.bwd_grid(m, ctas, bm), n, device="cuda")
    return (lambda: one(dy, x, w, mean, rstd, dx, dw, db)), (lambda: two(dy, x, w, mean, rstd, dx, part, dw, db)), m <= N.SINGLE_STEPS * bm


CASES = [
    ("act_grad", _act_grad, [(8, 1024), (64, 4096), (128, 4096), (256, 4096), (1024, 4096)]),
    ("bias_grad", _bias_grad, [(8, 1024), (128, 4096), (512, 4096), (2048, 4096)]),
    ("layer_norm_backward", _ln_bwd, [(8, 1024), (16, 1024), (8, 4096), (32, 4096), (256, 4096)]),
]


def warm() -> int:
    """Compile (not run) every kernel main() launches, through the ops' own kernel getters."""
    from benchmarks.host_standin import install_standin

    install_standin(compile_kernels=True)
    dev = torch.device("cuda", 0)
    for n in sorted({n for _, _, shapes in CASES for _, n in shapes}):
        for single in (False, True):
            G._act_grad_kernel(dev, n, BF, "gelu_tanh", True, single)
            G._bias_grad_kernel(dev, n, BF, single)
            N._bwd_kernel(n, BF, BF, BF, dev, single=single)
        N._fwd_kernel(n, BF, BF, BF, 1e-5, dev)
    print("diag_single_pass: kernels compiled")
    return 0


def main() -> int:
    if "--warm" in sys.argv[1:]:
        return warm()
    rows = []
    for op, make, shapes in CASES:
        for m, n in shapes:
            one, two, chosen = make(m, n)
            one(), two()
            torch.cuda.synchronize()
            rows.append({
                "op": op, "m": m, "n": n, "op_takes": "single" if chosen else "partials",
                "single_gpu_us": graph_ms(one, n=20) * 1e3, "partials_gpu_us": graph_ms(two, n=20) * 1e3,
                "single_host_us": host_us(one, n=1000), "partials_host_us": host_us(two, n=1000),
            })
            print(rows[-1], flush=True)
    write_json("single_pass", rows)
    print(table(rows, ["op", "m", "n", "op_takes", "single_gpu_us", "partials_gpu_us", "single_host_us", "partials_host_us"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
