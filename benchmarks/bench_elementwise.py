"""tileops.add vs torch.add: host time per call on small tensors, bandwidth on large ones.

`python -m benchmarks.bench_elementwise` on a CUDA machine.
"""
from __future__ import annotations

import torch

import tilelang_ops  # noqa: F401
from benchmarks._timing import bench, host_us, table, write_json


def main() -> None:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(1024, device="cuda", dtype=dtype)
        b = torch.randn_like(a)
        from tilelang_ops.ops.elementwise import _add_kernel

        kern = _add_kernel(dtype, a.device, a.numel())
        out = torch.empty_like(a)
        rows.append(
            dict(
                what=f"host us/call, 1024 {str(dtype)[6:]}",
                tileops=host_us(lambda: torch.ops.tileops.add(a, b)),
                torch=host_us(lambda: torch.add(a, b)),
                raw_kernel=host_us(lambda: kern(a, b, out)),
            )
        )
    # copy ceiling, then add at sizes well past L2 (60 MB): bytes = 2 reads + 1 write
    n = 1 << 28
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_tbs = 2 * x.numel() * 2 / bench(lambda: y.copy_(x)) / 1e9
    for numel in (1 << 20, 1 << 24, 1 << 28, (1 << 24) + 17):
        a = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        nbytes = 3 * numel * 2
        t_ours = bench(lambda: torch.ops.tileops.add(a, b))
        t_torch = bench(lambda: torch.add(a, b))
        rows.append(
            dict(
                what=f"TB/s, {numel} bf16",
                tileops=nbytes / t_ours / 1e9,
                torch=nbytes / t_torch / 1e9,
                raw_kernel=None,
                copy_TBs=copy_tbs,
            )
        )
    write_json("bench_elementwise", rows)
    print(table(rows, ["what", "tileops", "torch", "raw_kernel", "copy_TBs"]))


if __name__ == "__main__":
    main()
