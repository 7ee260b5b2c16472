"""Host overhead per op: median µs from `torch.ops.tileops.X(...)` returning, ours vs torch.

Small inputs, so the number is the launch path (validation, dispatch, kernel lookup, launch), not
GPU work. `python -m benchmarks.overhead` on a CUDA machine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import tilelang_ops  # noqa: F401
from benchmarks._timing import host_us, table, write_json


def cases():
    dev, bf = "cuda", torch.bfloat16
    ops = torch.ops.tileops
    a, b = torch.randn(1024, device=dev, dtype=bf), torch.randn(1024, device=dev, dtype=bf)
    x = torch.randn(8, 1024, device=dev, dtype=bf)
    y = torch.softmax(x.float(), -1).to(bf)
    g = torch.randn_like(x)
    w = torch.randn(1024, 1024, device=dev, dtype=bf)
    bias = torch.randn(1024, device=dev, dtype=bf)
    q = torch.randn(1, 128, 8, 128, device=dev, dtype=bf)
    yield "add", lambda: ops.add(a, b), lambda: torch.add(a, b)
    yield "softmax", lambda: ops.softmax(x, -1), lambda: torch.softmax(x, -1)
    yield "softmax_backward", lambda: ops.softmax_backward(g, y, -1), lambda: torch._softmax_backward_data(g, y, -1, bf)
    yield "log_softmax", lambda: ops.log_softmax(x, -1), lambda: torch.log_softmax(x, -1)
    yield "gemm", lambda: ops.gemm(x, w), lambda: torch.matmul(x, w)
    yield "linear gelu_tanh", lambda: ops.linear(x, w, bias, "gelu_tanh"), lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")
    yield "flash_attn", lambda: ops.flash_attn(q, q, q), lambda: F.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))


def main() -> None:
    rows = []
    for name, ours, peer in cases():
        try:
            ours()
            torch.cuda.synchronize()
            rows.append(dict(op=name, tileops_us=host_us(ours), torch_us=host_us(peer)))
        except Exception as e:  # report and continue: one broken op must not hide the others
            rows.append(dict(op=name, tileops_us=None, torch_us=None, error=f"{type(e).__name__}: {e}"[:120]))
    for r in rows:
        if r.get("tileops_us"):
            r["ratio"] = r["tileops_us"] / r["torch_us"]
    write_json("overhead", rows)
    print(table(rows, ["op", "tileops_us", "torch_us", "ratio", "error"]))


if __name__ == "__main__":
    main()
