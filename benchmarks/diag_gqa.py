"""Why the attention forward runs slower on GQA than on MHA (same kernel, same FLOPs; H200, sixteenth
and seventeenth sessions: 610 against 653 TFLOP/s at 8 x 32 x 4096 x 128): the K/V layout (a
2 KB row stride with 8 kv heads against 8 KB with 32) or the sharing (4 query heads' CTAs reading
one kv head's blocks at once).

    python -m benchmarks.diag_gqa      # H200: TFLOP/s table, JSON under $OUT

Rows, one kernel config per head dim and causality (the op's default), same q:
  mha          32 kv heads
  gqa          8 kv heads, contiguous (B, S, 8, D)
  gqa_strided  8 kv heads, every fourth head of a (B, S, 32, D) tensor (MHA's 8 KB row stride)
Forward and backward (the op's fused backward), TFLOP/s at 4 B H S^2 D (halved when causal).
"""
from __future__ import annotations

import torch

from ._timing import bench, interleaved, table, write_json

B, H, S, D = 8, 32, 4096, 128


def _cases():
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(B, S, H, D, device=dev, dtype=bf)
    k32, v32 = (torch.randn(B, S, H, D, device=dev, dtype=bf) for _ in range(2))
    k8, v8 = (t[:, :, :8].contiguous() for t in (k32, v32))
    ks, vs = k32[:, :, ::4], v32[:, :, ::4]
    yield "mha", q, k32, v32
    yield "gqa", q, k8, v8
    yield "gqa_strided", q, ks, vs


def main() -> None:
    rows = []
    for causal in (False, True):
        fwd, bwd, names = [], [], []
        for name, q, k, v in _cases():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = torch.ops.tileops.flash_attn(qg, kg, vg, causal)
            dout = torch.randn_like(out)
            fwd.append(lambda q=q, k=k, v=v: torch.ops.tileops.flash_attn(q, k, v, causal))
            bwd.append(lambda out=out, qg=qg, kg=kg, vg=vg, dout=dout: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
            names.append(name)
        flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
        tf = interleaved(lambda f: bench(f, warmup=5, rep=30), fwd)
        tb = interleaved(lambda f: bench(f, warmup=5, rep=30), bwd)
        for name, a, b in zip(names, tf, tb):
            rows.append(dict(case=name, causal=causal, fwd_ms=a, fwd_tflops=flops / a / 1e9, bwd_ms=b, bwd_tflops=2.5 * flops / b / 1e9))
    write_json("diag_gqa", rows)
    print(table(rows, ["case", "causal", "fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops"]))


if __name__ == "__main__":
    main()
