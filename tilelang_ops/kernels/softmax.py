"""Row softmax / log-softmax over the last dim of an (M, N) tensor, forward and backward.

M (rows) is symbolic, so a new batch size never recompiles; N (row length) is static because it
shapes the schedule: each distinct N compiles once per (kind, dtype, direction). The schedules:

* **rows** — one pass, the row held in registers. A CTA owns `block_m` rows; each row is spread
  over up to `threads` lanes, `vec` contiguous elements (16 bytes) per access. Short rows pack
  many rows per CTA, so rows up to 32 * vec elements reduce inside a warp (shuffles, no barrier);
  mid rows take a whole CTA. The row is padded in registers to a multiple of
  `vec * threads / block_m` with -inf (fwd) / 0 (bwd) so any N compiles (TileLang finds no layout
  for a ragged fragment); only the padding lanes pay for the guard.
  Memory: reads M*N (x, or y and dy), writes M*N.

* **split** — long rows (too long for registers, or > 8192 with < 2 rows per SM) and few of
  them. Each row is cut into chunks of `chunk` elements, one CTA per (row, chunk), so a handful
  of rows still fills 132 SMs. A `stats` kernel writes one fp32 partial per chunk (max and sum
  of exp for the forward, the row dot for the backward); an `apply` kernel folds the row's
  partials and re-reads its chunk to write the output. The re-read hits L2 when the tensor fits
  (H200: 50 MB) and starts from the chunks read last otherwise. Both kernels hold their chunk
  in the input dtype; apply issues its chunk's loads before folding the partials.

* **loop** — long rows and many of them (M >= 4 rows per SM): one CTA per row, several CTAs per
  SM, walking the row twice in `chunk`-sized pieces: each thread keeps its own running (max, sum)
  on the way out (one CTA reduction at the end, no barrier inside the walk), the output
  newest-chunk-first on the way back. The second read hits L2 (132 SMs x a few rows of <= 512 KB),
  so DRAM sees one read and one write, like `rows`.

* **stash** — `loop` (forward) whose first pass also keeps the row in shared memory (<= 200 KB),
  so the second pass reads it there instead of L2: one DRAM read even when a few rows per SM no
  longer fit the L2 (8192 x 50257 bf16 on an H100: 81-84% of a copy against the loop's 66-71%).
  Fewer CTAs per SM (the row's shared memory). A longer row keeps its first chunks there and
  re-reads the rest from L2. The default forward over many rows past the register rows of up to
  112 KB (`LONG_FWD`) and of 200-400 KB (`WIDE_FWD`) on a 132-SM Hopper, in 16-bit.

* **csplit** — `split` in one launch (sm_90+): a thread-block cluster of <= 8 CTAs per row, each
  holding its chunk in registers; partials go through global memory across barrier.cluster
  (release/acquire). One DRAM read, one write, no second launch; a 1-D cluster-major grid, so any
  M. The forward keeps exp(x - chunk max) in fp32 registers: one exp per element. `csplitd`
  exchanges the partials through distributed shared memory (stores into each peer CTA's shared
  memory, one cluster barrier) instead of global memory: no L2 round trip between the reduction
  and the output pass.

* **tma** — forward, long rows: a CTA (or a cluster of n / chunk <= 8 CTAs, partials through
  DSMEM) per row, its chunk brought into shared memory by bulk copies (cp.async.bulk, one thread
  issues them all at once), `stages` sub-chunks on their own mbarriers. Each sub-chunk is reduced
  as it lands: its max, the running max, exp(x - running max) written back over it in the input
  dtype (one exp per element, overlapping the loads still in flight; rounding twice stays within
  one ulp), the per-lane sums rescaled. The output pass only multiplies by one factor per
  sub-chunk. Rows must split into equal 16-byte multiples (n % chunk == 0). Best with many rows:
  several 64 KB rows per SM in different phases keep loads and stores overlapping like a copy.
* **tmaw** — `tma` with per-thread statistics: each thread keeps its own running max and sum over
  the elements it owns (the same ones in the load and the output pass), so a landed sub-chunk is
  reduced in registers (no shuffle, no CTA barrier; TileLang's sync pass is off for it and the
  one barrier placed by hand) and read from shared memory once, converted to fp32 once; exp2 is
  one MUFU op (fast math). The threads' (max, sum) are combined once at the end, one factor per
  (sub-chunk, thread) in the output pass. For few long rows, where the reductions are on the
  critical path (benchmarks/probe_softmax.py --clock: ~0.9 us per 16K elements per SM at one CTA
  per SM; made faster, they only wait longer on the next bulk copy: the read phase is paced by
  DRAM).
* **tmas** — `tmaw` with half the sub-chunks in flight instead of all: the next bulk copy is issued as
  one lands, so sub-chunks land one after another and each one's reduction overlaps the later
  loads (issued all at once they complete nearly together, and the compute follows the last byte).
  Each exp is one FFMA (x log2 e - max log2 e) and one MUFU.EX2.

`loop`, `stash` and `split` move 16-byte vectors at any row length: where rows do not start
16-byte aligned (an odd vocabulary), each row's aligned body is walked through a flat view and its
< 16-byte head and tail are added one element at a time (`_RowWalk`). The other schedules load
such rows one element at a time.

`SoftmaxConfig.min_blocks` sets __launch_bounds__' min CTAs per SM: a register cap (ptxas
otherwise spends registers freely, e.g. a 1024-thread `rows` CTA at 48 registers leaves one CTA
per SM).

`default_config` = MEASURED / MEASURED_LOG (sweep winners, bf16/fp16 on a 132-SM Hopper) ▸
`heuristic_config` (N, M bucket, SM count); `tileops tune` may override it per (N, M bucket)
from `search_space` (SEARCH_SPACE, plus SEARCH_SPACE_SM90 on Hopper). All math in fp32; exp via
exp2 with a log2(e) pre-scale; output rounded once to the input dtype (`tma` softmax keeps its
exps in the input dtype: twice, within one ulp). Semantics match PyTorch: an all -inf row gives NaN, a
+inf gives NaN for its row, NaN propagates.
"""
from dataclasses import dataclass

import tilelang
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


TMA_SCHEDULES = ("tma", "tmaw", "tmas")  # forward; the chunk in shared memory by bulk copies, one kernel
SCHEDULES = ("rows", "loop", "stash", "split", "csplit", "csplitd") + TMA_SCHEDULES
FWD_ONLY = TMA_SCHEDULES + ("stash",)  # forward schedules (the row or chunk in shared memory)
STASH_SMEM_MAX = 200 * 1024  # stash: a row in shared memory (227 KB per CTA on Hopper, less the scratch)


@dataclass(frozen=True)
class SoftmaxConfig:
    schedule: str = "rows"  # one of SCHEDULES (see the module docstring)
    block_m: int = 1  # rows: rows per CTA; threads // block_m lanes share a row
    threads: int = 256
    chunk: int = 0  # loop / split: row elements per chunk, a multiple of threads * vec
    # __launch_bounds__ min blocks per SM (0: unset). Caps registers at 64K / (threads * this) so
    # that many CTAs stay resident: ptxas otherwise spends registers freely (a 1024-thread `rows`
    # CTA at 48 registers leaves 1 CTA per SM).
    min_blocks: int = 0
    # tma: sub-chunks per chunk, each loaded by its own bulk copy and mbarrier, so the reduction
    # of the first starts while the others are still in flight.
    stages: int = 1

    def pass_configs(self) -> dict:
        # tmaw/tmas place their only CTA barrier themselves (before the warps' statistics are
        # read): TileLang's sync pass would add two __syncthreads per re-issued bulk copy, which
        # cost ~0.13 us each at one CTA per SM (session 9's clock probe).
        return {"tl.disable_thread_storage_sync": True} if self.schedule in ("tmaw", "tmas") else {}

    @property
    def partials(self) -> bool:
        """Whether the op hands the kernels per-chunk (max, sum) buffers (split and the cluster
        schedules); rows, loop and the tma family reduce each row inside one launch."""
        return self.schedule in ("split", "csplit", "csplitd")


# Registers per thread: 32 fp32 row values (64 bytes of bf16 loads in flight per thread) keeps
# ptxas under the 64-register cap of a 1024-thread CTA and leaves >= 1024 threads per SM.
_PER_THREAD = 32
_MAX_THREADS = 1024
# Long rows: with >= this many rows per SM, one CTA per row looping over its row (`loop`, re-read
# from L2) keeps every SM busy with several CTAs; with fewer, rows are cut into chunks (`split`)
# so a few rows still fill the GPU.
LOOP_ROWS_PER_SM = 4
# A register row longer than this needs >= 512 threads; with fewer than two such rows per SM one
# wave would leave SMs idle, so the long schedules take over.
ROWS_ALWAYS_UP_TO = 8192
H200_SMS = 132


def _arrays(kind: str, backward: bool) -> int:
    return 2 if (backward or kind == "log_softmax") else 1  # fp32 row fragments live at once


def _row_limit(dtype: str, backward: bool, kind: str) -> int:
    """Longest row kept in registers; longer rows take the loop / split schedules. (log_softmax's
    forward as a 1024-thread register row, session 52: 89% of a copy at 8192 x 32000 but 71% at
    8192 x 20000, where the loop runs at 84-87%: its limit stays at 16384.)"""
    return _MAX_THREADS * _PER_THREAD // _arrays(kind, backward)


# Measured winners, consulted before the heuristic below: (direction, n, M bucket) -> config, for
# 16-bit dtypes (MEASURED: softmax, MEASURED_LOG: log_softmax).
# direction: "fwd" | "bwd"; bucket: "few" (M < 2 rows per SM), "some" (< LOOP_ROWS_PER_SM rows
# per SM), "many" — the same buckets ops/softmax.py resolves plans by. `python -m
# benchmarks.sweep_softmax` (on the GPU) prints the lines to paste here, best config per shape.
MEASURED: dict[tuple[str, int, str], SoftmaxConfig] = {
    # benchmarks/sweep_softmax.py on one H200, 2026-11-30 (bf16, 8M elements unless noted; % of copy_)
    ("fwd", 32768, "few"): SoftmaxConfig("tmas", 1, 256, 32768, 0, 4),  # 256x32768: 94.7-94.9% in turns with tapered/half-step variants (session 10, calls 4-5)
    ("bwd", 32768, "few"): SoftmaxConfig("csplit", 1, 128, 4096, 0),  # 256x32768: 96-100% vs 90%
    ("fwd", 65536, "few"): SoftmaxConfig("tmas", 1, 256, 65536, 0, 4),  # 128x65536: 88.6-88.8% in turns, variants 86.7-88.8 (session 10, calls 4-5)
    ("bwd", 65536, "few"): SoftmaxConfig("csplit", 1, 256, 8192, 0),  # 128x65536: 93% vs 81-84%
    ("bwd", 262144, "few"): SoftmaxConfig("csplit", 1, 512, 32768, 0),  # 32x262144: 75-77% vs 61%
    # fourth session (three sweeps: session 3 call 7, session 4 calls 2 and 3)
    ("fwd", 131072, "few"): SoftmaxConfig("tmas", 1, 128, 32768, 0, 8),  # 64x131072: 76.5% vs csplit 512/16384 66.8% (session 9, call 4)
    ("fwd", 262144, "few"): SoftmaxConfig("tmas", 1, 128, 32768, 0, 8),  # 32x262144: 71.3% vs tmaw 65-67, tma 63-65 (session 8); 76.9% after session 9's changes (call 5)
    ("fwd", 32768, "many"): SoftmaxConfig("tma", 1, 256, 32768, 0, 4),  # 4096x32768: 96% vs 83% (session 7)
    ("bwd", 32768, "many"): SoftmaxConfig("csplit", 1, 128, 4096, 0),  # 4096x32768: 89-90% vs loop 67%
    # `sweep_softmax --vocab` on H100s (132 SMs), session 53 call 2 and session 54 call 1
    ("fwd", 32000, "many"): SoftmaxConfig("stash", 1, 256, 16384),  # 8192x32000: 97% vs rows 90-91%
}

# log_softmax: `python -m benchmarks.sweep_softmax --kind log_softmax` on an H100 (132 SMs, the
# H200's SMs and clocks), 2026-12-06, session 51 calls 1 and 3 (bf16; % of copy_). Until then it kept the
# heuristic's split/loop schedules at these lengths: 0.84-0.91x torch at 256 and 4096 x 32768.
MEASURED_LOG: dict[tuple[str, int, str], SoftmaxConfig] = {
    ("fwd", 32768, "few"): SoftmaxConfig("tmas", 1, 128, 32768, 0, 4),  # 256x32768: 104% vs 69%
    ("bwd", 32768, "few"): SoftmaxConfig("rows", 1, 1024),  # 256x32768: 107% vs 82% (csplit 102%)
    ("fwd", 65536, "few"): SoftmaxConfig("tmas", 1, 256, 65536, 0, 4),  # 128x65536: 96% vs 68%
    ("bwd", 65536, "few"): SoftmaxConfig("csplit", 1, 256, 8192, 0),  # 128x65536: 102% vs 82%
    ("fwd", 32768, "many"): SoftmaxConfig("tma", 1, 256, 32768, 0, 4),  # 4096x32768: 98% vs 71%
    ("bwd", 32768, "many"): SoftmaxConfig("csplit", 1, 128, 4096, 0),  # 4096x32768: 102% vs 78%
    ("fwd", 262144, "few"): SoftmaxConfig("tmas", 1, 128, 32768, 0, 8),  # 32x262144: 85% vs 45%
    # call 3: the lengths call 1 left out
    ("bwd", 262144, "few"): SoftmaxConfig("csplit", 1, 512, 32768, 0),  # 32x262144: 88% vs 69%
    ("fwd", 131072, "few"): SoftmaxConfig("tmas", 1, 128, 65536, 0, 8),  # 64x131072: 91% vs 62% (softmax's 85%)
    ("bwd", 131072, "few"): SoftmaxConfig("csplit", 1, 512, 32768, 0),  # 64x131072: 91% vs 82%
    # 1024 and 32768 x 8192: 98% and 101% vs 85% and 86% (the heuristic's 512 threads)
    ("fwd", 8192, "many"): SoftmaxConfig("rows", 1, 256),
    # `sweep_softmax --kind log_softmax --vocab`, session 54 call 1 (H100)
    ("fwd", 32000, "many"): SoftmaxConfig("stash", 1, 256, 16384),  # 8192x32000: 99% vs loop 86%
}
TABLES = {"softmax": MEASURED, "log_softmax": MEASURED_LOG}
# A backward over many rows too long for registers, at a length no table names (an LM's logits:
# 32000, 128256, 151936 columns), 16-byte vectors: a cluster of up to 8 CTAs per row, 32768
# elements each. 87-102% of a copy against the loop schedule's 61-78%, both kinds (session 52
# call 1, H100). Rows of odd length (no 16-byte vectors) ran it at 16-52%: they keep the loop.
LONG_BWD = SoftmaxConfig("csplit", 1, 512, 32768, 0)
# A forward over many rows too long for registers whose row fits shared memory twice per SM
# (<= STASH_2_PER_SM bytes): `stash`, the second pass from shared memory instead of L2. 8192 x
# 50257 bf16: 81% (softmax) and 84% (log_softmax) of a copy against the loop's 66% and 71%;
# log_softmax at 8192 x 20000: 85% vs 84% (H100s, session 53 call 2 and session 54 call 1).
LONG_FWD = SoftmaxConfig("stash", 1, 512, 8192)
STASH_2_PER_SM = 112 * 1024
# Rows longer than stash's shared memory, up to WIDE_FWD_MAX bytes: one CTA of 1024 threads per
# SM, the row's first 192 KB stashed and the rest (at most half the row) re-read from L2. 4096 x
# 128256 and 2048 x 151936 bf16 on an H200: 70-75% of a copy against the loop's 60-62% and
# csplit's 59-60%, both kinds (session 54 calls 2-3). Rows of 112-200 KB keep the loop: 4096 x
# 65536 ran this config at 66% against the loop's 69-70% (call 3).
WIDE_FWD = SoftmaxConfig("stash", 1, 1024, 16384)
WIDE_FWD_MAX = 2 * STASH_SMEM_MAX


def m_bucket(m: int | None, sms: int = H200_SMS) -> str:
    if m is None:
        return "many"
    return ("few", "some", "many")[(m >= 2 * sms) + (m >= LOOP_ROWS_PER_SM * sms)]


def bucket_rows(bucket: str, sms: int = H200_SMS) -> int:
    """A row count in `bucket` (for tests and cache warm-ups that must reach a bucket's config)."""
    return {"few": 3, "some": 2 * sms + 1, "many": LOOP_ROWS_PER_SM * sms + 1}[bucket]


def default_config(
    n: int, dtype: str, kind: str = "softmax", backward: bool = False, m: int | None = None, sms: int = H200_SMS
) -> SoftmaxConfig:
    """Config for an (m, n) problem (m=None: many rows) on a GPU with `sms` SMs: the kind's
    measured table (`TABLES`), then `LONG_BWD` / `LONG_FWD` / `WIDE_FWD` for long rows over many
    rows, else the heuristic (`heuristic_config`)."""
    if _ESIZE[dtype] == 2 and sms == H200_SMS:  # measured on a 132-SM Hopper
        bucket = m_bucket(m, sms)
        cfg = TABLES[kind].get(("bwd" if backward else "fwd", n, bucket))
        if cfg is not None:
            return cfg
        if backward and bucket == "many" and n > _row_limit(dtype, True, kind) and not _unaligned(n, dtype):
            if fits(LONG_BWD, n, dtype, kind, True):
                return LONG_BWD
        if not backward and bucket == "many" and n > _row_limit(dtype, False, kind):
            row = _stash_len(n, dtype) * _ESIZE[dtype]
            for cfg, least, most in ((LONG_FWD, 0, STASH_2_PER_SM), (WIDE_FWD, STASH_SMEM_MAX, WIDE_FWD_MAX)):
                if least < row <= most and fits(cfg, n, dtype, kind):
                    return cfg
    return heuristic_config(n, dtype, kind, backward, m, sms)


def heuristic_config(
    n: int, dtype: str, kind: str = "softmax", backward: bool = False, m: int | None = None, sms: int = H200_SMS
) -> SoftmaxConfig:
    """Short rows pack a CTA, mid rows own one (`rows`); rows too long for registers, or mid rows
    longer than ROWS_ALWAYS_UP_TO with < 2 rows per SM, go to `loop` (>= LOOP_ROWS_PER_SM rows
    per SM) or `split` (fewer).
    """
    vec = vec_width(n, dtype)
    many = m is None or m >= 2 * sms
    if n <= 1024:
        # Short rows: 128 threads and 128 / tpr rows per CTA, ~2+ vectors per thread; a row lives
        # in n / vec <= 32 lanes of one warp, so its reductions are shuffles only.
        threads = 128
        tpr = 1
        while tpr < 32 and tpr * vec * 2 < n:
            tpr *= 2
        return SoftmaxConfig("rows", block_m=threads // tpr, threads=threads)
    if n <= _row_limit(dtype, backward, kind) and (n <= ROWS_ALWAYS_UP_TO or many):
        # A forward thread holds _PER_THREAD row values (log_softmax also their exps: 2 x 32 fp32,
        # inside fits()' budget); twice the threads for log_softmax measured 2-9% slower at
        # 200 x 8192 and 512 x 16384 and never faster (session 51 call 5, session 52).
        per_thread = _PER_THREAD // 2 if backward else _PER_THREAD
        threads = 128
        while threads < _MAX_THREADS and threads * per_thread < n:
            threads *= 2
        return SoftmaxConfig("rows", block_m=1, threads=threads)
    if m is None or m >= LOOP_ROWS_PER_SM * sms:
        # 512 threads over 8192-element chunks: faster than 256 threads over 4096 or 8192 in all
        # 16 cases of language-model logits (4 row lengths, 32000-151936, x fwd/bwd x both kinds;
        # +0.7 to +14 points of a copy, session 52 call 1)
        return SoftmaxConfig("loop", threads=512, chunk=8192)
    threads = 256
    return SoftmaxConfig("split", threads=threads, chunk=threads * max(_PER_THREAD // _arrays(kind, backward), vec))


def fits(cfg: SoftmaxConfig, n: int, dtype: str, kind: str = "softmax", backward: bool = False) -> bool:
    """Whether `cfg` is a sensible candidate for rows of length n (registers, not spills)."""
    vec = vec_width(n, dtype)
    if cfg.schedule == "rows":
        k, lanes, _ = _row_tile(cfg, n, dtype)
        idle = lanes * vec >= 2 * n  # more than half of a row's lanes would hold only padding
        held = k * vec * _arrays(kind, backward)  # fp32 registers
        return cfg.block_m <= cfg.threads and not idle and held <= 2 * _PER_THREAD
    if cfg.schedule in TMA_SCHEDULES:  # forward; equal chunks and sub-chunks of whole vectors, in shared memory
        w = cfg.threads * vec
        return (
            not backward
            and cfg.chunk <= n
            and n % cfg.chunk == 0
            and n // cfg.chunk <= CLUSTER_MAX
            and cfg.chunk % cfg.stages == 0
            and (cfg.chunk // cfg.stages) % w == 0
            and cfg.block_m == 1
            and cfg.chunk * _ESIZE[dtype] <= TMA_SMEM_MAX
        )
    if cfg.schedule == "stash" and (backward or cfg.chunk * _ESIZE[dtype] > STASH_SMEM_MAX):
        return False  # forward; the row (or its first chunks) in shared memory
    if cfg.schedule in ("loop", "stash", "split"):
        vec = _full_vec(dtype)  # whole vectors at any length (`_RowWalk`)
    ok = cfg.chunk % (cfg.threads * vec) == 0 and cfg.chunk < 2 * n
    schedule = _cluster_base(cfg.schedule)[0]
    if schedule == "csplit":  # a cluster per row; the chunk held in registers (input dtype)
        ept = cfg.chunk // cfg.threads
        held = ept * _arrays(kind, backward) * _ESIZE[dtype] // 4 + (ept if kind == "softmax" and not backward else 0)  # + fp32 exp
        ok = ok and _split_chunks(n, cfg.chunk) <= CLUSTER_MAX and held <= 2 * _PER_THREAD
    return ok


def _cluster_base(schedule: str) -> tuple[str, bool]:
    """("csplit", True) for "csplitd": the partials go through DSMEM instead of global memory."""
    if schedule == "csplitd":
        return "csplit", True
    return schedule, False


def schedule_kernels(cfg: SoftmaxConfig, n: int, dtype: str, kind: str, backward: bool) -> list:
    """(KernelDef, config, static) that a config launches, in order."""
    st = {"n": n, "dtype": dtype, "kind": kind}
    if cfg.schedule == "rows":
        return [(rows_bwd if backward else rows_fwd, cfg, st)]
    if cfg.schedule == "loop":
        return [(loop_bwd if backward else loop_fwd, cfg, st)]
    if cfg.schedule == "stash":
        assert not backward, "stash is a forward schedule"
        return [(loop_fwd, cfg, st)]
    if cfg.schedule in TMA_SCHEDULES:
        assert not backward, "tma is a forward schedule"
        return [(tma_fwd, cfg, st)]
    base, d = _cluster_base(cfg.schedule)
    if base == "csplit":
        return [(csplit, cfg, {**st, "backward": backward, "dsmem": d})]
    return [(split_stats, cfg, {**st, "backward": backward}), (split_apply, cfg, {**st, "backward": backward})]


SEARCH_SPACE = [
    SoftmaxConfig("rows", b, t) for t in (128, 256, 512, 1024) for b in (1, 2, 4, 8, 16, 32, 64) if b <= t // 4 or b == 1
] + [SoftmaxConfig(s, 1, t, c) for s in ("loop", "split") for t in (128, 256, 512) for c in (4096, 8192, 16384) if c >= 8 * t]
# Hopper only (thread-block clusters, bulk copies, stash's shared-memory budget): what the MEASURED
# long-row defaults are made of.
SEARCH_SPACE_SM90 = [
    SoftmaxConfig(s, 1, t, c) for s in ("csplit", "csplitd") for t, c in ((128, 4096), (256, 8192), (512, 16384), (512, 32768))
] + [SoftmaxConfig("stash", 1, t, c) for t in (256, 512, 1024) for c in (8192, 16384)] + [
    SoftmaxConfig(sc, 1, t, c, 0, st)
    # (tmaw/tmas kernels unroll every sub-chunk: 15-40 s of nvcc each, so only the measured stage counts)
    for sc, stages in (("tma", (2, 4)), ("tmaw", (4,)), ("tmas", (4, 8))) for t in (128, 256, 512) for c in (16384, 32768, 65536) for st in stages
]


def search_space(n: int, dtype: str, kind: str, backward: bool, sm: int) -> list[SoftmaxConfig]:
    """The configs `tileops tune` times for rows of n on a GPU of compute capability sm (e.g. 90)."""
    space = SEARCH_SPACE + (SEARCH_SPACE_SM90 if sm >= 90 else [])
    return [c for c in space if fits(c, n, dtype, kind, backward)]


def _row_tile(config: SoftmaxConfig, n: int, dtype: str) -> tuple[int, int, int]:
    """(k, lanes, w): a row is k slices of w = lanes * vec elements, slice kk at kk * w."""
    lanes = max(config.threads // config.block_m, 1)
    w = lanes * vec_width(n, dtype)
    return -(-n // w), lanes, w


def _split_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _chunk_tile(config: SoftmaxConfig, n: int, dtype: str, vec: int = 0) -> tuple[int, int, int]:
    """(nc, kc, w) of the chunked schedules: a row is nc chunks of `config.chunk` elements, a chunk
    kc slices of w = threads * vec elements (each thread loads vec contiguous per slice; vec
    defaults to vec_width(n, dtype))."""
    w = config.threads * (vec or vec_width(n, dtype))
    return _split_chunks(n, config.chunk), config.chunk // w, w


# ---------------------------------------------------------------------------------------------
# rows: one pass, rows in registers
# ---------------------------------------------------------------------------------------------
# Fragments are (k, block_m, w): TileLang gives the innermost dim to the lanes (vec contiguous
# elements each) and the next one to the rows, so a short row lives in one warp and a mid row in
# the CTA. Reducing dim 0 first is thread-local; the lane reduce then runs once per row.
@kernel("softmax", "softmax_rows_fwd")
def rows_fwd(config: SoftmaxConfig, n: int, dtype: str, kind: str):
    M = T.dynamic("M")
    bm, threads = config.block_m, config.threads
    k, _, w = _row_tile(config, n, dtype)
    log = kind == "log_softmax"

    @T.prim_func
    def fwd(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), dtype)):
        with T.Kernel(T.ceildiv(M, bm), threads=threads) as bx:
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            x = T.alloc_fragment((k, bm, w), _ACC)
            part = T.alloc_fragment((bm, w), _ACC)
            mx = T.alloc_fragment((bm,), _ACC)
            s = T.alloc_fragment((bm,), _ACC)
            for kk, i, j in T.Parallel(k, bm, w):  # reads bm*n
                x[kk, i, j] = T.if_then_else(
                    (bx * bm + i < M) and (kk * w + j < n), T.Cast(_ACC, X[bx * bm + i, kk * w + j]), -T.infinity(_ACC)
                )
            T.reduce_max(x, part, dim=0)
            T.reduce_max(part, mx, dim=1)
            if log:
                e = T.alloc_fragment((k, bm, w), _ACC)
                for kk, i, j in T.Parallel(k, bm, w):
                    e[kk, i, j] = T.exp2((x[kk, i, j] - mx[i]) * LOG2E)
                T.reduce_sum(e, part, dim=0)
                T.reduce_sum(part, s, dim=1)
                for i in T.Parallel(bm):
                    s[i] = mx[i] + T.log2(s[i]) * LN2  # logsumexp
                for kk, i, j in T.Parallel(k, bm, w):  # writes bm*n
                    if (bx * bm + i < M) and (kk * w + j < n):
                        Y[bx * bm + i, kk * w + j] = T.Cast(dtype, x[kk, i, j] - s[i])
            else:
                for kk, i, j in T.Parallel(k, bm, w):
                    x[kk, i, j] = T.exp2((x[kk, i, j] - mx[i]) * LOG2E)
                T.reduce_sum(x, part, dim=0)
                T.reduce_sum(part, s, dim=1)
                for i in T.Parallel(bm):
                    s[i] = 1.0 / s[i]
                for kk, i, j in T.Parallel(k, bm, w):  # writes bm*n
                    if (bx * bm + i < M) and (kk * w + j < n):
                        Y[bx * bm + i, kk * w + j] = T.Cast(dtype, x[kk, i, j] * s[i])

    return fwd


@kernel("softmax", "softmax_rows_bwd")
def rows_bwd(config: SoftmaxConfig, n: int, dtype: str, kind: str):
    """softmax: dx = y * (dy - sum(dy * y));  log_softmax: dx = dy - exp(y) * sum(dy)."""
    M = T.dynamic("M")
    bm, threads = config.block_m, config.threads
    k, _, w = _row_tile(config, n, dtype)
    log = kind == "log_softmax"

    @T.prim_func
    def bwd(DY: T.Tensor((M, n), dtype), Yt: T.Tensor((M, n), dtype), DX: T.Tensor((M, n), dtype)):
        with T.Kernel(T.ceildiv(M, bm), threads=threads) as bx:
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            dy = T.alloc_fragment((k, bm, w), _ACC)
            y = T.alloc_fragment((k, bm, w), _ACC)
            part = T.alloc_fragment((bm, w), _ACC)
            dot = T.alloc_fragment((bm,), _ACC)
            # One load per loop: with both in one loop TileLang vectorized them to 8 bytes, not 16.
            for kk, i, j in T.Parallel(k, bm, w):  # reads 2*bm*n
                dy[kk, i, j] = T.if_then_else(
                    (bx * bm + i < M) and (kk * w + j < n), T.Cast(_ACC, DY[bx * bm + i, kk * w + j]), 0.0
                )
            for kk, i, j in T.Parallel(k, bm, w):
                y[kk, i, j] = T.if_then_else(
                    (bx * bm + i < M) and (kk * w + j < n), T.Cast(_ACC, Yt[bx * bm + i, kk * w + j]), 0.0
                )
            if log:
                T.reduce_sum(dy, part, dim=0)
            else:
                p = T.alloc_fragment((k, bm, w), _ACC)
                for kk, i, j in T.Parallel(k, bm, w):
                    p[kk, i, j] = dy[kk, i, j] * y[kk, i, j]
                T.reduce_sum(p, part, dim=0)
            T.reduce_sum(part, dot, dim=1)
            for kk, i, j in T.Parallel(k, bm, w):  # writes bm*n
                if (bx * bm + i < M) and (kk * w + j < n):
                    if log:
                        DX[bx * bm + i, kk * w + j] = T.Cast(dtype, dy[kk, i, j] - T.exp2(y[kk, i, j] * LOG2E) * dot[i])
                    else:
                        DX[bx * bm + i, kk * w + j] = T.Cast(dtype, y[kk, i, j] * (dy[kk, i, j] - dot[i]))

    return bwd


def _lane_dot(kc: int, w: int, log: bool):
    """part[j] += the lane's sum over its kc slices of dy * y (softmax) or dy (log_softmax): the
    backward's row dot, thread-local until the caller's one CTA reduction."""

    @T.macro
    def acc(a, b, part):
        for j in T.Parallel(w):
            for kk in T.serial(kc):
                if log:
                    part[j] = part[j] + T.Cast(_ACC, a[kk, j])
                else:
                    part[j] = part[j] + T.Cast(_ACC, a[kk, j]) * T.Cast(_ACC, b[kk, j])

    return acc


# ---------------------------------------------------------------------------------------------
# Rows that break 16-byte alignment (loop and split): an aligned body in whole vectors, the ends
# one element at a time.
# ---------------------------------------------------------------------------------------------
def _full_vec(dtype: str) -> int:
    return 16 // _ESIZE[dtype]


def _unaligned(n: int, dtype: str) -> bool:
    """Rows of n elements do not all start 16-byte aligned (GPT-2's 50257 columns)."""
    return vec_width(n, dtype) < _full_vec(dtype)


class _RowWalk:
    """Where element e (0 <= e < n rounded up to chunks) of row `row`'s walk lives, for the loop
    and split schedules. A row length that keeps rows 16-byte aligned indexes the (M, n) tensor
    as is. Other lengths (an odd vocabulary such as GPT-2's 50257) would load one element at a
    time: there the walk covers the row's aligned body of `nv` whole vectors through a flat view,
    and the kernels add the < 16 bytes before and after it (head, tail) one element at a time
    (`end_ok`, `end_at`). Body loads clamp to the row's last vector, so a masked-out lane still
    reads inside the row: without TileLang's bounds guards (`_walk_pass_configs`: it cannot prove
    the flat view's indices in bounds, and its guards would split every vector load back into
    elements) a masked load is hoisted out of its select."""

    def __init__(self, row, n: int, dtype: str, M):
        self.odd = _unaligned(n, dtype)
        self.row, self.n, self.M, self.fv = row, n, M, _full_vec(dtype)
        if self.odd:
            r0 = T.Cast("int64", row) * n  # flat start; M * n may pass 2**31
            self.a0 = T.floordiv(r0 + (self.fv - 1), self.fv)  # first whole vector, in vectors
            self.head = T.Cast("int32", self.a0 * self.fv - r0)
            self.nv = T.Cast("int32", T.floordiv(r0 + n, self.fv) - self.a0)
            self.tail = n - self.head - self.nv * self.fv
            self.r0 = r0

    def view(self, buf):
        return T.view(buf, (self.M * self.n,)) if self.odd else buf

    def inside(self, e):
        return T.floordiv(e, self.fv) < self.nv if self.odd else e < self.n

    def at(self, e):
        if not self.odd:
            return self.row, e
        return (self.a0 + T.min(T.floordiv(e, self.fv), self.nv - 1)) * self.fv + T.floormod(e, self.fv)

    def end_ok(self, j):
        """Slot j < 2 * fv of the row's unaligned ends holds an element: j < fv the head's,
        fv <= j < 2 fv the tail's."""
        return T.if_then_else(j < self.fv, j < self.head, j - self.fv < self.tail)

    def end_at(self, j):
        return self.r0 + T.if_then_else(j < self.fv, j, self.head + self.nv * self.fv + j - self.fv)


def _walk_pass_configs(config: SoftmaxConfig, n: int, dtype: str, kind: str, backward: bool = False) -> dict:
    """Unaligned rows: no TileLang bounds guards, the walk's indices stay in the row by
    construction (`_RowWalk`). Aligned rows keep them: they keep a masked load inside its branch."""
    return {"tl.disable_safe_memory_legalize": True} if _unaligned(n, dtype) else {}


@T.macro
def _fwd_out(Y, i, x, m, s, dtype: str, log: bool):
    """Y[i] = x - s (log_softmax: s = log-sum-exp) or exp(x - m) * s (softmax: s = 1 / sum)."""
    if log:
        Y[i] = T.Cast(dtype, T.Cast(_ACC, x) - s)
    else:
        Y[i] = T.Cast(dtype, T.exp2((T.Cast(_ACC, x) - m) * LOG2E) * s)


@T.macro
def _bwd_out(DY, Yt, DX, i, dot, dtype: str, log: bool):
    """dx = dy - exp(y) * dot (log_softmax: dot = sum dy) or y * (dy - dot) (softmax: dot = dy . y).
    Takes buffers and an index, not loaded values: with values, the macro bound them to locals
    and the fp32 loop_bwd / split_apply code changed (same math, not re-run on a GPU)."""
    if log:
        DX[i] = T.Cast(dtype, T.Cast(_ACC, DY[i]) - T.exp2(T.Cast(_ACC, Yt[i]) * LOG2E) * dot)
    else:
        DX[i] = T.Cast(dtype, T.Cast(_ACC, Yt[i]) * (T.Cast(_ACC, DY[i]) - dot))


def _dot_term(DY, Yt, i, log: bool):
    """Element i's term of the backward's row dot: dy (log_softmax) or dy * y (softmax)."""
    return T.Cast(_ACC, DY[i]) if log else T.Cast(_ACC, DY[i]) * T.Cast(_ACC, Yt[i])


# ---------------------------------------------------------------------------------------------
# split: long rows, one CTA per (row, chunk); stats then apply
# ---------------------------------------------------------------------------------------------
@kernel("softmax", "softmax_split_stats", static_pass_configs=_walk_pass_configs)
def split_stats(config: SoftmaxConfig, n: int, dtype: str, kind: str, backward: bool):
    """Per-chunk partials. fwd: P0 = chunk max, P1 = sum exp(x - max) (0 for an all -inf chunk).
    bwd: P0 = sum(dy * y) (softmax) or sum(dy) (log_softmax); P1 unused. Rows that break 16-byte
    alignment: chunks of the aligned body (`_RowWalk`), the row's ends in chunk 0's partial."""
    M = T.dynamic("M")
    c, threads = config.chunk, config.threads
    nc, kc, w = _chunk_tile(config, n, dtype, _full_vec(dtype))
    log = kind == "log_softmax"

    @T.prim_func
    def stats(
        A: T.Tensor((M, n), dtype),  # fwd: x; bwd: dy
        B: T.Tensor((M, n), dtype),  # fwd: unused (x again); bwd: y
        P0: T.Tensor((M, nc), _ACC),
        P1: T.Tensor((M, nc), _ACC),
    ):
        with T.Kernel(M, nc, threads=threads) as (row, ch):
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            rw = _RowWalk(row, n, dtype, M)
            A = rw.view(A)  # the same tensor; flat for unaligned rows
            B = rw.view(B)
            base = ch * c
            ends = ch == 0  # unaligned rows: this CTA also takes the row's ends (read under `if rw.odd`)
            # (kc, w): w = threads * vec lanes' worth, so dim 1 is spread over the CTA and each
            # thread folds its kc vectors serially (no fp32 copy of the chunk in registers).
            a = T.alloc_fragment((kc, w), dtype)
            part = T.alloc_fragment((w,), _ACC)
            r0 = T.alloc_fragment((1,), _ACC)
            if backward:
                bb = T.alloc_fragment((kc, w), dtype)
                for kk, j in T.Parallel(kc, w):  # reads c (2c for softmax)
                    a[kk, j] = T.if_then_else(rw.inside(base + kk * w + j), A[rw.at(base + kk * w + j)], T.Cast(dtype, 0.0))
                if not log:
                    for kk, j in T.Parallel(kc, w):
                        bb[kk, j] = T.if_then_else(rw.inside(base + kk * w + j), B[rw.at(base + kk * w + j)], T.Cast(dtype, 0.0))
                for j in T.Parallel(w):
                    part[j] = 0.0
                _lane_dot(kc, w, log)(a, bb, part)
                if rw.odd:
                    for j in T.Parallel(w):
                        if ends and rw.end_ok(j):
                            part[j] = part[j] + _dot_term(A, B, rw.end_at(j), log)
                T.reduce_sum(part, r0, dim=0)
                P0[row, ch] = r0[0]
            else:
                r1 = T.alloc_fragment((1,), _ACC)
                for kk, j in T.Parallel(kc, w):  # reads c
                    a[kk, j] = T.if_then_else(
                        rw.inside(base + kk * w + j), A[rw.at(base + kk * w + j)], T.Cast(dtype, -T.infinity(_ACC))
                    )
                for j in T.Parallel(w):
                    part[j] = -T.infinity(_ACC)
                    for kk in T.serial(kc):
                        part[j] = T.max(part[j], T.Cast(_ACC, a[kk, j]))
                if rw.odd:
                    for j in T.Parallel(w):
                        if ends and rw.end_ok(j):
                            part[j] = T.max(part[j], T.Cast(_ACC, A[rw.end_at(j)]))
                T.reduce_max(part, r0, dim=0)
                # An all -inf chunk must contribute sum 0, not NaN (-inf - -inf): shift by 0 there.
                for j in T.Parallel(w):
                    part[j] = 0.0
                    for kk in T.serial(kc):
                        part[j] = part[j] + T.exp2(
                            (T.Cast(_ACC, a[kk, j]) - _safe(r0[0])) * LOG2E
                        )
                if rw.odd:
                    for j in T.Parallel(w):
                        if ends and rw.end_ok(j):
                            part[j] = part[j] + T.exp2((T.Cast(_ACC, A[rw.end_at(j)]) - _safe(r0[0])) * LOG2E)
                T.reduce_sum(part, r1, dim=0)
                P0[row, ch] = r0[0]
                P1[row, ch] = r1[0]

    return stats


@kernel("softmax", "softmax_split_apply", static_pass_configs=_walk_pass_configs)
def split_apply(config: SoftmaxConfig, n: int, dtype: str, kind: str, backward: bool):
    """Fold the row's partials (nc scalars, read by every thread) and write the chunk's output
    (unaligned rows: chunk 0's CTA also writes the row's ends)."""
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
        with T.Kernel(M, nc, threads=threads) as (row, rch):
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            rw = _RowWalk(row, n, dtype, M)
            A = rw.view(A)  # the same tensor; flat for unaligned rows
            B = rw.view(B)
            O = rw.view(O)
            # CTAs dispatch chunk-major; start from the chunks `stats` read last, still in L2.
            base = (nc - 1 - rch) * c
            ends = rch == nc - 1  # unaligned rows: chunk 0 also writes the row's ends (read under `if rw.odd`)
            acc0 = T.alloc_var(_ACC)
            acc1 = T.alloc_var(_ACC)
            a = T.alloc_fragment((c,), dtype)
            # The chunk's loads go out first, so their latency overlaps the partials' fold.
            for j in T.Parallel(c):
                a[j] = T.if_then_else(rw.inside(base + j), A[rw.at(base + j)], T.Cast(dtype, 0.0))
            if backward:
                b = T.alloc_fragment((c,), dtype)
                for j in T.Parallel(c):
                    b[j] = T.if_then_else(rw.inside(base + j), B[rw.at(base + j)], T.Cast(dtype, 0.0))
                acc0 = 0.0
                for k in T.serial(nc):
                    acc0 = acc0 + P0[row, k]
                for j in T.Parallel(c):  # reads 2*c, writes c
                    if rw.inside(base + j):
                        if log:
                            O[rw.at(base + j)] = T.Cast(dtype, T.Cast(_ACC, a[j]) - T.exp2(T.Cast(_ACC, b[j]) * LOG2E) * acc0)
                        else:
                            O[rw.at(base + j)] = T.Cast(dtype, T.Cast(_ACC, b[j]) * (T.Cast(_ACC, a[j]) - acc0))
                if rw.odd:
                    for j in T.Parallel(2 * rw.fv):
                        if ends and rw.end_ok(j):
                            _bwd_out(A, B, O, rw.end_at(j), acc0, dtype, log)
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
                    if rw.inside(base + j):
                        if log:
                            O[rw.at(base + j)] = T.Cast(dtype, T.Cast(_ACC, a[j]) - acc1)
                        else:
                            O[rw.at(base + j)] = T.Cast(dtype, T.exp2((T.Cast(_ACC, a[j]) - acc0) * LOG2E) * acc1)
                if rw.odd:
                    for j in T.Parallel(2 * rw.fv):
                        if ends and rw.end_ok(j):
                            _fwd_out(O, rw.end_at(j), A[rw.end_at(j)], acc0, acc1, dtype, log)

    return apply


# ---------------------------------------------------------------------------------------------
# csplit: `split` in one launch. A thread-block cluster of nc CTAs owns a row (nc <= 8, the
# portable cluster size); each CTA holds its chunk in registers, publishes its partial to global
# P0/P1, meets the cluster at barrier.cluster (arrive = release, wait = acquire: the peers'
# partials are visible after it), folds the row's partials and writes its chunk from registers.
# DRAM sees one read and one write. The grid is 1-D (cluster-major), so any M fits.
# Forward softmax keeps exp(x - chunk max) in fp32 registers and rescales it after the fold: one
# exp per element (MUFU throughput is ~1/4 of a copy's time at 8M elements, paid twice otherwise).
# ---------------------------------------------------------------------------------------------
CLUSTER_MAX = 8
TMA_SMEM_MAX = 192 * 1024  # tma: a chunk in shared memory (227 KB per CTA on Hopper, less the scratch)


def _safe(m):
    """The shift for a running max: 0 while it is -inf, so -inf - -inf never makes a NaN."""
    return T.if_then_else(m == -T.infinity(_ACC), 0.0, m)


@T.macro
def _push(mine, peers, r0, r1, ch, nc: int):
    """Every CTA of the cluster gets this chunk's (r0, r1) in its `peers[ch]` (DSMEM stores), then
    the cluster barrier (release/acquire) makes all of them visible: no global-memory round trip.
    Needs a cluster_arrive_relaxed() earlier in the kernel (the peers must have started)."""
    if T.get_thread_binding() == 0:
        mine[0] = r0[0]
        mine[1] = r1[0]
    T.sync_threads()
    T.cluster_wait()
    for k in T.serial(nc):
        T.copy_cluster(mine, peers[ch, :], dst_block=k)
    T.cluster_arrive()
    T.cluster_wait()


@kernel("softmax", "softmax_csplit", min_sm=90)
def csplit(config: SoftmaxConfig, n: int, dtype: str, kind: str, backward: bool, dsmem: bool = False):
    M = T.dynamic("M")
    c, threads = config.chunk, config.threads
    nc, kc, w = _chunk_tile(config, n, dtype)
    assert nc <= CLUSTER_MAX, (n, c)
    log = kind == "log_softmax"

    @T.prim_func
    def main(
        A: T.Tensor((M, n), dtype),  # fwd: x; bwd: dy
        B: T.Tensor((M, n), dtype),  # fwd: unused; bwd: y
        P0: T.Tensor((M, nc), _ACC),
        P1: T.Tensor((M, nc), _ACC),
        O: T.Tensor((M, n), dtype),
    ):
        with T.ClusterKernel(M * nc, cluster_dims=(nc, 1, 1), threads=threads) as bx:
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            row = bx // nc
            ch = bx % nc
            base = ch * c
            a = T.alloc_fragment((kc, w), dtype)
            part = T.alloc_fragment((w,), _ACC)
            r0 = T.alloc_fragment((1,), _ACC)
            acc0 = T.alloc_var(_ACC)
            acc1 = T.alloc_var(_ACC)
            if dsmem:
                mine = T.alloc_shared((2,), _ACC)
                peers = T.alloc_shared((nc, 2), _ACC, scope="shared")  # static: never aliased with other scratch (peers write it remotely)
                T.cluster_arrive_relaxed()  # paired with the wait before the DSMEM stores
            if backward:
                bb = T.alloc_fragment((kc, w), dtype)
                for kk, j in T.Parallel(kc, w):  # reads 2c
                    a[kk, j] = T.if_then_else(base + kk * w + j < n, A[row, base + kk * w + j], T.Cast(dtype, 0.0))
                for kk, j in T.Parallel(kc, w):
                    bb[kk, j] = T.if_then_else(base + kk * w + j < n, B[row, base + kk * w + j], T.Cast(dtype, 0.0))
                for j in T.Parallel(w):
                    part[j] = 0.0
                _lane_dot(kc, w, log)(a, bb, part)
                T.reduce_sum(part, r0, dim=0)
                if dsmem:
                    _push(mine, peers, r0, r0, ch, nc)
                    acc0 = 0.0
                    for k in T.serial(nc):
                        acc0 = acc0 + peers[k, 0]
                else:
                    P0[row, ch] = r0[0]
                    T.sync_threads()
                    T.cluster_sync()
                    T.sync_threads()
                    acc0 = 0.0
                    for k in T.serial(nc):
                        acc0 = acc0 + P0[row, k]
                for kk, j in T.Parallel(kc, w):  # writes c
                    if base + kk * w + j < n:
                        if log:
                            O[row, base + kk * w + j] = T.Cast(
                                dtype, T.Cast(_ACC, a[kk, j]) - T.exp2(T.Cast(_ACC, bb[kk, j]) * LOG2E) * acc0
                            )
                        else:
                            O[row, base + kk * w + j] = T.Cast(dtype, T.Cast(_ACC, bb[kk, j]) * (T.Cast(_ACC, a[kk, j]) - acc0))
            else:
                r1 = T.alloc_fragment((1,), _ACC)
                for kk, j in T.Parallel(kc, w):  # reads c
                    a[kk, j] = T.if_then_else(
                        base + kk * w + j < n, A[row, base + kk * w + j], T.Cast(dtype, -T.infinity(_ACC))
                    )
                for j in T.Parallel(w):
                    part[j] = -T.infinity(_ACC)
                    for kk in T.serial(kc):
                        part[j] = T.max(part[j], T.Cast(_ACC, a[kk, j]))
                T.reduce_max(part, r0, dim=0)
                if not log:
                    e = T.alloc_fragment((kc, w), _ACC)
                    for kk, j in T.Parallel(kc, w):  # an all -inf chunk: e = 0, sum 0, not NaN
                        e[kk, j] = T.exp2((T.Cast(_ACC, a[kk, j]) - _safe(r0[0])) * LOG2E)
                for j in T.Parallel(w):
                    part[j] = 0.0
                    for kk in T.serial(kc):
                        if log:
                            part[j] = part[j] + T.exp2((T.Cast(_ACC, a[kk, j]) - _safe(r0[0])) * LOG2E)
                        else:
                            part[j] = part[j] + e[kk, j]
                T.reduce_sum(part, r1, dim=0)
                if dsmem:
                    _push(mine, peers, r0, r1, ch, nc)
                    acc0 = -T.infinity(_ACC)
                    for k in T.serial(nc):
                        acc0 = T.max(acc0, peers[k, 0])
                    acc1 = 0.0
                    for k in T.serial(nc):  # NaN only for an all -inf row, like PyTorch
                        acc1 = acc1 + peers[k, 1] * T.exp2((peers[k, 0] - acc0) * LOG2E)
                else:
                    P0[row, ch] = r0[0]
                    P1[row, ch] = r1[0]
                    T.sync_threads()
                    T.cluster_sync()
                    T.sync_threads()
                    acc0 = -T.infinity(_ACC)
                    for k in T.serial(nc):
                        acc0 = T.max(acc0, P0[row, k])
                    acc1 = 0.0
                    for k in T.serial(nc):  # NaN only for an all -inf row, like PyTorch
                        acc1 = acc1 + P1[row, k] * T.exp2((P0[row, k] - acc0) * LOG2E)
                if log:
                    acc1 = acc0 + T.log2(acc1) * LN2
                    for kk, j in T.Parallel(kc, w):  # writes c
                        if base + kk * w + j < n:
                            O[row, base + kk * w + j] = T.Cast(dtype, T.Cast(_ACC, a[kk, j]) - acc1)
                else:
                    # e was shifted by this chunk's max: rescale to the row's and normalise at once
                    acc1 = T.exp2((_safe(r0[0]) - acc0) * LOG2E) / acc1
                    for kk, j in T.Parallel(kc, w):  # writes c
                        if base + kk * w + j < n:
                            O[row, base + kk * w + j] = T.Cast(dtype, e[kk, j] * acc1)

    return main


# ---------------------------------------------------------------------------------------------
# tma: the chunk arrives by bulk copies, sub-chunk by sub-chunk, and is reduced as it lands. At
# 8M elements every schedule is one wave (read everything, reduce, write everything); here the
# loads are all in flight from the first instruction and the exps of the sub-chunks that landed
# overlap the ones still arriving, so only the last sub-chunk's work and the cluster exchange
# stand between the read and the write.
# ---------------------------------------------------------------------------------------------
def _tma_tile(config: SoftmaxConfig, n: int, dtype: str) -> tuple[int, int, int, int]:
    """(nc, sub, ks, w): nc chunks per row, `stages` sub-chunks of `sub` elements per chunk, each
    ks slices of w = threads * vec (one 16-byte vector per thread per slice)."""
    w = config.threads * vec_width(n, dtype)
    sub = config.chunk // config.stages
    return n // config.chunk, sub, sub // w, w


@T.macro
def _tma_issue(X, a, bars, row, base, sub: int, first: int, count: int):
    """Bulk copies of sub-chunks first .. first+count-1 of this CTA's chunk into `a`, each on its
    own mbarrier (one elected thread issues them). T.tma_copy only adds the expected bytes, so
    every thread then arrives (the barriers count the CTA's threads; the issuing thread's arrive
    follows its expect_tx, so no barrier can complete before its bytes are expected)."""
    for s in T.serial(first, first + count):
        T.tma_copy(X[row, base + s * sub : base + (s + 1) * sub], a[s, :], barrier=bars[s])
    for s in T.serial(first, first + count):
        T.mbarrier_arrive(bars[s])


def _tma_prim_func(body, M, n: int, dtype: str, nc: int, threads: int, clocks: int = 0):
    """The prim_func of a tma-family forward: a CTA per row, or a cluster of nc CTAs per row.
    clocks > 0 (probe): a third tensor of `clocks` clock64() stamps per CTA."""
    cluster = (nc, 1, 1) if nc > 1 else None
    if clocks:

        @T.prim_func
        def fwd(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), dtype), C: T.Tensor((M * nc, clocks), "int64")):
            with T.Kernel(M * nc, threads=threads, cluster_dims=cluster) as bx:
                body(X, Y, bx, C)

    else:

        @T.prim_func
        def fwd(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), dtype)):
            with T.Kernel(M * nc, threads=threads, cluster_dims=cluster) as bx:
                body(X, Y, bx)

    return fwd


@T.macro
def _tma_issue_flat(X, a, bars, row, base, sub: int, first: int, count: int):
    """`_tma_issue` into a flat chunk buffer `a`, unrolled by Python (`tuple(range())`; range()
    would become a TIR loop): what tmaw/tmas were measured and tested with (session 10). `tma`
    keeps its (stages, sub) buffer and TIR loop."""
    for s in tuple(range(first, first + count)):
        T.tma_copy(X[row, base + s * sub : base + (s + 1) * sub], a[s * sub : (s + 1) * sub], barrier=bars[s])
    for s in tuple(range(first, first + count)):
        T.mbarrier_arrive(bars[s])


def _tma_warp_fwd(config: SoftmaxConfig, n: int, dtype: str, kind: str, M, nc: int, sub: int, ks: int, w: int, clock: bool = False):
    """`tmaw`: the `tma` kernel with per-thread statistics. Each thread keeps its own running max
    and sum over the vectors it owns (the same elements in the load and the output pass), so a
    landed sub-chunk is reduced in registers only: no shuffle, no CTA barrier. Its elements are
    read from shared memory once (held in fp32 registers for the max, then the exps). At the end
    the threads' (max, sum) fold within each warp (shuffles), the warps' through shared memory
    (one CTA barrier), then the cluster's as in `tma`.

    clock=True (benchmarks/probe_softmax.py only): thread 0 stamps clock64() into C[bx, :] at
    the start, as each sub-chunk lands and is reduced, after the combine and at the end."""
    c, threads, stages = config.chunk, config.threads, config.stages
    clocks = 2 * stages + 3 if clock else 0
    nw, vec = threads // 32, w // threads  # warps; elements a thread owns per slice
    ahead = stages if config.schedule == "tmaw" else max(1, stages // 2)  # sub-chunks in flight
    log = kind == "log_softmax"
    neg_inf = -T.infinity(_ACC)

    @T.macro
    def stamp(C, bx, k: int):
        if clock:
            if T.get_thread_binding() == 0:
                C[bx, k] = T.call_extern("int64", "clock64")

    @T.macro
    def body(X, Y, bx, C=None):
        if config.min_blocks:
            T.annotate_min_blocks_per_sm(config.min_blocks)
        stamp(C, bx, 0)
        row = bx // nc
        base = (bx % nc) * c
        a = T.alloc_shared((c,), dtype)
        bars = T.alloc_barrier([threads] * stages)
        # Fragments (warp, lane, vec): thread (i, j) owns the vec contiguous elements at
        # s * sub + kk * w + (32 i + j) * vec of slice kk of sub-chunk s. One slice each, read from shared
        # memory once and converted once (fp32: 64 registers per thread at 8 slices).
        xs = [T.alloc_fragment((nw, 32, vec), _ACC) for _ in range(ks)]
        part = T.alloc_fragment((nw, 32, vec), _ACC)
        ps = T.alloc_fragment((nw, 32, vec), _ACC)  # sum of exp(x - the thread's running max)
        rt = T.alloc_fragment((nw, 32), _ACC)
        run = T.alloc_fragment((nw, 32), _ACC)  # the thread's running max
        ml = T.alloc_fragment((nw, 32), _ACC)  # the running max times log2(e)
        alpha = T.alloc_fragment((nw, 32), _ACC)
        em = [T.alloc_fragment((nw, 32), _ACC) for _ in range(stages)]  # the max each sub-chunk's exps used
        rw = T.alloc_fragment((nw,), _ACC)
        sw = T.alloc_fragment((nw,), _ACC)
        stats = T.alloc_shared((nw, 2), _ACC)
        r0 = T.alloc_fragment((1,), _ACC)
        r1 = T.alloc_fragment((1,), _ACC)
        acc0 = T.alloc_var(_ACC)
        acc1 = T.alloc_var(_ACC)
        if nc > 1:
            mine = T.alloc_shared((2,), _ACC)
            peers = T.alloc_shared((nc, 2), _ACC, scope="shared")  # static: peers write it remotely
            T.cluster_arrive_relaxed()  # paired with the wait before the DSMEM stores
        # `tmaw`: every load in flight at once (one elected thread issues them). `tmas`:
        # `ahead` sub-chunks in flight, the next issued as one lands, so they land one after another
        # and each one's reduction overlaps the later ones' loads (issued at once, they complete
        # nearly together, leaving all the compute after the last byte).
        _tma_issue_flat(X, a, bars, row, base, sub, 0, ahead)
        for i, j in T.Parallel(nw, 32):
            run[i, j] = neg_inf
        for i, j, v in T.Parallel(nw, 32, vec):
            ps[i, j, v] = 0.0
        # Python-level loops over lists of fragments (enumerate: the builder turns range() loops
        # into TIR loops, whose variable cannot index a list): unrolled, each slice its registers.
        for s, em_s in enumerate(em):
            off = s * sub
            T.mbarrier_wait_parity(bars[s], 0)
            stamp(C, bx, 1 + 2 * s)
            if s + ahead < stages:
                _tma_issue_flat(X, a, bars, row, base, sub, s + ahead, 1)
            for kk, xk in enumerate(xs):
                for i, j, v in T.Parallel(nw, 32, vec):
                    xk[i, j, v] = T.Cast(_ACC, a[off + kk * w + (i * 32 + j) * vec + v])
            for kk, xk in enumerate(xs):
                for i, j, v in T.Parallel(nw, 32, vec):
                    part[i, j, v] = T.max(part[i, j, v], xk[i, j, v]) if kk else xk[i, j, v]
            T.reduce_max(part, rt, dim=2)  # within each thread
            for i, j in T.Parallel(nw, 32):
                # new running max; the sums so far were shifted by the old one (0 while it is -inf)
                alpha[i, j] = T.if_then_else(run[i, j] == neg_inf, 0.0, T.exp2((run[i, j] - T.max(run[i, j], rt[i, j])) * LOG2E))
                run[i, j] = T.max(run[i, j], rt[i, j])
                em_s[i, j] = run[i, j]
                ml[i, j] = _safe(run[i, j]) * LOG2E
            for i, j, v in T.Parallel(nw, 32, vec):
                ps[i, j, v] = ps[i, j, v] * alpha[i, j]
            for kk, xk in enumerate(xs):
                for i, j, v in T.Parallel(nw, 32, vec):
                    # x log2(e) - max log2(e): one FFMA (the product exact inside it); the shift's
                    # rounding is ~2^-24 of max log2(e), far below the input dtype's ulp
                    part[i, j, v] = T.exp2(xk[i, j, v] * LOG2E - ml[i, j])
                    ps[i, j, v] = ps[i, j, v] + part[i, j, v]
                if not log:  # keep the exps (log_softmax's output needs x itself)
                    for i, j, v in T.Parallel(nw, 32, vec):
                        a[off + kk * w + (i * 32 + j) * vec + v] = T.Cast(dtype, part[i, j, v])
            stamp(C, bx, 2 + 2 * s)
        # each warp's (max, sum) from its threads': a thread with only -inf so far has sum 0
        T.reduce_sum(ps, rt, dim=2)
        T.reduce_max(run, rw, dim=1)
        for i, j in T.Parallel(nw, 32):
            rt[i, j] = T.if_then_else(run[i, j] == neg_inf, 0.0, rt[i, j] * T.exp2((run[i, j] - rw[i]) * LOG2E))
        T.reduce_sum(rt, sw, dim=1)
        for i in T.Parallel(nw):
            stats[i, 0] = rw[i]
            stats[i, 1] = sw[i]
        T.sync_threads()  # the one CTA barrier (the sync pass is off: SoftmaxConfig.pass_configs)
        # the CTA's (max, sum) from its warps', as the cluster folds its CTAs' below
        acc0 = neg_inf
        for k in T.serial(nw):
            acc0 = T.max(acc0, stats[k, 0])
        acc1 = 0.0
        for k in T.serial(nw):  # a warp with only -inf so far: its sum is 0 (NaN only for an all -inf row)
            acc1 = acc1 + T.if_then_else(stats[k, 0] == neg_inf, 0.0, stats[k, 1] * T.exp2((stats[k, 0] - acc0) * LOG2E))
        if nc > 1:
            r0[0] = acc0
            r1[0] = acc1
            _push(mine, peers, r0, r1, bx % nc, nc)
            acc0 = neg_inf
            for k in T.serial(nc):
                acc0 = T.max(acc0, peers[k, 0])
            acc1 = 0.0
            for k in T.serial(nc):
                acc1 = acc1 + peers[k, 1] * T.exp2((peers[k, 0] - acc0) * LOG2E)
        if log:
            acc1 = acc0 + T.log2(acc1) * LN2
        stamp(C, bx, 2 * stages + 1)
        for s, em_s in enumerate(em):
            off = s * sub
            if not log:
                # one factor per (sub-chunk, thread) rescales and normalises its exps; em = -inf:
                # 0, or NaN when the whole row is -inf (acc0 = -inf), as PyTorch gives
                for i, j in T.Parallel(nw, 32):
                    alpha[i, j] = T.exp2((em_s[i, j] - acc0) * LOG2E) / acc1
            for kk in tuple(range(ks)):
                for i, j, v in T.Parallel(nw, 32, vec):
                    at = off + kk * w + (i * 32 + j) * vec + v
                    if log:
                        Y[row, base + at] = T.Cast(dtype, T.Cast(_ACC, a[at]) - acc1)
                    else:
                        Y[row, base + at] = T.Cast(dtype, T.Cast(_ACC, a[at]) * alpha[i, j])
        stamp(C, bx, 2 * stages + 2)

    return _tma_prim_func(body, M, n, dtype, nc, threads, clocks)


# fast math: exp2 as one MUFU.EX2 (ex2.approx.ftz; exp2f's subnormal handling costs three more
# instructions per element on the per-sub-chunk reductions, which sit on the critical path of a
# one-wave row: session 9's clock probe). Only results below 2^-126 of the row max change (to 0).
@kernel("softmax", "softmax_tma", min_sm=90, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
def tma_fwd(config: SoftmaxConfig, n: int, dtype: str, kind: str, probe: str = ""):
    """probe="copy" (benchmarks/probe_softmax.py only; wrong results): the same loads, exchange and
    output pass with the per-sub-chunk reductions left out, to time what the compute costs."""
    M = T.dynamic("M")
    c, threads, stages = config.chunk, config.threads, config.stages
    nc, sub, ks, w = _tma_tile(config, n, dtype)
    assert n % c == 0 and nc <= CLUSTER_MAX and sub % w == 0 and config.block_m == 1, (n, config)
    log = kind == "log_softmax"
    neg_inf = -T.infinity(_ACC)
    if config.schedule != "tma":  # tmaw, tmas
        assert probe in ("", "clock"), probe
        return _tma_warp_fwd(config, n, dtype, kind, M, nc, sub, ks, w, clock=probe == "clock")

    @T.macro
    def body(X, Y, bx):
        if config.min_blocks:
            T.annotate_min_blocks_per_sm(config.min_blocks)
        row = bx // nc
        base = (bx % nc) * c
        a = T.alloc_shared((stages, sub), dtype)
        bars = T.alloc_barrier([threads] * stages)
        xf = T.alloc_fragment((w,), dtype)
        part = T.alloc_fragment((w,), _ACC)
        ps = T.alloc_fragment((w,), _ACC)  # per-lane sum of exp(x - running max)
        r0 = T.alloc_fragment((1,), _ACC)
        r1 = T.alloc_fragment((1,), _ACC)
        em = T.alloc_local((stages,), _ACC)  # the running max each sub-chunk's exps are shifted by
        run = T.alloc_var(_ACC)
        alpha = T.alloc_var(_ACC)
        acc0 = T.alloc_var(_ACC)
        acc1 = T.alloc_var(_ACC)
        if nc > 1:
            mine = T.alloc_shared((2,), _ACC)
            peers = T.alloc_shared((nc, 2), _ACC, scope="shared")  # static: peers write it remotely
            T.cluster_arrive_relaxed()  # paired with the wait before the DSMEM stores
        _tma_issue(X, a, bars, row, base, sub, 0, stages)  # every load in flight at once
        run = neg_inf
        for j in T.Parallel(w):
            ps[j] = 0.0
        for s in T.unroll(stages):  # unrolled: em[] stays in registers
            T.mbarrier_wait_parity(bars[s], 0)
            if probe == "copy":  # no reductions: the output pass gets x * 1 / sum
                run = 0.0
                em[s] = run
            else:
                for j in T.Parallel(w):
                    part[j] = neg_inf
                for kk in T.serial(ks):
                    T.copy(a[s, kk * w : (kk + 1) * w], xf)
                    for j in T.Parallel(w):
                        part[j] = T.max(part[j], T.Cast(_ACC, xf[j]))
                T.reduce_max(part, r0, dim=0)
                # new running max; the sums so far were shifted by the old one (0 while it is -inf)
                alpha = T.if_then_else(run == neg_inf, 0.0, T.exp2((run - T.max(run, r0[0])) * LOG2E))
                run = T.max(run, r0[0])
                em[s] = run
                for j in T.Parallel(w):
                    ps[j] = ps[j] * alpha
                for kk in T.serial(ks):
                    T.copy(a[s, kk * w : (kk + 1) * w], xf)
                    for j in T.Parallel(w):
                        part[j] = T.exp2((T.Cast(_ACC, xf[j]) - _safe(run)) * LOG2E)
                        ps[j] = ps[j] + part[j]
                    if not log:  # keep the exps (log_softmax's output needs x itself)
                        for j in T.Parallel(w):
                            xf[j] = T.Cast(dtype, part[j])
                        T.copy(xf, a[s, kk * w : (kk + 1) * w])
        T.reduce_sum(ps, r1, dim=0)
        if nc > 1:
            r0[0] = run
            _push(mine, peers, r0, r1, bx % nc, nc)
            acc0 = neg_inf
            for k in T.serial(nc):
                acc0 = T.max(acc0, peers[k, 0])
            acc1 = 0.0
            for k in T.serial(nc):  # NaN only for an all -inf row, like PyTorch
                acc1 = acc1 + peers[k, 1] * T.exp2((peers[k, 0] - acc0) * LOG2E)
        else:
            acc0 = run
            acc1 = r1[0]
        if log:
            acc1 = acc0 + T.log2(acc1) * LN2
        for s in T.unroll(stages):
            if not log:
                # The sub-chunk's exps were shifted by em[s]: one factor rescales and normalises.
                # em[s] = -inf (no finite element yet: its exps are 0): the factor is 0, or NaN when
                # the whole row is -inf (acc0 = -inf), as PyTorch gives.
                alpha = T.exp2((em[s] - acc0) * LOG2E) / acc1
            for kk in T.serial(ks):
                T.copy(a[s, kk * w : (kk + 1) * w], xf)
                for j in T.Parallel(w):
                    if log:
                        xf[j] = T.Cast(dtype, T.Cast(_ACC, xf[j]) - acc1)
                    else:
                        xf[j] = T.Cast(dtype, T.Cast(_ACC, xf[j]) * alpha)
                T.copy(xf, Y[row, base + s * sub + kk * w : base + s * sub + (kk + 1) * w])

    return _tma_prim_func(body, M, n, dtype, nc, threads)


# ---------------------------------------------------------------------------------------------
# loop: long rows and many of them; one CTA per row walks its row twice in chunks. Each thread
# keeps its own running (max, sum) / dot over the vectors it loads and the CTA reduces them once
# at the end: no barrier inside the walk, so a thread's next loads never wait on the others.
# ---------------------------------------------------------------------------------------------
def _stash_len(n: int, dtype: str) -> int:
    """Elements of a `stash` CTA's shared-memory row: n rounded up to whole vectors."""
    fv = _full_vec(dtype)
    return -(-n // fv) * fv


def _stash_chunks(config: SoftmaxConfig, n: int, dtype: str) -> int:
    """Chunks of its row a `stash` CTA keeps in shared memory: all of them while the row fits
    STASH_SMEM_MAX, else the first ones that do (the rest re-read from L2, like `loop`)."""
    nc = _split_chunks(n, config.chunk)
    if _stash_len(n, dtype) * _ESIZE[dtype] <= STASH_SMEM_MAX:
        return nc
    return min(nc, STASH_SMEM_MAX // (config.chunk * _ESIZE[dtype]))


@kernel("softmax", "softmax_loop_fwd", static_pass_configs=_walk_pass_configs)
def loop_fwd(config: SoftmaxConfig, n: int, dtype: str, kind: str):
    """Pass 1 keeps per-thread running (max, sum of exp); pass 2 re-reads the row, newest chunk
    first, while it is still in L2 (132 SMs x a few resident rows of <= 512 KB fit in 50 MB).
    `stash`: pass 1 also keeps the row (a row longer than STASH_SMEM_MAX: its first chunks) in
    shared memory and pass 2 reads it there."""
    M = T.dynamic("M")
    nc, kc, w = _chunk_tile(config, n, dtype, _full_vec(dtype))
    c = config.chunk
    log = kind == "log_softmax"
    stash = config.schedule == "stash"
    ns = _stash_chunks(config, n, dtype) if stash else 0  # chunks kept in shared memory
    held = _stash_len(n, dtype) if ns == nc else ns * c

    @T.macro
    def keep(a, row_s, rw, ch):
        for kk, j in T.Parallel(kc, w):
            if rw.inside(ch * c + kk * w + j):
                row_s[ch * c + kk * w + j] = a[kk, j]

    # pass 2, newest chunk first, as (chunks above `top`, how many, read from shared memory)
    # segments (unrolled by Python): a partial stash reads its L2 chunks, then its stashed ones
    segments = ((nc, nc, stash),) if ns in (0, nc) else ((nc, nc - ns, False), (ns, ns, True))

    @T.prim_func
    def fwd(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), dtype)):
        with T.Kernel(M, threads=config.threads) as row:
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            rw = _RowWalk(row, n, dtype, M)
            X = rw.view(X)  # the same tensor; flat for unaligned rows
            Y = rw.view(Y)
            a = T.alloc_fragment((kc, w), dtype)
            pm = T.alloc_fragment((w,), _ACC)  # per-lane running max
            ps = T.alloc_fragment((w,), _ACC)  # per-lane sum of exp(x - pm)
            nm = T.alloc_fragment((w,), _ACC)
            r = T.alloc_fragment((1,), _ACC)
            m = T.alloc_var(_ACC)
            s = T.alloc_var(_ACC)
            if stash:
                row_s = T.alloc_shared((held,), dtype)
            for j in T.Parallel(w):
                pm[j] = -T.infinity(_ACC)
                ps[j] = 0.0
            for ch in T.serial(nc):  # reads n
                for kk, j in T.Parallel(kc, w):
                    a[kk, j] = T.if_then_else(
                        rw.inside(ch * c + kk * w + j), X[rw.at(ch * c + kk * w + j)], T.Cast(dtype, -T.infinity(_ACC))
                    )
                if ns == nc:
                    keep(a, row_s, rw, ch)
                elif ns:
                    if ch < ns:
                        keep(a, row_s, rw, ch)
                for j in T.Parallel(w):
                    nm[j] = pm[j]
                    for kk in T.serial(kc):
                        nm[j] = T.max(nm[j], T.Cast(_ACC, a[kk, j]))
                for j in T.Parallel(w):  # one serial loop over `a` per parallel loop (TileLang)
                    ps[j] = ps[j] * T.exp2((pm[j] - _safe(nm[j])) * LOG2E)
                    for kk in T.serial(kc):
                        ps[j] = ps[j] + T.exp2((T.Cast(_ACC, a[kk, j]) - _safe(nm[j])) * LOG2E)
                    pm[j] = nm[j]
            if rw.odd:  # after the walk: a loop before it would give pm a one-element layout
                for j in T.Parallel(w):
                    e = T.if_then_else(rw.end_ok(j), T.Cast(_ACC, X[rw.end_at(j)]), -T.infinity(_ACC))
                    nm[j] = T.max(pm[j], e)
                    ps[j] = ps[j] * T.exp2((pm[j] - _safe(nm[j])) * LOG2E) + T.exp2((e - _safe(nm[j])) * LOG2E)
                    pm[j] = nm[j]
            T.reduce_max(pm, r, dim=0)
            m = r[0]
            for j in T.Parallel(w):
                ps[j] = ps[j] * T.exp2((pm[j] - _safe(m)) * LOG2E)
            T.reduce_sum(ps, r, dim=0)
            s = r[0]  # 0 for an all -inf row: NaN below, like PyTorch
            if log:
                s = m + T.log2(s) * LN2
            else:
                s = 1.0 / s
            if rw.odd:
                for j in T.Parallel(w):
                    if rw.end_ok(j):
                        _fwd_out(Y, rw.end_at(j), X[rw.end_at(j)], m, s, dtype, log)
            for top, count, shared in segments:  # reads n (L2; stash: shared memory), writes n
                for rc in T.serial(count):
                    ch = top - 1 - rc
                    for kk, j in T.Parallel(kc, w):
                        if rw.inside(ch * c + kk * w + j):
                            if shared:
                                _fwd_out(Y, rw.at(ch * c + kk * w + j), row_s[ch * c + kk * w + j], m, s, dtype, log)
                            else:
                                _fwd_out(Y, rw.at(ch * c + kk * w + j), X[rw.at(ch * c + kk * w + j)], m, s, dtype, log)

    return fwd


@kernel("softmax", "softmax_loop_bwd", static_pass_configs=_walk_pass_configs)
def loop_bwd(config: SoftmaxConfig, n: int, dtype: str, kind: str):
    M = T.dynamic("M")
    nc, kc, w = _chunk_tile(config, n, dtype, _full_vec(dtype))
    c = config.chunk
    log = kind == "log_softmax"

    @T.prim_func
    def bwd(DY: T.Tensor((M, n), dtype), Yt: T.Tensor((M, n), dtype), DX: T.Tensor((M, n), dtype)):
        with T.Kernel(M, threads=config.threads) as row:
            if config.min_blocks:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            rw = _RowWalk(row, n, dtype, M)
            DY = rw.view(DY)
            Yt = rw.view(Yt)
            DX = rw.view(DX)
            a = T.alloc_fragment((kc, w), dtype)
            b = T.alloc_fragment((kc, w), dtype)
            pd = T.alloc_fragment((w,), _ACC)  # per-lane partial dot (sum of dy for log_softmax)
            r = T.alloc_fragment((1,), _ACC)
            dot = T.alloc_var(_ACC)
            for j in T.Parallel(w):
                pd[j] = 0.0
            for ch in T.serial(nc):  # reads 2n (n for log_softmax)
                for kk, j in T.Parallel(kc, w):
                    i = ch * c + kk * w + j
                    a[kk, j] = T.if_then_else(rw.inside(i), DY[rw.at(i)], T.Cast(dtype, 0.0))
                if not log:
                    for kk, j in T.Parallel(kc, w):
                        i = ch * c + kk * w + j
                        b[kk, j] = T.if_then_else(rw.inside(i), Yt[rw.at(i)], T.Cast(dtype, 0.0))
                _lane_dot(kc, w, log)(a, b, pd)
            if rw.odd:  # the row's unaligned ends (after the walk: see loop_fwd)
                for j in T.Parallel(w):
                    if rw.end_ok(j):
                        i = rw.end_at(j)
                        pd[j] = pd[j] + _dot_term(DY, Yt, i, log)
            T.reduce_sum(pd, r, dim=0)
            dot = r[0]
            if rw.odd:
                for j in T.Parallel(w):
                    if rw.end_ok(j):
                        _bwd_out(DY, Yt, DX, rw.end_at(j), dot, dtype, log)
            for rc in T.serial(nc):  # reads 2n (L2), writes n
                ch = nc - 1 - rc
                for kk, j in T.Parallel(kc, w):
                    if rw.inside(ch * c + kk * w + j):
                        _bwd_out(DY, Yt, DX, rw.at(ch * c + kk * w + j), dot, dtype, log)

    return bwd


# (kernel, config, static) at which `tileops export` writes source and `tileops check` compiles:
# every schedule at a few row lengths (H200: 132 SMs; M picks the schedule, it is not compiled in).
def _rep(n: int, dtype: str, kind: str, backward: bool, m: int) -> list:
    # The heuristic, not MEASURED: these compile for sm_80 too (csplit needs sm_90 clusters).
    return schedule_kernels(heuristic_config(n, dtype, kind, backward, m), n, dtype, kind, backward)


REPRESENTATIVE = (
    _rep(128, "bfloat16", "softmax", False, 65536)  # short rows, 16 per CTA
    + _rep(8192, "bfloat16", "softmax", False, 1024)  # a row per CTA in registers
    + _rep(8192, "float32", "log_softmax", False, 1024)
    + _rep(8192, "bfloat16", "softmax", True, 1024)
    + _rep(65536, "bfloat16", "softmax", False, 128)  # split: stats + apply
    + _rep(65536, "bfloat16", "softmax", False, 4096)  # loop
    + _rep(65536, "bfloat16", "softmax", True, 4096)
    # csplit (Hopper clusters; the MEASURED default for long rows backward, and forward at 131072)
    + [(csplit, SoftmaxConfig("csplit", 1, 256, 8192, 0), {"n": 65536, "dtype": "bfloat16", "kind": "softmax", "backward": False})]
    + [(csplit, MEASURED[("bwd", 32768, "many")], {"n": 32768, "dtype": "bfloat16", "kind": "softmax", "backward": True})]
    + [(csplit, SoftmaxConfig("csplitd", 1, 128, 4096, 0), {"n": 32768, "dtype": "bfloat16", "kind": "softmax", "backward": False, "dsmem": True})]
    # tma (bulk copies into shared memory; the MEASURED default for long rows forward on an H200)
    + [(tma_fwd, MEASURED[("fwd", 32768, "many")], {"n": 32768, "dtype": "bfloat16", "kind": "softmax"})]
    + [(tma_fwd, MEASURED[("fwd", 262144, "few")], {"n": 262144, "dtype": "bfloat16", "kind": "softmax"})]
    # rows that break 16-byte alignment (GPT-2's vocabulary): an aligned body in vectors, scalar ends
    + _rep(50257, "bfloat16", "softmax", False, 4096)  # loop
    + _rep(50257, "bfloat16", "softmax", True, 4096)
    + _rep(50257, "bfloat16", "softmax", False, 128)  # split: stats + apply
    # stash (the loop with the row in shared memory): the whole row (LONG_FWD), its first chunks (WIDE_FWD)
    + [(loop_fwd, LONG_FWD, {"n": 50257, "dtype": "bfloat16", "kind": "softmax"})]
    + [(loop_fwd, WIDE_FWD, {"n": 151936, "dtype": "bfloat16", "kind": "log_softmax"})]
)
