"""Row softmax / log-softmax over the last dim of an (M, N) tensor, forward and backward.

M (rows) is symbolic, so a new batch size never recompiles; N (row length) is static because it
shapes the schedule: each distinct N compiles once per (kind, dtype, direction). Two schedules:

* **rows** — one pass, the row held in registers. A CTA owns `block_m` rows; each row is spread
  over `threads // block_m` threads, `vec` contiguous elements (16 bytes) per access. Short rows
  pack many rows per CTA so reductions stay inside a warp (shuffles, no barrier); mid rows take a
  whole CTA. The row is padded in registers to a multiple of `vec * threads_per_row` with
  -inf (fwd) / 0 (bwd) so any N compiles; only the padding lanes pay for the guard.
  Memory: reads M*N (x, or y and dy), writes M*N.

* **split** — rows too long for registers. Each row is cut into chunks of `chunk` elements, one
  CTA per (row, chunk) so a handful of rows still fills 132 SMs. A `stats` kernel writes one
  fp32 partial per chunk (max and sum of exp for the forward, the row dot for the backward); an
  `apply` kernel folds the row's partials and re-reads its chunk to write the output. The re-read
  hits L2 when the tensor fits (H200: 50 MB), otherwise it costs one extra read of the input.

All math in fp32; exp via exp2 with a log2(e) pre-scale; output rounded once to the input dtype.
Semantics match PyTorch: an all -inf row gives NaN, a +inf gives NaN for its row, NaN propagates.
"""
import math
from dataclasses import dataclass

import tilelang.language as T

from ..runtime import kernel

DTYPES = ("float32", "float16", "bfloat16")
KINDS = ("softmax", "log_softmax")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_ACC = "float32"
_ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def vec_width(n: int, dtype: str) -> int:
    """Elements per 16-byte access, shrunk to a power of two dividing N (row starts stay aligned)."""
    v = 16 // _ESIZE[dtype]
    while n % v:
        v //= 2
    return v


@dataclass(frozen=True)
class RowConfig:
    block_m: int = 1  # rows per CTA; threads // block_m threads share a row
    threads: int = 256


@dataclass(frozen=True)
class SplitConfig:
    chunk: int = 8192  # row elements per CTA; a multiple of threads * vec
    threads: int = 256


# Registers per thread: 32 fp32 row values (64 bytes of bf16 loads in flight per thread) keeps
# ptxas under the 64-register cap of a 1024-thread CTA and leaves >= 1024 threads per SM.
_PER_THREAD = 32
_MAX_THREADS = 1024


def _row_limit(dtype: str, backward: bool, kind: str) -> int:
    """Longest row kept in registers; longer rows take the split schedule."""
    arrays = 2 if (backward or kind == "log_softmax") else 1  # fp32 fragments live at once
    return _MAX_THREADS * _PER_THREAD // arrays


def default_config(n: int, dtype: str, kind: str = "softmax", backward: bool = False) -> RowConfig | SplitConfig:
    """Schedule for rows of length n: short rows pack a CTA, mid rows own one, long rows split."""
    vec = vec_width(n, dtype)
    if n > _row_limit(dtype, backward, kind):
        per_thread = 16 if (backward or kind == "log_softmax") else 32
        threads = 256
        return SplitConfig(chunk=threads * max(per_thread, vec), threads=threads)
    if n <= 1024:
        # Short rows: 128 threads, each row on a power-of-two group of lanes (<= a warp for N <= 512)
        # holding ~2 vectors each, so the row reductions are warp shuffles.
        threads = 128
        tpr = 1
        while tpr < 128 and tpr * vec * 2 < n:
            tpr *= 2
        return RowConfig(block_m=threads // tpr, threads=threads)
    per_thread = _PER_THREAD // (2 if (backward or kind == "log_softmax") else 1)
    threads = 128
    while threads < _MAX_THREADS and threads * per_thread < n:
        threads *= 2
    return RowConfig(block_m=1, threads=threads)


SEARCH_SPACE = [RowConfig(b, t) for t in (128, 256, 512, 1024) for b in (1, 2, 4, 8, 16, 32) if b <= t] + [
    SplitConfig(c, t) for t in (128, 256, 512) for c in (4096, 8192, 16384) if c >= 8 * t
]


def _padded(n: int, lanes: int) -> int:
    return -(-n // lanes) * lanes


def _split_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


# ---------------------------------------------------------------------------------------------
# rows: one pass, rows in registers
# ---------------------------------------------------------------------------------------------
@kernel("softmax", "softmax_rows_fwd", out_idx=[1])
def rows_fwd(config: RowConfig, n: int, dtype: str, kind: str):
    M = T.dynamic("M")
    bm, threads = config.block_m, config.threads
    vec = vec_width(n, dtype)
    np_ = _padded(n, vec * max(threads // bm, 1))
    log = kind == "log_softmax"

    @T.prim_func
    def fwd(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), dtype)):
        with T.Kernel(T.ceildiv(M, bm), threads=threads) as bx:
            x = T.alloc_fragment((bm, np_), _ACC)
            mx = T.alloc_fragment((bm,), _ACC)
            s = T.alloc_fragment((bm,), _ACC)
            for i, j in T.Parallel(bm, np_):  # reads bm*n
                x[i, j] = T.if_then_else(
                    (bx * bm + i < M) and (j < n), T.Cast(_ACC, X[bx * bm + i, j]), -T.infinity(_ACC)
                )
            T.reduce_max(x, mx, dim=1)
            if log:
                e = T.alloc_fragment((bm, np_), _ACC)
                for i, j in T.Parallel(bm, np_):
                    e[i, j] = T.exp2((x[i, j] - mx[i]) * LOG2E)
                T.reduce_sum(e, s, dim=1)
                for i in T.Parallel(bm):
                    s[i] = mx[i] + T.log2(s[i]) * LN2  # logsumexp
                for i, j in T.Parallel(bm, np_):  # writes bm*n
                    if (bx * bm + i < M) and (j < n):
                        Y[bx * bm + i, j] = T.Cast(dtype, x[i, j] - s[i])
            else:
                for i, j in T.Parallel(bm, np_):
                    x[i, j] = T.exp2((x[i, j] - mx[i]) * LOG2E)
                T.reduce_sum(x, s, dim=1)
                for i in T.Parallel(bm):
                    s[i] = 1.0 / s[i]
                for i, j in T.Parallel(bm, np_):  # writes bm*n
                    if (bx * bm + i < M) and (j < n):
                        Y[bx * bm + i, j] = T.Cast(dtype, x[i, j] * s[i])

    return fwd


@kernel("softmax", "softmax_rows_bwd", out_idx=[2])
def rows_bwd(config: RowConfig, n: int, dtype: str, kind: str):
    """softmax: dx = y * (dy - sum(dy * y));  log_softmax: dx = dy - exp(y) * sum(dy)."""
    M = T.dynamic("M")
    bm, threads = config.block_m, config.threads
    vec = vec_width(n, dtype)
    np_ = _padded(n, vec * max(threads // bm, 1))
    log = kind == "log_softmax"

    @T.prim_func
    def bwd(DY: T.Tensor((M, n), dtype), Yt: T.Tensor((M, n), dtype), DX: T.Tensor((M, n), dtype)):
        with T.Kernel(T.ceildiv(M, bm), threads=threads) as bx:
            dy = T.alloc_fragment((bm, np_), _ACC)
            y = T.alloc_fragment((bm, np_), _ACC)
            dot = T.alloc_fragment((bm,), _ACC)
            for i, j in T.Parallel(bm, np_):  # reads 2*bm*n
                dy[i, j] = T.if_then_else((bx * bm + i < M) and (j < n), T.Cast(_ACC, DY[bx * bm + i, j]), 0.0)
            for i, j in T.Parallel(bm, np_):
                y[i, j] = T.if_then_else((bx * bm + i < M) and (j < n), T.Cast(_ACC, Yt[bx * bm + i, j]), 0.0)
            if log:
                T.reduce_sum(dy, dot, dim=1)
            else:
                p = T.alloc_fragment((bm, np_), _ACC)
                for i, j in T.Parallel(bm, np_):
                    p[i, j] = dy[i, j] * y[i, j]
                T.reduce_sum(p, dot, dim=1)
            for i, j in T.Parallel(bm, np_):  # writes bm*n
                if (bx * bm + i < M) and (j < n):
                    if log:
                        DX[bx * bm + i, j] = T.Cast(dtype, dy[i, j] - T.exp2(y[i, j] * LOG2E) * dot[i])
                    else:
                        DX[bx * bm + i, j] = T.Cast(dtype, y[i, j] * (dy[i, j] - dot[i]))

    return bwd


# ---------------------------------------------------------------------------------------------
# split: long rows, one CTA per (row, chunk); stats then apply
# ---------------------------------------------------------------------------------------------
@kernel("softmax", "softmax_split_stats")
def split_stats(config: SplitConfig, n: int, dtype: str, kind: str, backward: bool):
    """Per-chunk partials. fwd: P0 = chunk max, P1 = sum exp(x - max) (0 for an all -inf chunk).
    bwd: P0 = sum(dy * y) (softmax) or sum(dy) (log_softmax); P1 unused."""
    M = T.dynamic("M")
    c, threads = config.chunk, config.threads
    nc = _split_chunks(n, c)
    log = kind == "log_softmax"

    @T.prim_func
    def stats(
        A: T.Tensor((M, n), dtype),  # fwd: x; bwd: dy
        B: T.Tensor((M, n), dtype),  # fwd: unused (x again); bwd: y
        P0: T.Tensor((M, nc), _ACC),
        P1: T.Tensor((M, nc), _ACC),
    ):
        with T.Kernel(M, nc, threads=threads) as (row, ch):
            base = ch * c
            a = T.alloc_fragment((c,), _ACC)
            r0 = T.alloc_fragment((1,), _ACC)
            if backward:
                if log:
                    for j in T.Parallel(c):  # reads c
                        a[j] = T.if_then_else(base + j < n, T.Cast(_ACC, A[row, base + j]), 0.0)
                else:
                    for j in T.Parallel(c):  # reads 2*c
                        a[j] = T.if_then_else(
                            base + j < n, T.Cast(_ACC, A[row, base + j]) * T.Cast(_ACC, B[row, base + j]), 0.0
                        )
                T.reduce_sum(a, r0, dim=0)
                P0[row, ch] = r0[0]
            else:
                r1 = T.alloc_fragment((1,), _ACC)
                for j in T.Parallel(c):  # reads c
                    a[j] = T.if_then_else(base + j < n, T.Cast(_ACC, A[row, base + j]), -T.infinity(_ACC))
                T.reduce_max(a, r0, dim=0)
                # An all -inf chunk must contribute sum 0, not NaN (-inf - -inf): shift by 0 there.
                for j in T.Parallel(c):
                    a[j] = T.exp2((a[j] - T.if_then_else(r0[0] == -T.infinity(_ACC), 0.0, r0[0])) * LOG2E)
                T.reduce_sum(a, r1, dim=0)
                P0[row, ch] = r0[0]
                P1[row, ch] = r1[0]

    return stats


@kernel("softmax", "softmax_split_apply")
def split_apply(config: SplitConfig, n: int, dtype: str, kind: str, backward: bool):
    """Fold the row's partials (nc scalars, read by every thread) and write the chunk's output."""
    M = T.dynamic("M")
    c, threads = config.chunk, config.threads
    nc = _split_chunks(n, c)
    log = kind == "log_softmax"

    @T.prim_func
    def apply(
        A: T.Tensor((M, n), dtype),  # fwd: x; bwd: dy
        B: T.Tensor((M, n), dtype),  # fwd: unused; bwd: y
        P0: T.Tensor((M, nc), _ACC),
        P1: T.Tensor((M, nc), _ACC),
        O: T.Tensor((M, n), dtype),
    ):
        with T.Kernel(M, nc, threads=threads) as (row, ch):
            base = ch * c
            acc0 = T.alloc_var(_ACC)
            acc1 = T.alloc_var(_ACC)
            if backward:
                acc0 = 0.0
                for k in T.serial(nc):
                    acc0 = acc0 + P0[row, k]
                for j in T.Parallel(c):  # reads 2*c, writes c
                    if base + j < n:
                        if log:
                            O[row, base + j] = T.Cast(
                                dtype, T.Cast(_ACC, A[row, base + j]) - T.exp2(T.Cast(_ACC, B[row, base + j]) * LOG2E) * acc0
                            )
                        else:
                            O[row, base + j] = T.Cast(
                                dtype, T.Cast(_ACC, B[row, base + j]) * (T.Cast(_ACC, A[row, base + j]) - acc0)
                            )
            else:
                acc0 = -T.infinity(_ACC)
                for k in T.serial(nc):
                    acc0 = T.max(acc0, P0[row, k])
                acc1 = 0.0
                # exp(-inf - -inf) = NaN only when the whole row is -inf, where PyTorch gives NaN too.
                for k in T.serial(nc):
                    acc1 = acc1 + P1[row, k] * T.exp2((P0[row, k] - acc0) * LOG2E)
                if log:
                    acc1 = acc0 + T.log2(acc1) * LN2
                else:
                    acc1 = 1.0 / acc1
                for j in T.Parallel(c):  # reads c (L2 when it fits), writes c
                    if base + j < n:
                        if log:
                            O[row, base + j] = T.Cast(dtype, T.Cast(_ACC, A[row, base + j]) - acc1)
                        else:
                            O[row, base + j] = T.Cast(
                                dtype, T.exp2((T.Cast(_ACC, A[row, base + j]) - acc0) * LOG2E) * acc1
                            )

    return apply


# (kernel, config, static) at which `tileops export` writes source and `tileops check` compiles.
def _rep(n: int, dtype: str, kind: str, backward: bool) -> list:
    cfg = default_config(n, dtype, kind, backward)
    if isinstance(cfg, RowConfig):
        return [((rows_bwd if backward else rows_fwd), cfg, {"n": n, "dtype": dtype, "kind": kind})]
    st = {"n": n, "dtype": dtype, "kind": kind, "backward": backward}
    return [(split_stats, cfg, st), (split_apply, cfg, st)]


REPRESENTATIVE = (
    _rep(128, "bfloat16", "softmax", False)
    + _rep(1024, "bfloat16", "softmax", False)
    + _rep(8192, "bfloat16", "softmax", False)
    + _rep(8192, "float32", "log_softmax", False)
    + _rep(8192, "bfloat16", "softmax", True)
    + _rep(65536, "bfloat16", "softmax", False)
    + _rep(65536, "bfloat16", "softmax", True)
)
