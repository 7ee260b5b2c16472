"""Host µs of the ways an op can allocate its CUDA outputs from Python: which spelling is cheapest.

    python -m benchmarks.diag_alloc     # on a CUDA machine; writes $OUT/alloc.json

An op's outputs are allocated per call (the caching allocator: no cudaMalloc), yet each
allocation from Python costs microseconds of argument parsing and dispatch; LayerNorm's forward
allocates three, its backward four. Rounds alternate the spellings (host drift hits all alike);
the table gives each one's median over rounds.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks._timing import host_us, table, write_json


def main() -> int:
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(8, 1024, device="cuda", dtype=bf)
    dev, shape, m, n = x.device, x.shape, 8, 1024
    cases = {
        "torch.empty(m, n, dtype=, device=)": lambda: torch.empty(m, n, dtype=bf, device=dev),
        "torch.empty(size, dtype=, device=)": lambda: torch.empty(shape, dtype=bf, device=dev),
        "torch.empty(m, dtype=f32, device=)": lambda: torch.empty(m, dtype=f32, device=dev),
        "x.new_empty(m, n)": lambda: x.new_empty(m, n),
        "x.new_empty(size)": lambda: x.new_empty(shape),
        "x.new_empty(m, dtype=f32)": lambda: x.new_empty(m, dtype=f32),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.new_empty(2, m, dtype=f32) + [0], [1]": lambda: (lambda s: (s[0], s[1]))(x.new_empty(2, m, dtype=f32)),
        "x[0] (a view, for scale)": lambda: x[0],
        "torch.add(x, x) (alloc + launch, for scale)": lambda: torch.add(x, x),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(5):
        names = list(cases)
        for k in names[r % len(names):] + names[: r % len(names)]:
            samples[k].append(host_us(cases[k], n=3000))
    rows = [{"spelling": k, "us": statistics.median(v), "min_us": min(v)} for k, v in samples.items()]
    write_json("alloc", rows)
    print(table(rows, ["spelling", "us", "min_us"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
