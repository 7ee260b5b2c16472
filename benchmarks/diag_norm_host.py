"""Diagnostic (GPU): host µs of layer_norm_backward's pieces (16384 x 768 fp32, bf16 dy).

    python -m benchmarks.diag_norm_host
"""
import torch

from benchmarks._timing import host_us
from benchmarks.diag_norm_timing import backward_case
from tilelang_ops.ops import norm as N
from tilelang_ops.ops._checks import ready

c = backward_case()
small = backward_case(m=8)
impl = N.layer_norm_backward.impls[torch._C.DispatchKey.CUDA]
x, n = c.x, c.n
cases = {
    "op (big)": c.op,
    "impl (big)": lambda: impl(c.dy, c.x, c.w, c.mean, c.rstd),
    "launch (big)": c.direct,
    "op (8 rows)": small.op,
    "empty 48MB": lambda: torch.empty(c.m, n, device="cuda"),
    "empty x4 (impl's)": lambda: (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(n, device=x.device), torch.empty(n, device=x.device), torch.empty(c.parts.shape, device=x.device)),
    "ready x5": lambda: (ready(c.dy), ready(c.x), ready(c.w), ready(c.mean), ready(c.rstd)),
    "fwd op (big)": c.fwd,
}
for name, f in cases.items():
    print(f"{name:20s} {host_us(f, n=300, warmup=30):7.1f} us host")
