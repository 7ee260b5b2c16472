"""Diagnostic (GPU): host µs of layer_norm_backward's pieces (16384 x 768 fp32, bf16 dy).

    python -m benchmarks.diag_norm_host
"""
import torch

import tilelang_ops  # noqa: F401
from benchmarks._timing import host_us
from tilelang_ops.ops import norm as N
from tilelang_ops.ops._checks import ready

m, n = 16384, 768
x = torch.randn(m, n, device="cuda")
w = torch.randn(n, device="cuda")
dy = torch.randn(m, n, device="cuda").bfloat16()
y, mean, rstd = torch.ops.tileops.layer_norm(x, w, w, 1e-5, torch.bfloat16)
launch, ctas, bm = N._bwd_kernel(n, x.dtype, w.dtype, dy.dtype, x.device)
grid = min(ctas, -(-m // bm))
dx, dw, db, parts = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w), torch.empty(2, grid, n, device="cuda")
impl = N.layer_norm_backward.impls[torch._C.DispatchKey.CUDA]
small = torch.randn(8, n, device="cuda")
sdy, (sy, smean, srstd) = torch.randn(8, n, device="cuda").bfloat16(), torch.ops.tileops.layer_norm(small, w, w, 1e-5, torch.bfloat16)
cases = {
    "op (big)": lambda: torch.ops.tileops.layer_norm_backward(dy, x, w, mean, rstd),
    "impl (big)": lambda: impl(dy, x, w, mean, rstd),
    "launch (big)": lambda: launch(dy, x, w, mean, rstd, dx, parts, dw, db),
    "op (8 rows)": lambda: torch.ops.tileops.layer_norm_backward(sdy, small, w, smean, srstd),
    "empty 48MB": lambda: torch.empty(m, n, device="cuda"),
    "empty x4 (impl's)": lambda: (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(n, device=x.device), torch.empty(n, device=x.device), torch.empty(2, grid, n, device=x.device)),
    "ready x5": lambda: (ready(dy), ready(x), ready(w), ready(mean), ready(rstd)),
    "fwd op (big)": lambda: torch.ops.tileops.layer_norm(x, w, w, 1e-5, torch.bfloat16),
}
for name, f in cases.items():
    print(f"{name:20s} {host_us(f, n=300, warmup=30):7.1f} us host")
