"""Elementwise kernels: c = a + b over a flat, 16-byte aligned buffer of symbolic length N."""
from __future__ import annotations

from dataclasses import dataclass

import tilelang.language as T

from ..runtime import kernel

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class AddConfig:
    block: int = 2048  # elements per CTA; with 256 threads, 8 per thread = one 16-byte access in bf16
    threads: int = 256


def default_config(dtype: str) -> AddConfig:
    # fp32 needs 4 elements for a 16-byte access; keep 8/thread so each thread has 2 loads in flight.
    return AddConfig(block=2048, threads=256)


SEARCH_SPACE = [AddConfig(b, t) for b in (1024, 2048, 4096) for t in (128, 256)]


@kernel("elementwise", "add")
def add_kernel(config: AddConfig, dtype: str):
    N = T.dynamic("N")  # any length: one compiled kernel per dtype
    block, threads = config.block, config.threads

    @T.prim_func
    def add(A: T.Tensor((N,), dtype), B: T.Tensor((N,), dtype), C: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            base = bx * block
            # Full tiles take a branch-free body that TileLang vectorizes to 16-byte accesses;
            # only the last, ragged tile pays for per-element guards.
            if base + block <= N:
                for i in T.Parallel(block):
                    C[base + i] = T.Cast(dtype, T.Cast("float32", A[base + i]) + T.Cast("float32", B[base + i]))
            else:
                for i in T.Parallel(block):
                    if base + i < N:
                        C[base + i] = T.Cast(dtype, T.Cast("float32", A[base + i]) + T.Cast("float32", B[base + i]))

    return add


# (kernel, config, static args) at which `tileops export` writes source and `tileops check` compiles.
REPRESENTATIVE = [(add_kernel, default_config(d), {"dtype": d}) for d in DTYPES]
