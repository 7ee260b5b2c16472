"""Diagnostic (GPU): layer_norm_backward timed through the op, through its launcher, and as GPU
time in a CUDA graph, with and without an L2 flush: where a ~40 µs kernel's op-level timing is
the host path's (docs/benchmarks.md, LayerNorm).

    python -m benchmarks.diag_norm_timing
"""
import torch

import tilelang_ops  # noqa: F401
from benchmarks._timing import bench, graph_ms
from tilelang_ops.ops import norm as N

for dt, od in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
    m, n = 16384, 768
    x = torch.randn(m, n, device="cuda", dtype=dt)
    w = torch.randn(n, device="cuda", dtype=dt)
    dy = torch.randn(m, n, device="cuda", dtype=od)
    y, mean, rstd = torch.ops.tileops.layer_norm(x, w, w, 1e-5, od)
    launch, ctas, bm = N._bwd_kernel(n, dt, dt, od, x.device)
    grid = min(ctas, -(-m // bm))
    dx, dw, db, parts = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w), torch.empty(2, grid, n, device="cuda")
    op = lambda: torch.ops.tileops.layer_norm_backward(dy, x, w, mean, rstd)  # noqa: E731
    direct = lambda: launch(dy, x, w, mean, rstd, dx, parts, dw, db)  # noqa: E731
    fwd = lambda: torch.ops.tileops.layer_norm(x, w, w, 1e-5, od)  # noqa: E731
    gb = m * n * (2 * x.element_size() + dy.element_size()) / 1e9
    for name, f in (("op", op), ("direct", direct)):
        r = [bench(f, flush_l2=True), bench(f, flush_l2=False), graph_ms(f)]
        print(f"{str(dt)[6:]} bwd {name:6s}: flush {r[0]*1e3:6.1f} us  noflush {r[1]*1e3:6.1f} us  graph {r[2]*1e3:6.1f} us  ({gb / r[2]:.2f} TB/s graph)")
    r = [bench(fwd, flush_l2=True), graph_ms(fwd)]
    print(f"{str(dt)[6:]} fwd op    : flush {r[0]*1e3:6.1f} us  graph {r[1]*1e3:6.1f} us")
