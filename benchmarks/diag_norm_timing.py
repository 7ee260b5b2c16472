"""Diagnostic (GPU): layer_norm_backward timed through the op, through its launcher, and as GPU
time in a CUDA graph, with and without an L2 flush: where a ~40 µs kernel's op-level timing is
the host path's (docs/benchmarks.md, LayerNorm). benchmarks/diag_norm_host.py times the same
case's host pieces.

    python -m benchmarks.diag_norm_timing
"""
from types import SimpleNamespace

import torch

import tilelang_ops  # noqa: F401
from tilelang_ops.ops import norm as N


def backward_case(dt=torch.float32, od=torch.bfloat16, m: int = 16384, n: int = 768) -> SimpleNamespace:
    """Inputs of one layer_norm_backward call, its launcher and preallocated outputs, and the
    op / launcher / forward as zero-argument callables."""
    c = SimpleNamespace(m=m, n=n, x=torch.randn(m, n, device="cuda", dtype=dt), w=torch.randn(n, device="cuda", dtype=dt))
    c.dy = torch.randn(m, n, device="cuda", dtype=od)
    c.y, c.mean, c.rstd = torch.ops.tileops.layer_norm(c.x, c.w, c.w, 1e-5, od)
    c.launch, ctas, bm = N._bwd_kernel(n, dt, dt, od, c.x.device)
    c.dx, c.dw, c.db = torch.empty_like(c.x), torch.empty_like(c.w), torch.empty_like(c.w)
    c.parts = torch.empty(2, N.bwd_grid(m, ctas, bm), n, device="cuda")
    c.op = lambda: torch.ops.tileops.layer_norm_backward(c.dy, c.x, c.w, c.mean, c.rstd)
    c.direct = lambda: c.launch(c.dy, c.x, c.w, c.mean, c.rstd, c.dx, c.parts, c.dw, c.db)
    c.fwd = lambda: torch.ops.tileops.layer_norm(c.x, c.w, c.w, 1e-5, od)
    return c


def main() -> None:
    from benchmarks._timing import bench, graph_ms

    for dt in (torch.float32, torch.bfloat16):
        c = backward_case(dt)
        gb = c.m * c.n * (2 * c.x.element_size() + c.dy.element_size()) / 1e9
        for name, f in (("op", c.op), ("direct", c.direct)):
            r = [bench(f, flush_l2=True), bench(f, flush_l2=False), graph_ms(f)]
            print(f"{str(dt)[6:]} bwd {name:6s}: flush {r[0]*1e3:6.1f} us  noflush {r[1]*1e3:6.1f} us  graph {r[2]*1e3:6.1f} us  ({gb / r[2]:.2f} TB/s graph)")
        r = [bench(c.fwd, flush_l2=True), graph_ms(c.fwd)]
        print(f"{str(dt)[6:]} fwd op    : flush {r[0]*1e3:6.1f} us  graph {r[1]*1e3:6.1f} us")


if __name__ == "__main__":
    main()
