"""Diagnostic (GPU, under Nsight Compute): our fused Linear and plain "nt" GEMM next to cuBLASLt's
fused epilogue and cuBLAS at one shape, one launch each inside a profiler range, so `ncu` reports
the kernels' tensor-pipe use and stall reasons side by side (with `--nn`, also our "nn" GEMM and
cuBLAS's on the same shape: `a @ b` with b of shape (K, N)):

    ncu --profile-from-start off --set full -o FILE python3 -m benchmarks.diag_gemm_ncu [--nn] [M N K]
    ncu --import FILE.ncu-rep --page details --csv > details.csv

Default shape 4096 x 3072 x 768 (GPT-2's MLP up-projection, where the fused Linear trails cuBLASLt
most). Without ncu it only runs the four calls once (a smoke test).
"""
import sys

import torch

import tilelang_ops  # noqa: F401


def contenders(m: int, n: int, k: int, nn: bool = False, linear: bool = True) -> dict:
    """{name: call} at one shape: our "nt" GEMM and cuBLAS's (with `linear`, also our fused Linear
    and cuBLASLt's `_addmm_activation`; with `nn`, our "nn" GEMM and cuBLAS's: b of shape (K, N))."""
    bf = torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=bf)
    w = torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5
    calls = {}
    if linear:
        bias = torch.randn(n, device="cuda", dtype=bf)
        calls["ours linear+bias+gelu_tanh"] = lambda: torch.ops.tileops.linear(a, w, bias, "gelu_tanh")
        calls["cublasLt _addmm_activation"] = lambda: torch._addmm_activation(bias, a, w.t(), use_gelu=True)
    calls["ours gemm_nt"] = lambda: torch.ops.tileops.gemm_nt(a, w)
    calls["cublas matmul"] = lambda: torch.matmul(a, w.t())
    if nn:
        b = w.t().contiguous()
        calls["ours gemm"] = lambda: torch.ops.tileops.gemm(a, b)
        calls["cublas matmul nn"] = lambda: torch.matmul(a, b)
    return calls


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    nn = "--nn" in args
    args = [a for a in args if a != "--nn"]
    m, n, k = (int(v) for v in (args or (4096, 3072, 768)))
    calls = contenders(m, n, k, nn)
    for f in calls.values():  # compile / load and warm every kernel outside the profiled range
        f(), f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, f in calls.items():
        torch.cuda.nvtx.range_push(name)
        f()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ran {', '.join(calls)} at {m}x{n}x{k}")


if __name__ == "__main__":
    main()
