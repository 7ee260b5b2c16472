"""Host µs of `flash_attn_backward` with its fp32 scratch (the dQ accumulator, Delta, lse2) as one
allocation (the op since the twenty-third session) against three (the former `_bwd_fused`),
timed in alternating rounds in one process so that host drift hits both alike.

    python -m benchmarks.diag_bwd_alloc [--rounds 7]     # on a CUDA machine
"""
from __future__ import annotations

import argparse
import statistics

import torch

import tilelang_ops  # noqa: F401
from benchmarks._timing import host_us, write_json
from tilelang_ops.ops import attention


def _three_allocations(name, dout, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv) -> None:
    """The former `_bwd_fused`: one allocation per scratch buffer."""
    B, Sq, H, D = q.shape
    dev = q.device
    delta = torch.empty(B, H, attention.lse_rows(Sq), dtype=torch.float32, device=dev)
    lse2 = torch.empty(B, H, attention.lse_rows(Sq), dtype=torch.float32, device=dev)
    dq_acc = torch.empty(B, Sq, H, D, dtype=torch.float32, device=dev)
    attention._kernel(name, q.dtype, q.device, D, causal, H // k.shape[2], softmax_scale)(q, k, v, out, dout, lse, delta, lse2, dq_acc, dq, dk, dv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    q = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)  # overhead.py's shape
    out, lse = torch.ops.tileops.flash_attn_with_lse(q, q, q)
    dout = torch.randn_like(q)
    call = lambda: torch.ops.tileops.flash_attn_backward(dout, q, q, q, out, lse)  # noqa: E731
    one = attention._bwd_fused
    ref = call()
    variants = {"one allocation": one, "three allocations": _three_allocations}
    times = {name: [] for name in variants}
    for r in range(a.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            attention._bwd_fused = variants[name]
            times[name].append(host_us(call, n=1000, warmup=100))
    attention._bwd_fused = one
    same = all(torch.equal(x, y) or torch.allclose(x, y, atol=2e-2) for x, y in zip(ref, call()))
    rows = [dict(variant=name, median_us=statistics.median(t), rounds=t) for name, t in times.items()]
    for row in rows:
        print(f"{row['variant']:18s} {row['median_us']:6.1f} µs  (rounds: {', '.join(f'{x:.1f}' for x in row['rounds'])})")
    print(f"outputs agree: {same}")
    write_json("diag_bwd_alloc", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
