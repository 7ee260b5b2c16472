"""LayerNorm over the last dim of an (M, n) tensor, forward and backward.

M (rows) is symbolic: one compiled kernel per (n, dtypes, eps, config) serves every batch. A row
lives in registers: a CTA takes `block_m` rows at a time, `threads // block_m` lanes per row, each
lane `vec` contiguous elements (16 bytes of x) per access, `k` accesses per row. Rows are padded in
registers to k * lanes * vec with zeros, so any n compiles; padded lanes are masked out of every
sum and store.

* forward: one read of x, one write of y (in `odtype`: e.g. bf16 from an fp32 residual stream,
  the cast a following Linear under autocast would do anyway) and of the per-row mean and
  1/std (fp32). mean and variance are exact two-pass sums over the row held in registers.
* backward: `grid` CTAs (a few per SM) walk the row blocks, each reading dy, x once and writing
  dx; g = dy * w, xhat = (x - mean) * rstd, dx = rstd * (g - mean(g * xhat) * xhat - mean(g)).
  Each CTA keeps its dw (= sum dy * xhat) and db (= sum dy) column sums in registers across the
  rows it visits, folds its row slots through shared memory and writes one fp32 partial row per
  CTA; a second kernel of the same prim_func (one host call) folds the grid's partials in a fixed
  order: deterministic, no atomics, 2 * grid * n * 4 bytes of extra traffic (~1% at n=768).

All math in fp32.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..runtime import kernel
from .softmax import vec_width  # the same 16-byte row accesses as softmax's row schedules

DTYPES = ("float32", "float16", "bfloat16")
_ACC = "float32"
MAX_N = 16384  # longest row held in registers (fp32: 16 values per thread per array at 1024 threads)
_PER_THREAD = 16  # fits(): values per thread per row array, up to twice this


@dataclass(frozen=True)
class NormConfig:
    block_m: int = 8  # rows per CTA step; threads // block_m lanes share a row
    threads: int = 256
    ctas_per_sm: int = 2  # backward: the grid is SMs * this (one dw/db partial row per CTA)


def row_tile(config: NormConfig, n: int, dtype: str) -> tuple[int, int]:
    """(k, w): a row is k slices of w = lanes * vec elements, slice kk at kk * w."""
    w = max(config.threads // config.block_m, 1) * vec_width(n, dtype)
    return -(-n // w), w


def default_config(n: int, dtype: str, backward: bool = False) -> NormConfig:
    """A warp per row while a lane holds few enough values of it (forward 32, backward 24: it holds
    four row arrays), more lanes (a CTA-wide reduction) for longer rows; >= 128 threads per CTA.
    From bench_norm --sweep on an H200 (session 13: 16384 x 768 fp32, 16384 x 4096 bf16)."""
    vec = vec_width(n, dtype)
    most = 24 if backward else 32
    lanes = 32
    while lanes < 1024 and -(-n // (lanes * vec)) * vec > most:
        lanes *= 2
    threads = max(lanes, 128)
    return NormConfig(block_m=threads // lanes, threads=threads)


SEARCH_SPACE = [NormConfig(b, t, c) for t in (128, 256, 512) for b in (1, 2, 4, 8, 16) if b <= t // 32 for c in (1, 2, 4)]


def fits(config: NormConfig, n: int, dtype: str) -> bool:
    """Whether `config` holds rows of n in registers without idle lanes (a warp per row at least)."""
    k, w = row_tile(config, n, dtype)
    lanes = config.threads // config.block_m
    return lanes >= 32 and (lanes == 32 or w < 2 * n) and k * vec_width(n, dtype) <= 2 * _PER_THREAD


def search_space(n: int, dtype: str) -> list[NormConfig]:
    return [c for c in SEARCH_SPACE if fits(c, n, dtype)]


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@kernel("norm", "layer_norm_fwd")
def layer_norm_fwd(config: NormConfig, n: int, dtype: str, wdtype: str, odtype: str, eps: float, rdtype: str = ""):
    """Y = (X - mean) * rstd * W + B; Mean, Rstd per row (fp32).

    rdtype (add_layer_norm): a second input R of that dtype; the kernel normalizes H = X + R
    (rounded to dtype, as a separate add would store it) and writes H too: the residual add of a
    pre-norm block in the same pass over the row."""
    M = T.dynamic("M")
    bm, threads = config.block_m, config.threads
    k, w = row_tile(config, n, dtype)
    residual = rdtype != ""

    @T.macro
    def body(X, R, W, B, H, Y, Mean, Rstd):
        with T.Kernel(T.ceildiv(M, bm), threads=threads) as bx:
            x = T.alloc_fragment((k, bm, w), _ACC)
            part = T.alloc_fragment((bm, w), _ACC)
            mu = T.alloc_fragment((bm,), _ACC)
            rs = T.alloc_fragment((bm,), _ACC)
            for kk, i, j in T.Parallel(k, bm, w):  # reads bm * n
                x[kk, i, j] = T.if_then_else((bx * bm + i < M) and (kk * w + j < n), T.Cast(_ACC, X[bx * bm + i, kk * w + j]), 0.0)
            if residual:
                r = T.alloc_fragment((k, bm, w), _ACC)
                # One load per loop: with two in one loop TileLang vectorizes them to 8 bytes.
                for kk, i, j in T.Parallel(k, bm, w):
                    r[kk, i, j] = T.if_then_else((bx * bm + i < M) and (kk * w + j < n), T.Cast(_ACC, R[bx * bm + i, kk * w + j]), 0.0)
                for kk, i, j in T.Parallel(k, bm, w):
                    x[kk, i, j] = T.Cast(_ACC, T.Cast(dtype, x[kk, i, j] + r[kk, i, j]))
                for kk, i, j in T.Parallel(k, bm, w):  # writes bm * n
                    if (bx * bm + i < M) and (kk * w + j < n):
                        H[bx * bm + i, kk * w + j] = T.Cast(dtype, x[kk, i, j])
            T.reduce_sum(x, part, dim=0)
            T.reduce_sum(part, mu, dim=1)
            for i in T.Parallel(bm):
                mu[i] = mu[i] * (1.0 / n)
            for kk, i, j in T.Parallel(k, bm, w):  # centred; padding stays 0 for the variance
                x[kk, i, j] = T.if_then_else(kk * w + j < n, x[kk, i, j] - mu[i], 0.0)
            _row_dot(x, x, part, rs, k, w)
            for i in T.Parallel(bm):
                rs[i] = T.rsqrt(rs[i] * (1.0 / n) + eps)
            for kk, i, j in T.Parallel(k, bm, w):  # writes bm * n
                if (bx * bm + i < M) and (kk * w + j < n):
                    Y[bx * bm + i, kk * w + j] = T.Cast(
                        odtype, x[kk, i, j] * rs[i] * T.Cast(_ACC, W[kk * w + j]) + T.Cast(_ACC, B[kk * w + j])
                    )
            for i in T.Parallel(bm):
                if bx * bm + i < M:
                    Mean[bx * bm + i] = mu[i]
                    Rstd[bx * bm + i] = rs[i]

    if rdtype:

        @T.prim_func
        def add_fwd(
            X: T.Tensor((M, n), dtype), R: T.Tensor((M, n), rdtype), W: T.Tensor((n,), wdtype), B: T.Tensor((n,), wdtype),
            H: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), odtype), Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
        ):
            body(X, R, W, B, H, Y, Mean, Rstd)

        return add_fwd

    @T.prim_func
    def fwd(
        X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype), B: T.Tensor((n,), wdtype),
        Y: T.Tensor((M, n), odtype), Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
    ):
        body(X, None, W, B, None, Y, Mean, Rstd)

    return fwd


@T.macro
def _row_dot(a, b, part, out, k: int, w: int):
    """out[i] = sum over row i of a * b: each lane's products first (no k-sized temporary), then
    one reduction per row (the forward's variance, the backward's mean of g * xhat)."""
    T.clear(part)
    for i, j in T.Parallel(part.shape[0], w):
        for kk in T.serial(k):
            part[i, j] = part[i, j] + a[kk, i, j] * b[kk, i, j]
    T.reduce_sum(part, out, dim=1)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FoldConfig:
    block_rows: int = 32  # partial rows folded per step
    block_n: int = 32  # columns per CTA: n / 32 CTAs (24 at n = 768) share the fold
    threads: int = 256


@T.macro
def _fold_rows(acc, red, col, P, t: int, bx, n: int, k: int, bm: int, w: int, threads: int, out=None, odtype: str = ""):
    """P[t, bx, :] = acc summed over its bm row slots (a fixed order): through shared memory
    (bm, k * w), then each thread folds one column at a time (any n, any thread count). With
    `out` (a one-CTA grid), the sums go to out (n,) in odtype instead: they are the result."""
    for kk, i, j in T.Parallel(k, bm, w):
        red[i, kk * w + j] = acc[kk, i, j]
    for c in T.serial(T.ceildiv(n, threads)):
        for x in T.Parallel(threads):
            col[x] = 0.0
            if c * threads + x < n:
                for i in T.serial(bm):
                    col[x] = col[x] + red[i, c * threads + x]
                if out is None:
                    P[t, bx, c * threads + x] = col[x]
                else:
                    out[c * threads + x] = T.Cast(odtype, col[x])


@kernel("norm", "layer_norm_bwd")
def layer_norm_bwd(config: NormConfig, n: int, dtype: str, wdtype: str, dydtype: str, dh: bool = False, rdtype: str = "", single: bool = False):
    """DX from DY, X, W, Mean, Rstd; DW, DB through per-CTA partials P[0] (dw), P[1] (db).

    add_layer_norm's backward (rdtype given): X is H = x + residual; DX = H's gradient through the
    norm plus, with dh, DH (H's gradient from its other uses: the residual stream), written once
    more as DR in rdtype (the residual branch's gradient, e.g. bf16 under autocast: no add or
    cast kernel after this one).

    single (for a few row blocks): one CTA walks every row and writes DW, DB itself: one kernel,
    no P (no fold launch, which costs the host more than these rows take on the GPU)."""
    M = T.dynamic("M")
    G = 1 if single else T.dynamic("G")  # CTAs of the row pass = partial rows; the op sizes P (2, G, n)
    bm, threads = config.block_m, config.threads
    k, w = row_tile(config, n, dtype)
    fold = FoldConfig()
    rb, fbn = fold.block_rows, fold.block_n
    residual = rdtype != ""

    @T.macro
    def body(DY, X, W, Mean, Rstd, DH, DX, DR, P, DW, DB):
        with T.Kernel(G, threads=threads) as bx:
            x = T.alloc_fragment((k, bm, w), _ACC)
            g = T.alloc_fragment((k, bm, w), _ACC)
            dw = T.alloc_fragment((k, bm, w), _ACC)
            db = T.alloc_fragment((k, bm, w), _ACC)
            part = T.alloc_fragment((bm, w), _ACC)
            c1 = T.alloc_fragment((bm,), _ACC)
            c2 = T.alloc_fragment((bm,), _ACC)
            mu = T.alloc_fragment((bm,), _ACC)
            rs = T.alloc_fragment((bm,), _ACC)
            red = T.alloc_shared((bm, k * w), _ACC)
            col = T.alloc_fragment((threads,), _ACC)
            T.clear(dw)
            T.clear(db)
            for it in T.serial(T.ceildiv(T.ceildiv(M, bm) - bx, G)):
                r0 = (bx + it * G) * bm
                for i in T.Parallel(bm):
                    mu[i] = T.if_then_else(r0 + i < M, Mean[r0 + i], 0.0)
                    rs[i] = T.if_then_else(r0 + i < M, Rstd[r0 + i], 0.0)
                # One load per loop: with two in one loop TileLang vectorizes them to 8 bytes.
                for kk, i, j in T.Parallel(k, bm, w):
                    g[kk, i, j] = T.if_then_else((r0 + i < M) and (kk * w + j < n), T.Cast(_ACC, DY[r0 + i, kk * w + j]), 0.0)
                for kk, i, j in T.Parallel(k, bm, w):
                    x[kk, i, j] = T.if_then_else((r0 + i < M) and (kk * w + j < n), T.Cast(_ACC, X[r0 + i, kk * w + j]), 0.0)
                for kk, i, j in T.Parallel(k, bm, w):
                    x[kk, i, j] = (x[kk, i, j] - mu[i]) * rs[i]  # xhat (rows past M: dy = 0 below)
                    db[kk, i, j] = db[kk, i, j] + g[kk, i, j]
                    dw[kk, i, j] = dw[kk, i, j] + g[kk, i, j] * x[kk, i, j]
                    g[kk, i, j] = g[kk, i, j] * T.if_then_else(kk * w + j < n, T.Cast(_ACC, W[kk * w + j]), 0.0)
                T.reduce_sum(g, part, dim=0)
                T.reduce_sum(part, c2, dim=1)
                _row_dot(g, x, part, c1, k, w)
                if residual:  # dx kept in g for the add and two stores (the plain kernel, below, stores it directly)
                    for kk, i, j in T.Parallel(k, bm, w):
                        g[kk, i, j] = rs[i] * (g[kk, i, j] - (x[kk, i, j] * c1[i] + c2[i]) * (1.0 / n))
                    if dh:
                        for kk, i, j in T.Parallel(k, bm, w):  # x is free now: DH's row goes there
                            x[kk, i, j] = T.if_then_else((r0 + i < M) and (kk * w + j < n), T.Cast(_ACC, DH[r0 + i, kk * w + j]), 0.0)
                        for kk, i, j in T.Parallel(k, bm, w):
                            g[kk, i, j] = g[kk, i, j] + x[kk, i, j]
                    for kk, i, j in T.Parallel(k, bm, w):  # writes bm * n
                        if (r0 + i < M) and (kk * w + j < n):
                            DX[r0 + i, kk * w + j] = T.Cast(dtype, g[kk, i, j])
                    for kk, i, j in T.Parallel(k, bm, w):  # writes bm * n
                        if (r0 + i < M) and (kk * w + j < n):
                            DR[r0 + i, kk * w + j] = T.Cast(rdtype, g[kk, i, j])
                else:
                    for kk, i, j in T.Parallel(k, bm, w):  # writes bm * n
                        if (r0 + i < M) and (kk * w + j < n):
                            DX[r0 + i, kk * w + j] = T.Cast(dtype, rs[i] * (g[kk, i, j] - (x[kk, i, j] * c1[i] + c2[i]) * (1.0 / n)))
            # Fold the CTA's bm row slots through shared memory: one partial row per CTA.
            if single:
                _fold_rows(dw, red, col, None, 0, bx, n, k, bm, w, threads, DW, wdtype)
                _fold_rows(db, red, col, None, 1, bx, n, k, bm, w, threads, DB, wdtype)
            else:
                _fold_rows(dw, red, col, P, 0, bx, n, k, bm, w, threads)
                _fold_rows(db, red, col, P, 1, bx, n, k, bm, w, threads)
        if not single:  # the fold of the partials: a second kernel of the same host call

            # Both sums in one CTA, stored unconditionally: with an if/else on the output, TileLang's
            # 16-bit store vectorization hoisted both stores out of the branch (one of them from an
            # uninitialized buffer: wrong bf16/fp16 dweight and dbias, caught by the GPU tests).
            with T.Kernel(T.ceildiv(n, fbn), threads=fold.threads) as bx:
                acc_w = T.alloc_fragment((rb, fbn), _ACC)
                acc_b = T.alloc_fragment((rb, fbn), _ACC)
                total_w = T.alloc_fragment((fbn,), _ACC)
                total_b = T.alloc_fragment((fbn,), _ACC)
                T.clear(acc_w)
                T.clear(acc_b)
                for it in T.serial(T.ceildiv(G, rb)):
                    for i, j in T.Parallel(rb, fbn):
                        acc_w[i, j] += T.if_then_else((it * rb + i < G) and (bx * fbn + j < n), P[0, it * rb + i, bx * fbn + j], 0.0)
                    for i, j in T.Parallel(rb, fbn):
                        acc_b[i, j] += T.if_then_else((it * rb + i < G) and (bx * fbn + j < n), P[1, it * rb + i, bx * fbn + j], 0.0)
                T.reduce_sum(acc_w, total_w, dim=0)
                T.reduce_sum(acc_b, total_b, dim=0)
                for j in T.Parallel(fbn):
                    if bx * fbn + j < n:
                        DW[bx * fbn + j] = T.Cast(wdtype, total_w[j])
                        DB[bx * fbn + j] = T.Cast(wdtype, total_b[j])

    # T.prim_func needs an explicit signature per argument list: plain or add_layer_norm's (with
    # or without DH), each with partials P or (single) without.
    if single and rdtype and dh:

        @T.prim_func
        def add_bwd_single(
            DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
            Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC), DH: T.Tensor((M, n), dtype),
            DX: T.Tensor((M, n), dtype), DR: T.Tensor((M, n), rdtype), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
        ):
            body(DY, X, W, Mean, Rstd, DH, DX, DR, None, DW, DB)

        return add_bwd_single
    if single and rdtype:

        @T.prim_func
        def add_bwd_nodh_single(
            DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
            Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
            DX: T.Tensor((M, n), dtype), DR: T.Tensor((M, n), rdtype), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
        ):
            body(DY, X, W, Mean, Rstd, None, DX, DR, None, DW, DB)

        return add_bwd_nodh_single
    if single:

        @T.prim_func
        def bwd_single(
            DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
            Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
            DX: T.Tensor((M, n), dtype), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
        ):
            body(DY, X, W, Mean, Rstd, None, DX, None, None, DW, DB)

        return bwd_single
    if rdtype and dh:

        @T.prim_func
        def add_bwd(
            DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
            Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC), DH: T.Tensor((M, n), dtype),
            DX: T.Tensor((M, n), dtype), DR: T.Tensor((M, n), rdtype), P: T.Tensor((2, G, n), _ACC), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
        ):
            body(DY, X, W, Mean, Rstd, DH, DX, DR, P, DW, DB)

        return add_bwd
    if rdtype:

        @T.prim_func
        def add_bwd_nodh(
            DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
            Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
            DX: T.Tensor((M, n), dtype), DR: T.Tensor((M, n), rdtype), P: T.Tensor((2, G, n), _ACC), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
        ):
            body(DY, X, W, Mean, Rstd, None, DX, DR, P, DW, DB)

        return add_bwd_nodh

    @T.prim_func
    def bwd(
        DY: T.Tensor((M, n), dydtype), X: T.Tensor((M, n), dtype), W: T.Tensor((n,), wdtype),
        Mean: T.Tensor((M,), _ACC), Rstd: T.Tensor((M,), _ACC),
        DX: T.Tensor((M, n), dtype), P: T.Tensor((2, G, n), _ACC), DW: T.Tensor((n,), wdtype), DB: T.Tensor((n,), wdtype),
    ):
        body(DY, X, W, Mean, Rstd, None, DX, None, P, DW, DB)

    return bwd


# (kernel, config, static) that `tileops export` writes and `tileops check` / the compile tests
# build: GPT-2's width from an fp32 residual stream into bf16 (the training example), and a
# 16-bit model's row at Llama width.
REPRESENTATIVE = [
    (layer_norm_fwd, default_config(768, "float32"), dict(n=768, dtype="float32", wdtype="float32", odtype="bfloat16", eps=1e-5)),
    (layer_norm_bwd, default_config(768, "float32", True), dict(n=768, dtype="float32", wdtype="float32", dydtype="bfloat16")),
    (layer_norm_fwd, default_config(4096, "bfloat16"), dict(n=4096, dtype="bfloat16", wdtype="bfloat16", odtype="bfloat16", eps=1e-5)),
    (layer_norm_bwd, default_config(4096, "bfloat16", True), dict(n=4096, dtype="bfloat16", wdtype="bfloat16", dydtype="bfloat16")),
    # add_layer_norm: GPT's fp32 stream plus a bf16 branch; the backward with the stream's gradient
    (layer_norm_fwd, default_config(768, "float32"), dict(n=768, dtype="float32", wdtype="float32", odtype="bfloat16", eps=1e-5, rdtype="bfloat16")),
    (layer_norm_bwd, default_config(768, "float32", True), dict(n=768, dtype="float32", wdtype="float32", dydtype="bfloat16", dh=True, rdtype="bfloat16")),
    # a few rows: the one-CTA backward (no partials, no fold kernel)
    (layer_norm_bwd, default_config(4096, "bfloat16", True), dict(n=4096, dtype="bfloat16", wdtype="bfloat16", dydtype="bfloat16", single=True)),
]
