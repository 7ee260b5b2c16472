"""The one-kernel ("single") variants of the column-sum backward kernels against their two-kernel
form (per-CTA fp32 partials, then a fold kernel), and the one-kernel attention backward for one key
block (flash_bwd_small) against the three-kernel fused one (preprocess, main, dQ cast, with their
fp32 scratch): GPU µs of each (CUDA graph replays, host taken out) and host µs of each launch,
over sizes around the op's threshold.

    python -m benchmarks.diag_single_pass          # on a CUDA machine
    python -m benchmarks.diag_single_pass --warm   # compile its kernels (sm_90a) here, no GPU

Ops: act_grad with the bias gradient (single up to gemm.ACT_GRAD_SINGLE_ROWS rows), bias_grad
(single up to one CTA's block_M * steps rows), layer_norm_backward (single up to
norm.SINGLE_STEPS row steps), flash_attn_backward (single for small problems: ops.attention.
_small_bwd; its rows also give the largest relative difference of dq, dk, dv between the two forms). The single form
saves a launch (~4.5 µs of host time) and an allocation; a column-sum one runs on fewer CTAs, so
past a few row blocks its GPU time grows: the thresholds sit where it is still about as fast.
Writes $OUT/single_pass.json.
"""
from __future__ import annotations

import sys

import torch

from benchmarks._timing import graph_ms, host_us, table, write_json
from tilelang_ops.ops import attention as A
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


def _attn_bwd(b, s, h, hk, d, causal=False):
    q = torch.randn(b, s, h, d, device="cuda", dtype=BF)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=BF) for _ in range(2))
    out, lse = torch.ops.tileops.flash_attn_with_lse(q, k, v, causal)
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    small = A._kernel("bwd_small", BF, q.device, d, causal, h // hk, None)
    one = lambda: small(q, k, v, out, dout, lse, *grads)  # noqa: E731
    two = lambda: A._bwd_fused("bwd_fused", dout, q, k, v, out, lse, causal, None, *grads)  # noqa: E731
    one()
    a = [g.clone() for g in grads]
    two()
    err = max(((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item() for x, y in zip(a, grads))
    return one, two, A._small_bwd(b, s, s, hk, h // hk, d, q.device), err


CASES = [
    ("act_grad", _act_grad, [(8, 1024), (64, 4096), (128, 4096), (256, 4096), (1024, 4096)]),
    ("bias_grad", _bias_grad, [(8, 1024), (128, 4096), (512, 4096), (2048, 4096)]),
    ("layer_norm_backward", _ln_bwd, [(8, 1024), (16, 1024), (8, 4096), (32, 4096), (256, 4096)]),
    # (B, S, H, HK, D[, causal])
    ("flash_attn_backward", _attn_bwd, [(1, 128, 8, 8, 128), (8, 128, 16, 16, 128), (32, 128, 32, 32, 64), (4, 100, 32, 8, 128, True), (16, 64, 16, 16, 64, True)]),
]


def warm() -> int:
    """Compile (not run) every kernel main() launches, through the ops' own kernel getters."""
    from benchmarks.host_standin import install_standin

    install_standin(compile_kernels=True)
    dev = torch.device("cuda", 0)
    for n in sorted({shape[1] for op, _, shapes in CASES[:3] for shape in shapes}):
        for single in (False, True):
            G._act_grad_kernel(dev, n, BF, "gelu_tanh", True, single)
            G._bias_grad_kernel(dev, n, BF, single)
            N._bwd_kernel(n, BF, BF, BF, dev, single=single)
        N._fwd_kernel(n, BF, BF, BF, 1e-5, dev)
    for b, s, h, hk, d, *causal in CASES[3][2]:
        causal = bool(causal and causal[0])
        for name in ("fwd", "bwd_small", "bwd_fused"):  # the op's kernels at length s
            A._kernel(name, BF, dev, d, causal, h // hk, None, A._length_bucket(A._TUNED_AS.get(name), causal, d, s))
    print("diag_single_pass: kernels compiled")
    return 0


def main() -> int:
    if "--warm" in sys.argv[1:]:
        return warm()
    rows = []
    for op, make, shapes in CASES:
        for shape in shapes:
            one, two, chosen, *err = make(*shape)
            one(), two()
            torch.cuda.synchronize()
            rows.append({
                "op": op, "shape": "x".join(map(str, shape)), "op_takes": "single" if chosen else "multi",
                "single_gpu_us": graph_ms(one, n=20) * 1e3, "multi_gpu_us": graph_ms(two, n=20) * 1e3,
                "single_host_us": host_us(one, n=1000), "multi_host_us": host_us(two, n=1000),
                "rel_diff": err[0] if err else None,
            })
            print(rows[-1], flush=True)
    write_json("single_pass", rows)
    print(table(rows, ["op", "shape", "op_takes", "single_gpu_us", "multi_gpu_us", "single_host_us", "multi_host_us", "rel_diff"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
