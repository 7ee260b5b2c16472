"""FlashAttention forward (+ log-sum-exp) and backward, in flash-attn's (B, S, H, D) layout.

Static (one compiled kernel each): head dim, dtype, causal, GQA ratio `groups`, softmax scale,
config. Symbolic: batch, query/key lengths and head counts, so one kernel serves every B, S, H.

Semantics shared by every kernel here:
- query i (0-based) may see key j iff j < Sk and, when causal, j <= i + (Sk - Sq): the causal
  diagonal is aligned to the bottom-right corner, as flash-attn >= 2.1.
- a query row that sees no key gets output 0 and lse = -inf (never NaN).
- LSE is the natural log: lse = log(sum_j exp(scale * q.k_j)), fp32, layout (B, H, Sq).
- kv head of query head h is h // groups (no repeated K/V in memory).

Tails: with symbolic lengths the last tile reads past the end; TMA fills those rows with zeros, so
the scores of key index >= Sk are set to -inf explicitly (a zero K row would score 0, not -inf),
and stores are clipped to the tensor.

Backward, two paths over the same preprocess (Delta, base-2 LSE):
- fast (default): flash_bwd, one CTA per key block, dK/dV in registers, dQ reduce-added with fp32
  atomics into a zeroed buffer, then cast_f32. dQ's summation order depends on scheduling.
- deterministic (torch.use_deterministic_algorithms(True)): flash_bwd(dq=False) for dK/dV, and
  flash_bwd_dq, one CTA per query block, for dQ. Every sum runs in a fixed order inside one CTA,
  so dq, dk, dv are bitwise identical run to run.
- at most one key block (Sk <= SMALL_BWD_KEYS, head dim 64/128): flash_bwd_small, the whole
  backward (preprocess included) in one kernel, dQ stored directly; deterministic.
"""
# No `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations, and a
# symbolic dim used only there (e.g. HK) must be a live closure variable, not a string.
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import tilelang
import tilelang.language as T

from ..runtime import HAND_SYNC_PASS_CONFIGS, PERSISTENT_CTAS, PRODUCER_REGS, KernelDef, kernel, warpgroup_regs

DTYPES = ("float16", "bfloat16")
HEADDIMS = (64, 128, 256)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Fast math: exp2/log2 become single ex2.approx/lg2.approx instructions (ex2.approx(-inf) = +0).
_PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def _is_hopper(arch: str) -> bool:
    return arch.startswith("sm_90")


class _ArchKernelDef(KernelDef):
    """A KernelDef that first adapts its config to the target (`config.for_arch(arch)`), so a
    Hopper config (e.g. a REPRESENTATIVE entry) still compiles for Ampere, minus the features that
    do not exist or do not lower there (TMA reductions; multi-stage pipelines, see below)."""

    def compile(self, config, arch: str, **static):
        return super().compile(config.for_arch(arch), arch, **static)


def _arch_aware(kdef: KernelDef) -> _ArchKernelDef:
    return _ArchKernelDef(**{f.name: getattr(kdef, f.name) for f in dataclasses.fields(kdef)})  # every field, min_sm too


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FwdConfig:
    block_m: int = 128  # query rows per CTA
    block_n: int = 128  # keys per pipeline step
    num_stages: int = 2
    threads: int = 256  # consumer threads; on Hopper TileLang adds a 128-thread TMA producer
    # "auto": TileLang's warp-specialized T.Pipelined; each T.gemm waits for its wgmma, so a
    # warpgroup's softmax never overlaps its own GEMMs (other warpgroups fill the tensor cores).
    # "async": our own producer/consumer mbarrier pipeline in which each consumer warpgroup issues
    # step j's S = Q K_j^T and step j-1's O += P V_{j-1} back to back and computes step j's softmax
    # while the P V wgmma runs (FlashAttention-3's intra-warpgroup overlap; sm_90 only).
    # "pingpong": "async" plus FlashAttention-3's warpgroup ping-pong: the consumer warpgroups take
    # turns issuing their GEMMs (a ring of named barriers), so one's softmax runs while the next
    # one's GEMMs occupy the tensor cores.
    pipeline: str = "auto"
    # Lazy rescaling (FlashAttention-4's): a row keeps its running max until a step's max exceeds
    # it by more than `lazy_rescale` (log2 units; probabilities then reach at most 2^lazy_rescale,
    # harmless in fp32 and bf16), and O is rescaled only on steps where some row of the thread
    # moved its max, which after the first steps is almost never: the bm x D multiplies leave the
    # softmax's instruction stream. 0: rescale every step.
    lazy_rescale: float = dataclasses.field(default=0.0, metadata={"omit_default": True})
    # True: the S GEMM starts from zero (wgmma scale-d = 0) and only the diagonal and tail blocks
    # are masked after it; False: every block's accumulator is filled first (0, or the mask).
    post_mask: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # "async" only: one CTA per SM walks the (query tile, head, batch) tiles, so the producer
    # loads the next tile's Q and first K/V blocks while the consumers finish this one (the
    # grid is the `ctas` static the op passes: the device's SM count).
    persistent: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # role branches on a warp-uniform index (runtime.uniform_warpgroups)
    uniform_ws: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # persistent with its own O buffer: the thread that issues a tile's O store waits for the
    # store to have read that buffer only before the next tile writes it, not right after issuing
    # it (its warpgroup's next wgmmas need it). Timed with pin_waits at D=64 causal (H200, session
    # 38, sweep_attention --pin --late-store): 0.96-1.00x the pinned kernel alone; off.
    late_store_wait: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # The softmax's row max and row sum as `tree_reduce` interleaved chains per thread instead of
    # TileLang's one serial chain (runtime.tree_reductions; 0: as generated). H200, session 39,
    # causal, with pin_waits: 1.01-1.04x at D=64, 1.00x at D=128 (A/A 0.995-1.03x): off until repeated.
    tree_reduce: int = dataclasses.field(default=0, metadata={"omit_default": True})
    # Async pipelines: keep the full wgmma wait after the softmax, where the source puts it
    # (runtime.pin_wgmma_waits: ptxas hoists it above the softmax in some kernels, which undoes
    # the intra-warpgroup overlap). H200, session 39: 0.96-1.01x alone (the other consumer
    # warpgroup's GEMMs had kept the tensor cores busy during the hoisted wait).
    pin_waits: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # "async" only. False: each consumer warpgroup waits for each of its wgmmas (T.Pipelined's
    # per-step order: no second step's scores in registers, so three consumer warpgroups fit at
    # D=128 in 160 registers), for the 192-row tile in the persistent walk.
    overlap: bool = dataclasses.field(default=True, metadata={"omit_default": True})
    # "async" only: the producer is warpgroup 0 and the consumers 1.. (T.Pipelined's placement),
    # and a "full" barrier takes one arrival, the TMA-issuing thread's (T.Pipelined's), not 128.
    # Session 35: together they brought the serial pipeline from 0.91 to 0.98-1.01x T.Pipelined.
    producer_first: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # persistent only: each CTA's next tile from a global counter (atomicAdd; the kernel's last
    # argument, an int32[1] that is 0 at launch and 0 again at exit), in list order, instead of
    # the static rotation: an SM that finishes early takes the next tile (a dynamic scheduler).
    dynamic: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # persistent only, > 0: the tile list in FlashAttention-3's LPT order. Heads (b*H + h) in
    # sections whose K/V fit in this many MiB (FA3: 32 of the H100's and H200's 50 MB of L2); in a
    # section, query rank-major (causal: heaviest first) with the heads innermost, so the walk
    # ends on the section's lightest tiles, not on one head's heavy and light ones.
    lpt: int = dataclasses.field(default=0, metadata={"omit_default": True})

    def for_arch(self, arch: str) -> "FwdConfig":
        # TileLang 0.1.15's cp.async pipeline (pre-Hopper) fails in codegen on a symbolic trip count.
        return self if _is_hopper(arch) else dataclasses.replace(self, num_stages=1, pipeline="auto", persistent=False)

    @property
    def min_sm(self) -> int:
        return 0 if self.pipeline == "auto" else 90  # wgmma + TMA + setmaxnreg

    def pass_configs(self) -> dict:
        return {} if self.pipeline == "auto" else HAND_SYNC_PASS_CONFIGS


# Causal head-dim-128 forwards over at most this many keys take 128 x 128 tiles, longer ones
# FlashAttention-3's 128 x 176: a causal tile computes up to its diagonal block, and at 4096 keys
# that wastes 3.1% of the scores with 128 x 128 against 7.1% with 128 x 176, at 16384 0.8% against
# 1.8% — where 176-key steps' better efficiency wins (sweep_attention --tiles128, H200, session 22:
# 1.02-1.03x at 4096 keys in three runs, MHA and GQA; 0.985x at 16384 in two).
SHORT_CAUSAL_KEYS = 8192
# Non-causal forwards of head dim 64 and 128 take 128 x 128 persistent tiles up to this many query
# rows, by head dim (fwd_default_config): the 192-row tile pads 197 rows to 384 and 1024 to 1152,
# and its grid ends in a partial wave. At D=64 the 128-row kernel (uniform_ws + tree4) still
# leads at 1536-2048 rows, 1.00-1.03x, and trails at 3072-4096, 0.97-1.00x (H100, sessions 41-42,
# sweep_attention --short); at D=128 it trails from 1536 rows on (0.90-0.99x, session 41).
SHORT_ROWS = {64: 2048, 128: 1024}
# Causal head-dim-128 forwards over at most this many keys run the 128 x 128 tile persistent, with
# warp-uniform role branches: 1.05-1.09x at 2048 keys, 1.00-1.04x at 4096, 0.92-0.93x at 8192
# (H100 and H200, session 43, sweep_attention --vary, both orders).
PERSISTENT_CAUSAL_KEYS = 4096
# Non-causal head-dim-128 backwards over more than this many keys keep three Q/dO stages in
# flight: 1.03-1.06x at 16384 keys, 1.01x at 8192, 0.93-0.97x at 4096 (H100, sessions 42-43,
# sweep_attention --bwd --vary num_stages=3); causal it lost at 16384 (0.94x).
BWD_STAGES3_KEYS = 8192
# Every default that depends on the sequence length: (kind, causal, headdim) -> its bounds,
# ascending. The length is the call's keys, but a non-causal forward's query rows. The op
# (ops.attention.LENGTH_BOUNDS, the same table) resolves one kernel per bucket.
LENGTH_BOUNDS = {("fwd", True, 128): (PERSISTENT_CAUSAL_KEYS, SHORT_CAUSAL_KEYS), ("fwd", False, 64): (SHORT_ROWS[64],),
                 ("fwd", False, 128): (SHORT_ROWS[128],), ("bwd", False, 128): (BWD_STAGES3_KEYS,)}


def fwd_default_config(headdim: int, causal: bool, arch: str = "sm_90a", seqlen: Optional[int] = None) -> FwdConfig:
    """seqlen: the call's sequence length, for the defaults that depend on it (LENGTH_BOUNDS): its
    keys for the causal head-dim-128 one (PERSISTENT_CAUSAL_KEYS, SHORT_CAUSAL_KEYS), its query
    rows for the non-causal head-dim-64 and 128 ones (SHORT_ROWS, by head dim). None gives the
    long-sequence defaults."""
    if _is_hopper(arch):
        # `tileops tune --op flash_attn` on an H200 (B8 H32 S4096 D128 / B16 H32 S2048 D64, bf16),
        # two runs, 2026-11-30: 1.03-1.16x the former 128x128/2/256. 192 query rows = 3 consumer
        # warpgroups; 176 keys per step (22 x 8, a wgmma N).
        if headdim == 128:
            # Lazy rescaling, H200 2026-12-01 (benchmarks.sweep_attention --lazy, session17):
            # 1.04x on every non-causal shape of the set; causal, where the 192-row tile lost 1-3%
            # with it, FlashAttention-3's 128x176 tile in the async pipeline leads instead
            # (1.03-1.06x the former 192x128 default; 1.02-1.04x without lazy rescaling, in this
            # and the twelfth session's sweeps).
            # post_mask (the S GEMM from zero, masks after it; sweep_attention --post-mask,
            # session17/call7): 1.01-1.02x non-causal, 0.94-0.97x in the causal async kernel.
            if causal:
                if seqlen is not None and seqlen <= PERSISTENT_CAUSAL_KEYS:
                    # dynamic (each CTA's next tile from a global counter; session 45, H100):
                    # 1.02-1.04x at 8 x 32 x 4096, 1.01-1.03x GQA 32/8 (A/A 0.96-1.01x). The LPT
                    # order in 8-MiB sections (session 47, H100, 4-6 timings a shape, against the
                    # dynamic walk alone): +1.0-8.2% at 8 x 32 x 4096, -0.5-+3.6% GQA 32/8,
                    # +2.8-5.3% at 4 x 32 x 2048, -0.9-+4.6% at 16 x 32 x 1024; 4-, 16- and 32-MiB
                    # sections at 4096 keys: -5.2-+5.0%.
                    return FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True, dynamic=True, lpt=8)
                if seqlen is not None and seqlen <= SHORT_CAUSAL_KEYS:
                    # the same walk with FlashAttention-3's LPT tile order (session 46, H100: 1.06x
                    # the 128 x 128 non-persistent tile at 2 x 32 x 8192, then 1.02-1.04x there, GQA
                    # 32/8 and 3 x 16 x 6144; dynamic alone 1.01-1.02x; the LPT order lost at 16384
                    # keys, 0.88-0.91x, and at 1024, 0.94-0.96x)
                    return FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True, dynamic=True, lpt=32)
                return FwdConfig(128, 176, 2, 256, "async", lazy_rescale=8.0)
            # Up to SHORT_ROWS[128] query rows 128 x 128 persistent async tiles (O in its own shared
            # buffer): 1.06-1.76x the 192 x 128 tile at 197-1024 rows, 0.96-1.00x at 1536-4096
            # (H200, session 41, sweep_attention --short 128).
            if seqlen is not None and seqlen <= SHORT_ROWS[128]:
                return FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, post_mask=True, persistent=True)
            return FwdConfig(192, 128, 2, 384, lazy_rescale=8.0, post_mask=True)
        if headdim == 64:
            # Causal: 128 x 128 tiles in the async pipeline. B16 H12 S1024 (GPT-2 small in
            # training) 1.20x the 192x176 tile (0.107 vs 0.128 ms; 1024 rows are 5.33 tiles of
            # 192), B16 H32 S2048 1.01x (benchmarks.sweep_attention --gpt, session14/call2).
            # post_mask: 1.05x causal, 1.07x not (session17/call7): the zero fill of 88 (44)
            # accumulators per thread a step left the chain, and the 192x176 kernel its spills.
            # persistent (one CTA per SM walking the tiles: the next tile's loads under this
            # one's last steps and epilogue), causal: 1.06x (session18/call4); not causal, the
            # async tile gains 1.08x with it but stays behind the 192x176 T.Pipelined one (0.94x);
            # at D=128, where O has to go out through Q's buffer, it loses (0.82-0.97x).
            # tree_reduce=4 (the row max and sum as 4 chains), causal: 1.00-1.05x in four sweeps on
            # H200 and H100 (sessions 39-40; A/B/A/B/A/B: +2.2% GQA, +1.4% GPT-2's 1024, +0.1% MHA);
            # it lost at D=128 causal (0.88-0.98x) and in the 192x176 kernel (0.95-0.98x).
            # uniform_ws (warp-role branches on a warp-uniform index) on top of tree4: 1.00-1.07x in
            # two A/B/A/B sweeps (--ab-tree: H100 session 40, H200 session 41), never behind.
            # Non-causal up to SHORT_ROWS[64] query rows the same kernel: 1.07-2.1x the 192x176 tile
            # at 197-1024 rows (H100, session 40, sweep_attention --short); with uniform_ws also at
            # 1536-2048, 1.00-1.03x (H100, sessions 41-42; without it 0.95-0.96x), 0.97-1.00x above.
            # dynamic (each CTA's next tile from a global counter), causal: 1.03-1.06x at 16 x 32
            # x 2048, MHA and GQA 32/8, 1.02x at 16 x 12 x 1024 (H100, session 46, two calls).
            # lpt=8, causal (session 47, H100, four timings a shape against the dynamic walk alone):
            # +3.2-10% at 16 x 32 x 2048, +0.7-13% GQA 32/8, -1.8-+5.0% at 32 x 12 x 1024 (GPT-2
            # small), +0.9-1.7% at 8 x 16 x 4096 (two timings).
            if causal or (seqlen is not None and seqlen <= SHORT_ROWS[64]):
                return FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, uniform_ws=True, tree_reduce=4, dynamic=causal, lpt=8 if causal else 0)
            return FwdConfig(192, 176, 2, 384, post_mask=True)
        # D=256: Q, O and two K/V stages of 128 keys would exceed 227 KB of shared memory.
        return FwdConfig(128, 64, 2, 256)
    # Ampere (compile target only, not tuned): no TMA/wgmma, 164 KB shared memory; one stage,
    # because TileLang 0.1.15's cp.async pipeline fails in codegen on a symbolic trip count.
    if headdim <= 128:
        return FwdConfig(128, 64, 1, 256)
    return FwdConfig(64, 64, 1, 128)


FWD_SEARCH_SPACE = [
    FwdConfig(bm, bn, st, th)
    for bm, th in ((64, 128), (128, 256), (192, 384))  # 192 rows: 3 consumer warpgroups
    for bn in (64, 128, 176)
    for st in (1, 2)
] + [
    # The hand-synchronized pipelines at their best measured tiles (benchmarks/sweep_attention.py,
    # H200, 2026-11-30 and 2026-12-01): within -7%..+5% of the default, ahead only on causal D=128
    # (128x176, FlashAttention-3's tile: 1.01-1.03x causal, 0.94-0.96x not). Three consumer
    # warpgroups do not fit them (160 registers: s, p and o spill).
    FwdConfig(128, 128, 2, 256, "async"),
    FwdConfig(128, 128, 2, 256, "pingpong"),
    FwdConfig(128, 176, 2, 256, "async"),
    FwdConfig(128, 176, 2, 256, "pingpong"),
    # lazy rescaling and masking after the S GEMM (seventeenth session): the defaults' forms
    FwdConfig(192, 128, 2, 384, lazy_rescale=8.0),
    FwdConfig(192, 128, 2, 384, lazy_rescale=8.0, post_mask=True),
    FwdConfig(192, 176, 2, 384, post_mask=True),
    FwdConfig(128, 128, 2, 256, "async", post_mask=True),
    FwdConfig(128, 176, 2, 256, "async", lazy_rescale=8.0),
    # the persistent walk (eighteenth session)
    FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True),
    # its row reductions as 4 chains (the D=64 causal default since session 40)
    FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, tree_reduce=4),
    # the D=128 causal default at <= 4096 keys, with the static walk and with the dynamic one; with
    # the LPT order in 32-MiB sections (the 4097-8192-key default, session 46) and 8-MiB ones (the
    # <= 4096-key default, session 47)
    FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True),
    FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True, dynamic=True),
    FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True, dynamic=True, lpt=32),
    FwdConfig(128, 128, 2, 256, "async", lazy_rescale=8.0, persistent=True, uniform_ws=True, dynamic=True, lpt=8),
    # the D=64 causal default (dynamic since session 46, LPT order since 47)
    FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, uniform_ws=True, tree_reduce=4, dynamic=True),
    FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, uniform_ws=True, tree_reduce=4, dynamic=True, lpt=8),
    # Not here: FlashAttention-3's D=64 tile in the persistent walk, FwdConfig(192, 128, 2, 384,
    # "async", post_mask=True, persistent=True) (0.96-1.08x the defaults, session 22): in session 35
    # its GPU test gave a wrong output once (2 x 17 x 33 x 4/2, causal) and the next one hung; 36 of
    # 36 passed in the next call. Not explained, so the tuner must not pick it (it stays in the tests).
]


def _qkv_param(name: str, shape: tuple, dtype: str):
    """A (B, S, heads, D) input whose last dim is contiguous and whose other strides are symbolic
    (read from the tensor at launch): q/k/v unbound from a packed QKV projection, or SDPA's
    (B, H, S, D) transposed, load by TMA as they are, without a copy. The op layer checks what TMA
    needs (16-byte aligned base and strides, int32 strides) and copies otherwise."""
    strides = (T.dynamic(f"{name}_sb"), T.dynamic(f"{name}_ss"), T.dynamic(f"{name}_sh"), 1)
    return T.StridedTensor(shape, strides, dtype)


@kernel("attention", "flash_fwd", pass_configs=_PASS_CONFIGS)
def flash_fwd_kernel(config: FwdConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float, lse: bool = True, ctas: int = PERSISTENT_CTAS):
    """O (and with lse=True the base-e log-sum-exp per row, (B, H, Sq) fp32) of softmax(Q K^T) V.
    lse=False drops the LSE store. The op does not use it (inference writes a scratch LSE): that
    variant ran 1.0-2.7% slower at the non-causal D=128 defaults, 1.6% faster at the causal
    4096-key one (H100, session 55, benchmarks/diag_attn_lse.py, which times both). ctas: the grid
    of a persistent config (the device's SM count; unused otherwise)."""
    with_lse = lse  # the fragment below is named `lse`, as in the exported kernels
    B = T.dynamic("B")
    Sq = T.dynamic("Sq")
    Sk = T.dynamic("Sk")
    H = T.dynamic("H")
    HK = T.dynamic("HK")
    D = headdim
    bm, bn = config.block_m, config.block_n
    acc = "float32"
    scale_log2 = scale * LOG2E  # softmax in base 2: exp(x * scale) == exp2(x * scale * log2(e))
    neg_inf = -T.infinity(acc)

    post_mask = config.post_mask

    def full_block(kb, qt, offset):
        """Whether every query row of tile qt sees every key of block kb."""
        if causal:
            return ((kb + 1) * bn <= Sk) & ((kb + 1) * bn - 1 <= qt * bm + offset)
        return (kb + 1) * bn <= Sk

    def hidden(kb, qt, i, j, offset):
        """Whether row i of tile qt may not see key j of block kb (past Sk, or after the diagonal)."""
        if causal:
            return (kb * bn + j >= Sk) | (kb * bn + j > qt * bm + i + offset)
        return kb * bn + j >= Sk

    def n_key_blocks(qt, offset):
        """Key blocks query tile qt visits: up to the diagonal when causal — the last key any row
        may see is (qt+1)*bm - 1 + offset. At least one step even for a tile that sees nothing
        (Sq > Sk): the step is fully masked and gives 0 / -inf, and it waits on the Q load, whose
        shared buffer the output tile may reuse."""
        if causal:
            return T.max(T.min(T.ceildiv(Sk, bn), T.ceildiv((qt + 1) * bm + offset, bn)), 1)
        return T.ceildiv(Sk, bn)

    def tile_state():
        """A query tile's fragments: scores s (then probabilities), p (their dtype copy, the P V
        operand), o, the running row max m (raw scores), m_prev, m_scaled, alpha (rescale of the
        running sums), row_sum, l (running sum of exp), lse; and with lazy rescaling `moved`
        (whether this thread's rows moved their max; else None)."""
        return (T.alloc_fragment((bm, bn), acc), T.alloc_fragment((bm, bn), dtype), T.alloc_fragment((bm, D), acc),
                *(T.alloc_fragment((bm,), acc) for _ in range(7)),
                T.alloc_local((1,), "int32") if lazy_on else None)

    @T.macro
    def init_scores(s, kb, qt, offset):
        # The mask is the GEMM's initial accumulator: 0 where visible, -inf elsewhere. Only the
        # diagonal and the tail blocks need it; the others start from 0. (post_mask: nothing.)
        if not post_mask:
            if full_block(kb, qt, offset):
                T.fill(s, 0)
            else:
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else(hidden(kb, qt, i, j, offset), neg_inf, 0)

    @T.macro
    def mask_scores(s, kb, qt, offset):
        # post_mask: -inf over the scores of keys a row may not see, after the GEMM.
        if post_mask:
            if not full_block(kb, qt, offset):
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else(hidden(kb, qt, i, j, offset), neg_inf, s[i, j])

    lazy = config.lazy_rescale
    lazy_on = lazy > 0  # a Python bool: TileLang warns on a float as a condition

    @T.macro
    def online_softmax(s, m, m_prev, m_scaled, alpha, row_sum, l, moved):
        """Scores s -> unnormalized probabilities in place; running max m, sum l, and the factor
        alpha that rescales what was accumulated under the previous max. With lazy rescaling,
        moved[0] != 0 iff some row of this thread changed its max (O needs `rescale`)."""
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        if lazy_on:
            moved[0] = 0
            for i in T.Parallel(bm):
                # -inf - -inf is NaN, not > lazy: a row with no visible key yet keeps -inf.
                if m[i] * scale_log2 - m_prev[i] * scale_log2 > lazy:
                    moved[0] = 1
                    m_scaled[i] = m[i] * scale_log2
                    alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_scaled[i])
                else:
                    m[i] = m_prev[i]
                    alpha[i] = 1.0
        else:
            for i in T.Parallel(bm):
                # A row with no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
                m_scaled[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_scaled[i])
        for i, j in T.Parallel(bm, bn):
            s[i, j] = T.exp2(s[i, j] * scale_log2 - m_scaled[i])
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(bm):
            l[i] = l[i] * alpha[i] + row_sum[i]

    @T.macro
    def rescale(o, alpha, moved):
        if lazy_on:
            if moved[0] != 0:
                for i, j in T.Parallel(bm, D):
                    o[i, j] *= alpha[i]
        else:
            for i, j in T.Parallel(bm, D):
                o[i, j] *= alpha[i]

    @T.macro
    def normalize(o, l, m_scaled, lse):
        for i in T.Parallel(bm):
            # l == 0 only for rows that saw no key: output 0, lse -inf.
            lse[i] = T.if_then_else(l[i] > 0, (T.log2(l[i]) + m_scaled[i]) * LN2, neg_inf)
            l[i] = T.if_then_else(l[i] > 0, 1.0 / l[i], 0)
        for i, j in T.Parallel(bm, D):
            o[i, j] *= l[i]

    @T.macro
    def reset_tile(o, l, m, m_scaled):
        T.fill(o, 0)
        T.fill(l, 0)
        T.fill(m, neg_inf)
        if lazy_on:
            T.fill(m_scaled, 0)  # set only when a row's max moves

    @T.macro
    def body(Q, K, V, O, LSE):
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=config.threads) as (bx, by, bz):
            q_s = T.alloc_shared((bm, D), dtype)
            k_s = T.alloc_shared((bn, D), dtype)
            v_s = T.alloc_shared((bn, D), dtype)
            o_s = T.alloc_shared((bm, D), dtype)
            s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved = tile_state()

            # Causal: heaviest query tiles (most keys) first, so the short ones fill the tail.
            qt = T.ceildiv(Sq, bm) - 1 - bx if causal else bx
            kvh = by // groups
            offset = Sk - Sq  # bottom-right causal alignment
            T.copy(Q[bz, qt * bm : (qt + 1) * bm, by, :], q_s)
            reset_tile(o, l, m, m_scaled)

            n_blocks = n_key_blocks(qt, offset)
            for kb in T.Pipelined(n_blocks, num_stages=config.num_stages):
                T.copy(K[bz, kb * bn : (kb + 1) * bn, kvh, :], k_s)
                init_scores(s, kb, qt, offset)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=post_mask)
                mask_scores(s, kb, qt, offset)
                online_softmax(s, m, m_prev, m_scaled, alpha, row_sum, l, moved)
                T.copy(s, p)
                rescale(o, alpha, moved)

                T.copy(V[bz, kb * bn : (kb + 1) * bn, kvh, :], v_s)
                T.gemm(p, v_s, o, policy=T.GemmWarpPolicy.FullRow)

            normalize(o, l, m_scaled, lse)
            T.copy(o, o_s)
            T.copy(o_s, O[bz, qt * bm : (qt + 1) * bm, by, :])
            if with_lse:
                T.copy(lse, LSE[bz, by, qt * bm : (qt + 1) * bm])

    S = config.num_stages
    consumers = config.threads
    # persistent: a separate O tile fits beside Q and the stages (227 KB a CTA, 2 KB left for barriers)
    own_o = (2 * bm + 2 * S * bn) * D * 2 <= 225 * 1024
    late_wait = config.late_store_wait and config.persistent and own_o
    cwg = tuple(range(consumers // 128))  # consumer warpgroups; the producer is the next one
    pingpong = config.pipeline == "pingpong" and len(cwg) > 1
    # the producer's and the consumers' T.ws warpgroups; wg_base: the first consumer's
    producer_wg, consumer_wgs, wg_base = (0, tuple(w + 1 for w in cwg), 1) if config.producer_first else (len(cwg), cwg, 0)
    n_full = 1 if config.producer_first else 128  # arrivals a "full" barrier's phase takes
    _TURN = 2  # named barriers 2.. (0: __syncthreads, 1: the consumers' epilogue barrier)
    _PRODUCER_BAR = 8  # the producer warpgroup's own (dynamic: the fetched tile read by every thread)
    dynamic = config.dynamic
    assert not dynamic or config.persistent, "FwdConfig.dynamic needs persistent=True"
    assert not config.lpt or config.persistent, "FwdConfig.lpt needs persistent=True"

    @T.macro
    def my_turn(wg):
        # Ping-pong: wait until the previous warpgroup in the ring has issued its GEMMs (bar.sync
        # on this warpgroup's barrier, completed by the predecessor's bar.arrive: 256 threads).
        if pingpong:
            for w in T.unroll(len(cwg)):
                if wg == w:
                    T.sync_threads(_TURN + w, 256)

    @T.macro
    def pass_turn(wg, last):
        # ...and hand the turn on after issuing. The ring is primed by the last warpgroup's arrive
        # before the first step, which it makes up for by not arriving after its last one, so
        # every bar.sync has exactly one matching bar.arrive.
        if pingpong:
            for w in T.unroll(len(cwg)):
                if wg == w:
                    if not (last and w == len(cwg) - 1):
                        T.named_barrier_arrive(_TURN + (w + 1) % len(cwg), 256)

    @T.macro
    def filled(bars, i):
        """The producer's arrival on "full" barrier bars[i] after its TMA load (the bytes complete it)."""
        if config.producer_first:
            if T.shuffle_elect(128):
                T.mbarrier_arrive(bars[i])
        else:
            T.mbarrier_arrive(bars[i])

    @T.macro
    def load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, b, kvh, g, nb):
        """Producer side of one query tile: its nb K and V blocks into the stage ring, from ring
        position g (blocks the CTA loaded before this tile)."""
        for kb in T.serial(nb):
            st = (g + kb) % S
            T.mbarrier_wait_parity(k_empty[st], (((g + kb) // S) & 1) ^ 1)
            T.tma_copy(K[b, kb * bn : (kb + 1) * bn, kvh, :], k_s[st, :, :], barrier=k_full[st])
            filled(k_full, st)
            T.mbarrier_wait_parity(v_empty[st], (((g + kb) // S) & 1) ^ 1)
            T.tma_copy(V[b, kb * bn : (kb + 1) * bn, kvh, :], v_s[st, :, :], barrier=v_full[st])
            filled(v_full, st)

    @T.macro
    def serial_steps(q_s, k_s, v_s, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, moved,
                     k_full, v_full, k_empty, v_empty, q_empty, g, nb, qt, offset):
        """FwdConfig.overlap=False: per step S_j = Q K_j^T, wait, softmax, O += P_j V_j, wait."""
        for kb in T.serial(nb):
            st = (g + kb) % S
            T.mbarrier_wait_parity(k_full[st], ((g + kb) // S) & 1)
            init_scores(s, kb, qt, offset)
            T.wgmma_gemm(q_s, k_s[st, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=post_mask)
            T.wait_wgmma(0)
            T.mbarrier_arrive(k_empty[st])
            if q_empty is not None:
                if kb == nb - 1:
                    T.mbarrier_arrive(q_empty)
            mask_scores(s, kb, qt, offset)
            online_softmax(s, m, m_prev, m_scaled, alpha, row_sum, l, moved)
            rescale(o, alpha, moved)
            T.copy(s, p)
            T.mbarrier_wait_parity(v_full[st], ((g + kb) // S) & 1)
            T.wgmma_gemm(p, v_s[st, :, :], o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.mbarrier_arrive(v_empty[st])

    @T.macro
    def attend_tile(q_s, k_s, v_s, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, moved,
                    k_full, v_full, k_empty, v_empty, q_empty, wg, g, nb, qt, offset):
        """A consumer warpgroup's steps over one query tile's nb key blocks (ring positions g..,
        g: blocks the CTA consumed before this tile), up to O's last P V wgmma retired. Per step
        j >= 1: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} (two wgmma groups), wait for S_j
        only, run step j's softmax while P V runs, then wait for P V, release both stages,
        rescale O by step j's alpha and convert P_j. O is always on the basis of the max of the
        P being multiplied, as in the serial order. q_empty (a persistent walk with its own O
        buffer): arrived once the tile's last S GEMM has retired (the next Q may land); a
        persistent walk (q_empty or not) also releases the last V stage: the ring goes on."""
        if not config.overlap:
            serial_steps(q_s, k_s, v_s, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, moved,
                         k_full, v_full, k_empty, v_empty, q_empty, g, nb, qt, offset)
        else:
            # step 0: scores and softmax only (O is still 0)
            T.mbarrier_wait_parity(k_full[g % S], (g // S) & 1)
            init_scores(s, 0, qt, offset)
            my_turn(wg)
            T.wgmma_gemm(q_s, k_s[g % S, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=post_mask)
            pass_turn(wg, False)
            T.wait_wgmma(0)
            T.mbarrier_arrive(k_empty[g % S])
            if q_empty is not None:
                if nb == 1:
                    T.mbarrier_arrive(q_empty)
            mask_scores(s, 0, qt, offset)
            online_softmax(s, m, m_prev, m_scaled, alpha, row_sum, l, moved)
            T.copy(s, p)
            for kb in T.serial(1, nb):
                st = (g + kb) % S
                sp = (g + kb - 1) % S
                T.mbarrier_wait_parity(k_full[st], ((g + kb) // S) & 1)
                init_scores(s, kb, qt, offset)
                T.mbarrier_wait_parity(v_full[sp], ((g + kb - 1) // S) & 1)
                my_turn(wg)
                T.wgmma_gemm(q_s, k_s[st, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=post_mask)
                T.wgmma_gemm(p, v_s[sp, :, :], o, policy=T.GemmWarpPolicy.FullRow)
                pass_turn(wg, False)
                T.wait_wgmma(1)  # S_j done; P_{j-1} V_{j-1} may still run
                T.mbarrier_arrive(k_empty[st])
                if q_empty is not None:
                    if kb == nb - 1:
                        T.mbarrier_arrive(q_empty)
                mask_scores(s, kb, qt, offset)
                online_softmax(s, m, m_prev, m_scaled, alpha, row_sum, l, moved)
                T.wait_wgmma(0)
                T.mbarrier_arrive(v_empty[sp])
                rescale(o, alpha, moved)
                T.copy(s, p)
            last = g + nb - 1
            T.mbarrier_wait_parity(v_full[last % S], (last // S) & 1)
            my_turn(wg)
            T.wgmma_gemm(p, v_s[last % S, :, :], o, policy=T.GemmWarpPolicy.FullRow)
            pass_turn(wg, True)
            T.wait_wgmma(0)
            if config.persistent:
                T.mbarrier_arrive(v_empty[last % S])

    @T.macro
    def store_tile(o, l, m_scaled, lse, o_s, O, LSE, b, h, qt):
        """The async forwards' epilogue: normalize, O through o_s by TMA, the LSE row."""
        normalize(o, l, m_scaled, lse)
        if config.persistent:
            # the previous tile's O store has read o_s (its issuing thread waited for that
            # before reaching this barrier)
            if late_wait:
                T.tma_store_wait(0)  # (only the issuing thread has a store in flight)
            T.sync_threads(1, consumers)
        T.copy(o, o_s)
        # named barrier over the consumers (the producer may have exited); the generic-proxy
        # writes to o_s made visible to the TMA store first
        T.fence_proxy_async()
        T.sync_threads(1, consumers)
        if late_wait:
            T.tma_copy(o_s, O[b, qt * bm : (qt + 1) * bm, h, :])  # store + commit, no wait
        else:
            T.copy(o_s, O[b, qt * bm : (qt + 1) * bm, h, :])
        if with_lse:
            T.copy(lse, LSE[b, h, qt * bm : (qt + 1) * bm])

    @T.macro
    def body_async(Q, K, V, O, LSE):
        # Producer warpgroup: Q once, then K_j and V_j into an S-stage ring (full_*: the bytes
        # landed; empty_*: every consumer thread is done with the stage); the consumer
        # warpgroups: attend_tile.
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=consumers + 128) as (bx, by, bz):
            q_s = T.alloc_shared((bm, D), dtype)
            k_s = T.alloc_shared((S, bn, D), dtype)
            v_s = T.alloc_shared((S, bn, D), dtype)
            # The output tile goes out through Q's buffer: a warpgroup's wgmmas read only its own
            # rows of q_s, and its last one has retired when it writes them (saves bm x D, e.g. a
            # third K/V stage at D=128).
            o_s = q_s
            s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved = tile_state()
            q_full = T.alloc_barrier([n_full])
            k_full = T.alloc_barrier([n_full] * S)
            v_full = T.alloc_barrier([n_full] * S)
            k_empty = T.alloc_barrier([consumers] * S)
            v_empty = T.alloc_barrier([consumers] * S)

            qt = T.ceildiv(Sq, bm) - 1 - bx if causal else bx
            kvh = by // groups
            offset = Sk - Sq
            n_blocks = n_key_blocks(qt, offset)

            with T.ws(producer_wg):
                T.dec_max_nreg(PRODUCER_REGS)
                T.tma_copy(Q[bz, qt * bm : (qt + 1) * bm, by, :], q_s, barrier=q_full)
                filled(q_full, 0)
                load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, bz, kvh, 0, n_blocks)
            with T.ws(*consumer_wgs):
                T.inc_max_nreg(warpgroup_regs(consumers))
                wg = T.get_thread_binding() // 128 - wg_base
                if pingpong:
                    if wg == len(cwg) - 1:
                        T.named_barrier_arrive(_TURN, 256)  # prime the ring: warpgroup 0 goes first
                reset_tile(o, l, m, m_scaled)
                T.mbarrier_wait_parity(q_full, 0)
                attend_tile(q_s, k_s, v_s, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, moved,
                            k_full, v_full, k_empty, v_empty, None, wg, 0, n_blocks, qt, offset)
                store_tile(o, l, m_scaled, lse, o_s, O, LSE, bz, by, qt)

    def tile_index(t, cta, grid):
        """List index of CTA cta's tile in round t of the persistent walk (see body_persistent)."""
        return t * grid + T.truncmod(cta + t, grid)

    @T.macro
    def tile_coords(coords, i, nq, H):
        """(query tile, head, batch) of tile list index i into coords."""
        if config.lpt:
            # sections of sw heads whose K/V (Sk x D x 2 bf16/fp16 each, shared by `groups` query
            # heads) fit in config.lpt MiB; the last section has `width` <= sw heads
            heads = H * B
            sw = T.min(T.max(T.truncdiv((config.lpt << 20) // (4 * D) * groups, Sk), 1), heads)
            sec = T.truncdiv(i, sw * nq)
            width = T.min(sw, heads - sec * sw)
            r = i - sec * sw * nq
            rank = T.truncdiv(r, width)
            hb = sec * sw + T.truncmod(r, width)
            coords[0] = nq - 1 - rank if causal else rank
            coords[1] = T.truncmod(hb, H)
            coords[2] = T.truncdiv(hb, H)
        else:
            coords[0] = nq - 1 - T.truncmod(i, nq) if causal else T.truncmod(i, nq)
            coords[1] = T.truncmod(T.truncdiv(i, nq), H)
            coords[2] = T.truncdiv(T.truncdiv(i, nq), H)

    @T.macro
    def load_tile(Q, K, V, q_s, k_s, v_s, coords, coords_s, q_full, q_empty, k_full, v_full, k_empty, v_empty, i, nq, H, offset, g, n):
        """Producer side of tile list index i: its coordinates and Q to the consumers, then its K/V."""
        tile_coords(coords, i, nq, H)
        qt, h, b = coords[0], coords[1], coords[2]
        T.mbarrier_wait_parity(q_empty, (n & 1) ^ 1)  # also: the consumers have read the last coords
        for j in T.serial(3):  # published by this thread's q_full arrive (release)
            coords_s[j] = coords[j]
        T.tma_copy(Q[b, qt * bm : (qt + 1) * bm, h, :], q_s, barrier=q_full)
        filled(q_full, 0)
        load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, b, h // groups, g, n_key_blocks(qt, offset))

    @T.macro
    def consume_tile(Q, K, V, O, LSE, q_s, k_s, v_s, o_s, coords, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved,
                     k_full, v_full, k_empty, v_empty, q_empty, g, offset):
        """Consumer side of the tile in coords: its steps, then its O and LSE out."""
        qt, h, b = coords[0], coords[1], coords[2]
        nb = n_key_blocks(qt, offset)
        reset_tile(o, l, m, m_scaled)
        attend_tile(q_s, k_s, v_s, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, moved,
                    k_full, v_full, k_empty, v_empty, q_empty if own_o else None, 0, g, nb, qt, offset)
        store_tile(o, l, m_scaled, lse, o_s, O, LSE, b, h, qt)
        if not own_o:
            T.sync_threads(1, consumers)  # the store has read o_s = q_s
            T.mbarrier_arrive(q_empty)

    @T.macro
    def body_persistent(Q, K, V, O, LSE, Sched=None):
        # body_async's pipeline with one CTA per SM walking tiles: tile list index i -> (head and
        # batch i // nq, query rank i % nq; causal: rank 0 is the last, heaviest query tile), so
        # the CTAs running together share heads' K/V in L2. Round t of the walk is list indices
        # [t*G, t*G + G) and CTA c takes the one at (c + t) % G: a rotation, so that over the
        # rounds every CTA meets every query rank (causal tiles differ in work) instead of the
        # few that c + t*G alone would give it. Only the producer decodes the walk (integer
        # divisions); it hands each tile's coordinates to the consumers in shared memory with the
        # tile's Q, so nothing stands between a consumer's tiles but the wait for that Q
        # (1.02-1.04x at D=64 causal, session 37, against the consumers decoding it themselves).
        nq = T.ceildiv(Sq, bm)
        tiles = nq * H * B
        grid = T.min(tiles, ctas)
        with T.Kernel(grid, threads=consumers + 128) as cta:
            q_s = T.alloc_shared((bm, D), dtype)
            k_s = T.alloc_shared((S, bn, D), dtype)
            v_s = T.alloc_shared((S, bn, D), dtype)
            # Its own buffer where it fits (the next tile's Q lands while this O is stored), else
            # Q's (then the next Q waits for the store).
            o_s = T.alloc_shared((bm, D), dtype) if own_o else q_s
            s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved = tile_state()
            coords = T.alloc_local((3,), "int32")  # this tile's query tile, head, batch
            coords_s = T.alloc_shared((4,), "int32")  # ...from the producer to the consumers (3 used)
            next_s = T.alloc_shared((2,), "int32") if dynamic else None  # dynamic: the fetched next tile, by parity
            q_full = T.alloc_barrier([n_full])
            q_empty = T.alloc_barrier([consumers])
            k_full = T.alloc_barrier([n_full] * S)
            v_full = T.alloc_barrier([n_full] * S)
            k_empty = T.alloc_barrier([consumers] * S)
            v_empty = T.alloc_barrier([consumers] * S)
            offset = Sk - Sq
            rounds = T.ceildiv(tiles, grid)

            with T.ws(producer_wg):
                T.dec_max_nreg(PRODUCER_REGS)
                g = T.alloc_var("int32", init=0)  # K/V blocks loaded so far: the ring position
                n = T.alloc_var("int32", init=0)  # tiles loaded so far
                if dynamic:
                    i = T.alloc_var("int32", init=cta)  # the first tile is the CTA's own
                    while i < tiles:
                        load_tile(Q, K, V, q_s, k_s, v_s, coords, coords_s, q_full, q_empty, k_full, v_full, k_empty, v_empty, i, nq, H, offset, g, n)
                        g = g + n_key_blocks(coords[0], offset)
                        if T.shuffle_elect(128):
                            prev = T.atomic_add(Sched[0], 1, return_prev=True)
                            next_s[n & 1] = grid + prev
                            if prev == tiles - 1:  # the launch's last fetch: leave the counter at 0
                                Sched[0] = 0
                        T.sync_threads(_PRODUCER_BAR, 128)
                        i = next_s[n & 1]
                        n = n + 1
                    # no tile left: a negative query tile in coords_s tells the consumers to stop
                    T.mbarrier_wait_parity(q_empty, (n & 1) ^ 1)
                    coords_s[0] = -1
                    filled(q_full, 0)
                else:
                    for t in T.serial(rounds):
                        if tile_index(t, cta, grid) < tiles:
                            load_tile(Q, K, V, q_s, k_s, v_s, coords, coords_s, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                                      tile_index(t, cta, grid), nq, H, offset, g, n)
                            g = g + n_key_blocks(coords[0], offset)
                            n = n + 1
            with T.ws(*consumer_wgs):
                T.inc_max_nreg(warpgroup_regs(consumers))
                g = T.alloc_var("int32", init=0)
                n = T.alloc_var("int32", init=0)
                if dynamic:
                    live = T.alloc_var("int32", init=1)
                    while live == 1:
                        T.mbarrier_wait_parity(q_full, n & 1)  # (acquire) the tile's Q and coordinates
                        for j in T.serial(3):
                            coords[j] = coords_s[j]
                        if coords[0] < 0:
                            live = 0
                        else:
                            consume_tile(Q, K, V, O, LSE, q_s, k_s, v_s, o_s, coords, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved,
                                         k_full, v_full, k_empty, v_empty, q_empty, g, offset)
                            g = g + n_key_blocks(coords[0], offset)
                            n = n + 1
                else:
                    for t in T.serial(rounds):
                        if tile_index(t, cta, grid) < tiles:
                            T.mbarrier_wait_parity(q_full, n & 1)  # (acquire) the tile's Q and coordinates
                            for j in T.serial(3):
                                coords[j] = coords_s[j]
                            consume_tile(Q, K, V, O, LSE, q_s, k_s, v_s, o_s, coords, s, p, o, m, m_prev, m_scaled, alpha, row_sum, l, lse, moved,
                                         k_full, v_full, k_empty, v_empty, q_empty, g, offset)
                            g = g + n_key_blocks(coords[0], offset)
                            n = n + 1
                if late_wait:
                    T.tma_store_wait(0)  # the last store has read o_s before the CTA exits

    assert config.overlap or config.pipeline == "async", "FwdConfig.overlap=False needs pipeline='async'"
    if config.persistent:
        assert config.pipeline == "async", "FwdConfig.persistent needs pipeline='async'"
        body = body_persistent  # noqa: F811
    elif config.pipeline != "auto":
        body = body_async  # noqa: F811

    # T.prim_func needs an explicit signature per argument list: with and without LSE (and the
    # dynamic walk's tile counter).
    if dynamic:
        if with_lse:

            @T.prim_func
            def flash_fwd(
                Q: _qkv_param("q", (B, Sq, H, D), dtype),
                K: _qkv_param("k", (B, Sk, HK, D), dtype),
                V: _qkv_param("v", (B, Sk, HK, D), dtype),
                O: T.Tensor((B, Sq, H, D), dtype),
                LSE: T.Tensor((B, H, Sq), acc),
                Sched: T.Tensor((1,), "int32"),
            ):
                body(Q, K, V, O, LSE, Sched)

        else:

            @T.prim_func
            def flash_fwd(
                Q: _qkv_param("q", (B, Sq, H, D), dtype),
                K: _qkv_param("k", (B, Sk, HK, D), dtype),
                V: _qkv_param("v", (B, Sk, HK, D), dtype),
                O: T.Tensor((B, Sq, H, D), dtype),
                Sched: T.Tensor((1,), "int32"),
            ):
                body(Q, K, V, O, None, Sched)

    elif with_lse:

        @T.prim_func
        def flash_fwd(
            Q: _qkv_param("q", (B, Sq, H, D), dtype),
            K: _qkv_param("k", (B, Sk, HK, D), dtype),
            V: _qkv_param("v", (B, Sk, HK, D), dtype),
            O: T.Tensor((B, Sq, H, D), dtype),
            LSE: T.Tensor((B, H, Sq), acc),
        ):
            body(Q, K, V, O, LSE)

    else:

        @T.prim_func
        def flash_fwd(
            Q: _qkv_param("q", (B, Sq, H, D), dtype),
            K: _qkv_param("k", (B, Sk, HK, D), dtype),
            V: _qkv_param("v", (B, Sk, HK, D), dtype),
            O: T.Tensor((B, Sq, H, D), dtype),
        ):
            body(Q, K, V, O, None)

    return flash_fwd


# ---------------------------------------------------------------------------------------------
# Backward: preprocess (Delta, base-2 LSE) -> dK/dV/dQ main kernel -> dQ conversion
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrepConfig:
    block: int = 64  # query rows per CTA
    threads: int = 128

    def for_arch(self, arch: str) -> "PrepConfig":
        return self


def prep_config(headdim: int) -> PrepConfig:
    """The preprocess (and the fused backward's dQ conversion) at 32 elements of O and of dO a
    thread: 56 registers (ptxas) at every head dim. At 128 threads a CTA, D=128 needed 146 and ran
    the pass at 3.0-3.1 TB/s, cuDNN's at ~4.1 (H200, session 24: 0.345 ms against 0.287 at 256
    threads, 8 x 32 x 4096 x 128; `python -m benchmarks.diag_bwd_kernels --prep`); D=64 (56
    registers at 128 threads) was already as fast as cuDNN's."""
    return PrepConfig(64, max(128, 2 * headdim))


def _prep_body(config: PrepConfig, headdim: int, dtype: str, dq: bool, dims: tuple):
    """The preprocess kernel (see flash_bwd_prep_kernel) as a macro over (B, Sq, SqP, H)."""
    B, Sq, SqP, H = dims
    D = headdim
    blk = config.block
    acc = "float32"
    with_dq = dq

    @T.macro
    def body(O, dO, LSE, Delta, LSE2, DQacc):
        with T.Kernel(T.ceildiv(SqP, blk), H, B, threads=config.threads) as (bx, by, bz):
            if with_dq:
                for i, j in T.Parallel(blk, D):
                    if bx * blk + i < Sq:
                        DQacc[bz, bx * blk + i, by, j] = T.float32(0)
            o = T.alloc_fragment((blk, D), dtype)
            do = T.alloc_fragment((blk, D), dtype)
            prod = T.alloc_fragment((blk, D), acc)
            delta = T.alloc_fragment((blk,), acc)
            for i, j in T.Parallel(blk, D):  # reads blk*D twice
                o[i, j] = T.if_then_else(bx * blk + i < Sq, O[bz, bx * blk + i, by, j], T.Cast(dtype, 0))
                do[i, j] = T.if_then_else(bx * blk + i < Sq, dO[bz, bx * blk + i, by, j], T.Cast(dtype, 0))
            for i, j in T.Parallel(blk, D):
                prod[i, j] = T.Cast(acc, o[i, j]) * T.Cast(acc, do[i, j])
            T.reduce_sum(prod, delta, dim=1)
            for i in T.Parallel(blk):
                if bx * blk + i < SqP:
                    Delta[bz, by, bx * blk + i] = delta[i]
                    LSE2[bz, by, bx * blk + i] = T.if_then_else(
                        bx * blk + i < Sq, LSE[bz, by, T.min(bx * blk + i, Sq - 1)] * LOG2E, 0
                    )

    return body


@kernel("attention", "flash_bwd_prep", pass_configs=_PASS_CONFIGS)
def flash_bwd_prep_kernel(config: PrepConfig, headdim: int, dtype: str, dq: bool = True):
    """Delta = rowsum(dO * O) and lse2 = lse * log2(e), as (B, H, SqP) fp32 with SqP = Sq rounded
    up to a multiple of 4: the backward loads them by TMA, whose global strides must be 16-byte
    multiples. Entries past Sq are written as 0 (never left uninitialized: 0 * NaN is NaN).
    dq=True also zeroes the fp32 dQ accumulator the main kernel reduce-adds into: one launch (and
    one host call) fewer than a separate memset. dq=False (deterministic path): no accumulator."""
    B = T.dynamic("B")
    Sq = T.dynamic("Sq")
    SqP = T.dynamic("SqP")
    H = T.dynamic("H")
    D = headdim
    acc = "float32"
    body = _prep_body(config, headdim, dtype, dq, (B, Sq, SqP, H))

    if dq:

        @T.prim_func
        def flash_bwd_prep(
            O: T.Tensor((B, Sq, H, D), dtype),
            dO: T.Tensor((B, Sq, H, D), dtype),
            LSE: T.Tensor((B, H, Sq), acc),
            Delta: T.Tensor((B, H, SqP), acc),
            LSE2: T.Tensor((B, H, SqP), acc),
            DQacc: T.Tensor((B, Sq, H, D), acc),
        ):
            body(O, dO, LSE, Delta, LSE2, DQacc)

    else:

        @T.prim_func
        def flash_bwd_prep(
            O: T.Tensor((B, Sq, H, D), dtype),
            dO: T.Tensor((B, Sq, H, D), dtype),
            LSE: T.Tensor((B, H, Sq), acc),
            Delta: T.Tensor((B, H, SqP), acc),
            LSE2: T.Tensor((B, H, SqP), acc),
        ):
            body(O, dO, LSE, Delta, LSE2, None)

    return flash_bwd_prep


@dataclass(frozen=True)
class BwdConfig:
    block_m: int = 128  # keys per CTA (dK, dV rows held in registers)
    block_n: int = 64  # queries per pipeline step
    num_stages: int = 2
    threads: int = 256
    tma_dq: bool = True  # dQ via TMA cp.reduce.async.bulk (sm90+); else per-element atomicAdd
    # P^T and dS^T as register operands of the dV/dK GEMMs (saves shared traffic); False stages
    # them in shared memory, needed when the dK/dV GEMMs split N over warps (D=256, 8 warps).
    rs_gemm: bool = True
    # "auto": TileLang's warp-specialized T.Pipelined; every T.gemm waits for its wgmma.
    # "async": our own TMA producer and mbarrier ring (as the forward's), and the consumer
    # warpgroups keep wgmmas in flight: S^T and dP^T issued back to back, P^T computed while
    # dP^T runs, dS^T while dV += P^T dO runs, dK += dS^T Q under the dS store (sm_90 only).
    pipeline: str = dataclasses.field(default="auto", metadata={"omit_default": True})
    # "async" only: the producer warpgroup, not a consumer thread, issues each step's dQ
    # reduce-add and waits for TMA to have read dQ's shared tile (FlashAttention-3's dQ writer);
    # the consumers hand the tile over on an mbarrier instead of a second named barrier per step.
    # (Handing step i's tile over at step i+1, under its S^T wgmma, does not compile well: ptxas
    # cannot follow a wgmma in flight across the loop's back edge whose accumulator is read in
    # the loop, and serializes every wgmma of the kernel, C7514/C7518. The async pipeline always
    # takes the TMA path: float2 atomics straight from registers measured 0.52-0.85x, session 18.)
    dq_producer: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # "async" only: 1: each step's base-2 LSE is read from shared memory into registers before
    # the S^T/dP^T wgmmas are issued, not after their wait (where each use waited on its shared
    # load: ~5% of the consumers' stall samples in Nsight Compute, session 19); 2: also Delta,
    # read under the exp2s (after the S^T wait) instead of after the dP^T wait. 0: off.
    stats_early: int = dataclasses.field(default=0, metadata={"omit_default": True})
    # dq_producer only: the dQ wgmma is issued before dK's, so the dQ tile's store and hand-over
    # run while dK += dS^T Q still runs (wait<1>), not after both retired.
    dq_first: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # "async" only, causal GQA (no effect otherwise): each CTA walks its query blocks from the
    # last down to its diagonal, the group's heads in turn at each block (else from the diagonal
    # up, head by head), so the CTAs in flight load the same Q/dO tiles and reduce-add into the
    # same dQ tiles at the same time, as the non-causal walk does (whose CTAs all start at block
    # 0: starting each at its own block lost 10%, session 21). MHA: 0.95-0.99x, not offered.
    reverse: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # role branches on a warp-uniform index (runtime.uniform_warpgroups)
    uniform_ws: bool = dataclasses.field(default=False, metadata={"omit_default": True})

    def __post_init__(self):
        if self.stats_early not in (0, 1, 2):
            raise ValueError(f"BwdConfig.stats_early: 0, 1 or 2, got {self.stats_early!r}")
        if (self.stats_early or self.dq_first or self.reverse) and self.pipeline != "async":
            raise ValueError(f"BwdConfig.stats_early, dq_first and reverse need pipeline='async', got {self.pipeline!r}")
        if self.dq_first and not self.dq_producer:
            raise ValueError("BwdConfig.dq_first reorders the producer's dQ hand-over: it needs dq_producer=True")

    def for_arch(self, arch: str) -> "BwdConfig":
        if _is_hopper(arch):
            return self
        return dataclasses.replace(self, num_stages=1, tma_dq=False, pipeline="auto", dq_producer=False, stats_early=0, dq_first=False, reverse=False)

    @property
    def min_sm(self) -> int:
        return 0 if self.pipeline == "auto" else 90

    def pass_configs(self) -> dict:
        return {} if self.pipeline == "auto" else HAND_SYNC_PASS_CONFIGS


def bwd_default_config(headdim: int, causal: bool, arch: str = "sm_90a", seqlen: Optional[int] = None) -> BwdConfig:
    """seqlen: the call's keys (BWD_STAGES3_KEYS); None gives the long-sequence default."""
    hopper = _is_hopper(arch)
    if not hopper and headdim <= 128:  # Ampere: one stage, see fwd_default_config
        return BwdConfig(128, 64, 1, 256, False)
    # The async pipeline, H200 2026-12-01 (benchmarks/sweep_attention.py --bwd, three runs):
    # 1.05-1.11x the T.Pipelined kernel at D=128 (128 keys x 64 queries, 2 or 3 stages alike),
    # 1.03-1.05x at D=64 with 128-query steps (64-query steps: 0.96x).
    # The producer's dQ writer (dq_producer): 1.04-1.06x at D=128, 1.14x at D=64 (session 18).
    # The LSE read into registers before the S^T wgmma (stats_early=1): 1.02-1.04x at D=128 MHA,
    # 0.99/1.02x GQA; at D=64 (64 scores a thread) it spills and loses 0.93-0.95x. The dQ wgmma
    # issued before dK's (dq_first), its tile handed over under dK: 1.01-1.04x on seven of the
    # eight shapes, 0.99x at 16384 causal (session 19).
    # reverse (causal GQA: the query blocks from the last down, heads in turn): 1.02-1.04x at
    # 8 x 32/8 x 4096 x 128 in three sweeps, 1.03x at 16 x 32/8 x 2048 x 64 in two (session 21,
    # the default timed twice in each: up to 1.1% apart). MHA kernels are the same either way.
    # uniform_ws (the role branches on a warp-uniform index, runtime.uniform_warpgroups; the
    # wgmma descriptors and stage indices on the uniform datapath): 1.00-1.04x, session 36.
    if headdim <= 64:
        return BwdConfig(128, 128, 2, 256, pipeline="async", dq_producer=True, dq_first=True, reverse=causal, uniform_ws=True)
    if headdim <= 128:
        stages = 3 if not causal and (seqlen is None or seqlen > BWD_STAGES3_KEYS) else 2
        return BwdConfig(128, 64, stages, 256, pipeline="async", dq_producer=True, stats_early=1, dq_first=True, reverse=causal, uniform_ws=True)
    # D=256: two stages of Q/dO plus an fp32 dQ tile would not fit in shared memory, and 64x256
    # fp32 dK plus dV need 8 warps to stay in registers.
    return BwdConfig(64, 64, 1, 256, hopper, False) if hopper else BwdConfig(64, 32, 1, 256, False, False)


BWD_SEARCH_SPACE = [
    BwdConfig(bm, bn, st, th, True, rs)
    for bm, bn, th, rs in (
        (128, 64, 256, True),
        (128, 128, 256, True),
        (128, 32, 256, True),
        (64, 64, 128, True),
        (64, 128, 128, True),
        (64, 64, 256, False),
    )
    for st in (1, 2)
] + [BwdConfig(128, bn, st, 256, pipeline="async", dq_producer=dp) for bn in (64, 128) for st in (2, 3) for dp in (False, True)] + [
    BwdConfig(128, bn, 2, 256, pipeline="async", dq_producer=True, stats_early=se, dq_first=df) for bn in (64, 128) for se, df in ((1, False), (0, True), (1, True))
] + [  # the reverse causal GQA walk (session 21) at the D=64 and D=128 defaults' tiles
    BwdConfig(128, 128, 2, 256, pipeline="async", dq_producer=True, dq_first=True, reverse=True),
    BwdConfig(128, 64, 2, 256, pipeline="async", dq_producer=True, stats_early=1, dq_first=True, reverse=True),
]


def _bwd_dims():
    """Symbolic (B, Sq, SqP, Sk, H, HK) of the backward kernels; SqP = Sq padded to 4 (the
    prep kernel's lse2/delta rows, 16-byte strides for TMA)."""
    return tuple(T.dynamic(n) for n in ("B", "Sq", "SqP", "Sk", "H", "HK"))


def _bwd_body(config: BwdConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float, dq: bool, dims: tuple):
    """The main backward kernel (see flash_bwd_kernel) as a macro over _bwd_dims()."""
    B, Sq, SqP, Sk, H, HK = dims
    D = headdim
    bm, bn = config.block_m, config.block_n
    acc = "float32"
    scale_log2 = scale * LOG2E
    with_dq = dq  # the dQ fragment below is named `dq`, as in the exported kernels

    # How the async consumers walk a GQA group's steps (its query heads x query blocks): at D=128
    # as two nested loops (see consumer_steps), at D=64 from one counter, as before session 20 (there
    # the counter cost no wgmma overlap, and the nested loops spill 12-24 bytes; not timed).
    nested_walk = groups > 1 and D > 64 and config.pipeline == "async"
    reverse = config.reverse and causal and groups > 1
    # A GQA group's heads in turn at each query block (else head by head): non-causal with
    # nested_walk, and the reverse causal walk (H200, session 20: head by head lost 3% non-causal;
    # heads in turn lost 8% on the causal walk up from the diagonal).
    inner_heads = (nested_walk and not causal) or reverse

    def block(i, q_start):
        """The i-th query block of a CTA's walk (q_start: its first, causal: at its diagonal)."""
        return T.ceildiv(Sq, bn) - 1 - i if reverse else q_start + i

    def head_and_block(it, kvh, q_start, n_q):
        """Query head and query block of step `it` (see inner_heads)."""
        if groups == 1:
            return kvh, block(it, q_start)
        if inner_heads:
            return kvh * groups + it % groups, block(it // groups, q_start)
        return kvh * groups + it // n_q, block(it % n_q, q_start)

    def consumer_steps(n_q):
        """The async consumers' step loop (iterate it in the `for` statement itself: see
        docs/tilelang_notes.md): with nested_walk two loops in head_and_block's order, so the
        head and query block are loop variables (no `it // n_q`, `it % n_q`: at D=128 that
        register made ptxas serialize the S^T and dP^T wgmmas, C7517; 0.93x cuDNN on GQA,
        session 20). step_coords turns a step into (it, h, qb)."""
        if not nested_walk:
            return T.serial(groups * n_q)
        return T.grid(n_q, groups) if inner_heads else T.grid(groups, n_q)

    def step_coords(step, kvh, q_start, n_q):
        """(it, query head, query block) of a consumer_steps step."""
        if not nested_walk:
            return (step, *head_and_block(step, kvh, q_start, n_q))
        if inner_heads:
            return step[0] * groups + step[1], kvh * groups + step[1], block(step[0], q_start)
        return step[0] * n_q + step[1], kvh * groups + step[0], block(step[1], q_start)

    def sees_all(bx, qb, offset):
        """Whether every query of step qb sees every key of block bx (no tail, not across the
        causal diagonal)."""
        full = ((bx + 1) * bm <= Sk) & ((qb + 1) * bn <= Sq)
        return full & ((bx + 1) * bm - 1 <= qb * bn + offset) if causal else full

    def prob_T(s, i, j, lse2, bx, qb, offset):
        """P^T[i, j] from the score S^T[i, j] (key i, query j of the tiles) and the query's base-2
        LSE: a select, not a multiply, since lse2 is -inf for rows that see no key (exp2 -> inf)."""
        visible = (bx * bm + i < Sk) & (qb * bn + j < Sq)
        if causal:
            visible = visible & (bx * bm + i <= qb * bn + j + offset)
        return T.if_then_else(visible, T.exp2(s * scale_log2 - lse2), 0)

    @T.macro
    def body(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV):
        with T.Kernel(T.ceildiv(Sk, bm), HK, B, threads=config.threads) as (bx, by, bz):
            k_s = T.alloc_shared((bm, D), dtype)
            v_s = T.alloc_shared((bm, D), dtype)
            q_s = T.alloc_shared((bn, D), dtype)
            do_s = T.alloc_shared((bn, D), dtype)
            lse_s = T.alloc_shared((bn,), acc)
            delta_s = T.alloc_shared((bn,), acc)
            ds_s = T.alloc_shared((bm, bn), dtype)
            p_s = T.alloc_shared((bm, bn), dtype)
            dq_s = T.alloc_shared((bn, D), acc) if with_dq else None
            dk_s = T.alloc_shared((bm, D), dtype)
            dv_s = T.alloc_shared((bm, D), dtype)
            sT = T.alloc_fragment((bm, bn), acc)  # S^T, then P^T
            dpT = T.alloc_fragment((bm, bn), acc)  # dP^T = V dO^T
            pT = T.alloc_fragment((bm, bn), dtype)
            dsT = T.alloc_fragment((bm, bn), dtype)
            dq = T.alloc_fragment((bn, D), acc) if with_dq else None
            dk = T.alloc_fragment((bm, D), acc)
            dv = T.alloc_fragment((bm, D), acc)

            offset = Sk - Sq
            T.copy(K[bz, bx * bm : (bx + 1) * bm, by, :], k_s)
            T.copy(V[bz, bx * bm : (bx + 1) * bm, by, :], v_s)
            T.clear(dk)
            T.clear(dv)
            # First query that sees key bx*bm is bx*bm - offset (causal); earlier query blocks skip.
            q_start = T.max(T.floordiv(bx * bm - offset, bn), 0) if causal else 0
            n_q = T.max(T.ceildiv(Sq, bn) - q_start, 0)

            for it in T.Pipelined(groups * n_q, num_stages=config.num_stages):
                h, qb = head_and_block(it, by, q_start, n_q)
                T.copy(Q[bz, qb * bn : (qb + 1) * bn, h, :], q_s)
                T.copy(dO[bz, qb * bn : (qb + 1) * bn, h, :], do_s)
                T.copy(LSE2[bz, h, qb * bn : (qb + 1) * bn], lse_s)
                T.copy(Delta[bz, h, qb * bn : (qb + 1) * bn], delta_s)
                T.gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    sT[i, j] = prob_T(sT[i, j], i, j, lse_s[j], bx, qb, offset)
                if config.rs_gemm:
                    T.copy(sT, pT)
                    T.gemm(pT, do_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += P^T dO
                else:
                    T.copy(sT, p_s)
                    T.gemm(p_s, do_s, dv)
                for i, j in T.Parallel(bm, bn):
                    dsT[i, j] = sT[i, j] * (dpT[i, j] - delta_s[j]) * scale  # dS^T, softmax scale folded in
                if with_dq or not config.rs_gemm:
                    T.copy(dsT, ds_s)
                if config.rs_gemm:
                    T.gemm(dsT, q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dS^T Q
                else:
                    T.gemm(ds_s, q_s, dk)
                if with_dq:
                    T.gemm(ds_s, k_s, dq, transpose_A=True, clear_accum=True)  # dQ tile = dS K
                    if config.tma_dq:
                        T.copy(dq, dq_s)
                        T.atomic_add(dQacc[bz, qb * bn : (qb + 1) * bn, h, :], dq_s, use_tma=True)
                    else:
                        for i, j in T.Parallel(bn, D):
                            if qb * bn + i < Sq:
                                T.atomic_add(dQacc[bz, qb * bn + i, h, j], dq[i, j])

            T.copy(dv, dv_s)
            T.copy(dv_s, dV[bz, bx * bm : (bx + 1) * bm, by, :])
            T.copy(dk, dk_s)
            T.copy(dk_s, dK[bz, bx * bm : (bx + 1) * bm, by, :])

    S = config.num_stages
    consumers = config.threads

    # Two copies of the P^T loop cost registers: with 64 scores per thread (128x128 tiles, D=64)
    # ptxas then spilled 96 bytes and the kernel ran at 0.93x; with 32 (128x64) there are none.
    skip_mask = bm * bn // consumers <= 32

    dq_producer = config.dq_producer and with_dq
    dq_first = config.dq_first and with_dq

    def step_stat(stat_s, stat_r, st, j):
        """Query j's LSE (or Delta) of the step in stage st: from registers (stats_early) or shared."""
        return stat_s[st, j] if stat_r is None else stat_r[j]

    @T.macro
    def hand_over_dq(dq, dq_s, dq_full, dq_empty, it):
        """Consumer side of step it's dQ (dq_producer): once the producer has read the previous
        tile, dQ into dq_s, made visible to the async proxy, and dq_full arrived."""
        T.mbarrier_wait_parity(dq_empty, (it & 1) ^ 1)
        T.copy(dq, dq_s)
        T.fence_proxy_async()
        T.mbarrier_arrive(dq_full)

    @T.macro
    def reduce_dq(dQacc, dq_s, dq_full, dq_empty, it, bz, kvh, q_start, n_q):
        """Producer side of step it's dQ: wait for the tile, reduce-add it into dQacc (one thread
        issues it and waits until TMA has read dq_s), hand dq_s back."""
        h, qb = head_and_block(it, kvh, q_start, n_q)
        T.mbarrier_wait_parity(dq_full, it & 1)
        T.atomic_add(dQacc[bz, qb * bn : (qb + 1) * bn, h, :], dq_s, use_tma=True)
        T.mbarrier_arrive(dq_empty)

    @T.macro
    def body_async(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV):
        # Producer warpgroup (the last one): K and V of this key block once, then Q, dO, lse2 and
        # Delta of every query step into an S-stage ring (full: the bytes landed; empty: every
        # consumer thread is done with the stage). The consumer warpgroups together own the
        # block's bm keys (FullRow: warpgroup w has keys w*64..), as the T.Pipelined kernel.
        with T.Kernel(T.ceildiv(Sk, bm), HK, B, threads=consumers + 128) as (bx, by, bz):
            k_s = T.alloc_shared((bm, D), dtype)
            v_s = T.alloc_shared((bm, D), dtype)
            q_s = T.alloc_shared((S, bn, D), dtype)
            do_s = T.alloc_shared((S, bn, D), dtype)
            lse_s = T.alloc_shared((S, bn), acc)
            delta_s = T.alloc_shared((S, bn), acc)
            ds_s = T.alloc_shared((bm, bn), dtype)
            dq_s = T.alloc_shared((bn, D), acc) if with_dq else None
            sT = T.alloc_fragment((bm, bn), acc)
            dpT = T.alloc_fragment((bm, bn), acc)
            pT = T.alloc_fragment((bm, bn), dtype)
            dsT = T.alloc_fragment((bm, bn), dtype)
            dq = T.alloc_fragment((bn, D), acc) if with_dq else None
            dk = T.alloc_fragment((bm, D), acc)
            dv = T.alloc_fragment((bm, D), acc)
            lse_r = T.alloc_fragment((bn,), acc) if config.stats_early else None
            delta_r = T.alloc_fragment((bn,), acc) if config.stats_early > 1 else None
            kv_full = T.alloc_barrier([128])
            full = T.alloc_barrier([128] * S)
            empty = T.alloc_barrier([consumers] * S)
            if dq_producer:
                dq_full = T.alloc_barrier([consumers])  # dq_s written (consumers)
                dq_empty = T.alloc_barrier([128])  # dq_s read by TMA (producer)

            offset = Sk - Sq
            q_start = T.max(T.floordiv(bx * bm - offset, bn), 0) if causal else 0
            n_q = T.max(T.ceildiv(Sq, bn) - q_start, 0)

            with T.ws(consumers // 128):
                T.dec_max_nreg(PRODUCER_REGS)
                T.tma_copy(K[bz, bx * bm : (bx + 1) * bm, by, :], k_s, barrier=kv_full)
                T.tma_copy(V[bz, bx * bm : (bx + 1) * bm, by, :], v_s, barrier=kv_full)
                T.mbarrier_arrive(kv_full)
                for it in T.serial(groups * n_q):
                    st = it % S
                    h, qb = head_and_block(it, by, q_start, n_q)
                    T.mbarrier_wait_parity(empty[st], ((it // S) & 1) ^ 1)
                    T.tma_copy(Q[bz, qb * bn : (qb + 1) * bn, h, :], q_s[st, :, :], barrier=full[st])
                    T.tma_copy(dO[bz, qb * bn : (qb + 1) * bn, h, :], do_s[st, :, :], barrier=full[st])
                    # (tensor-map loads: rows past SqP are clipped, the stage's tail filled with 0)
                    T.tma_copy(LSE2[bz, h, qb * bn : (qb + 1) * bn], lse_s[st, :], barrier=full[st])
                    T.tma_copy(Delta[bz, h, qb * bn : (qb + 1) * bn], delta_s[st, :], barrier=full[st])
                    T.mbarrier_arrive(full[st])
                    if dq_producer:
                        if it > 0:
                            reduce_dq(dQacc, dq_s, dq_full, dq_empty, it - 1, bz, by, q_start, n_q)
                if dq_producer:
                    if groups * n_q > 0:
                        reduce_dq(dQacc, dq_s, dq_full, dq_empty, groups * n_q - 1, bz, by, q_start, n_q)
            with T.ws(*range(consumers // 128)):
                T.inc_max_nreg(warpgroup_regs(consumers))
                T.clear(dk)
                T.clear(dv)
                T.mbarrier_wait_parity(kv_full, 0)  # also before the epilogue reuses k_s/v_s
                for step in consumer_steps(n_q):
                    it, h, qb = step_coords(step, by, q_start, n_q)
                    st = it % S
                    T.mbarrier_wait_parity(full[st], (it // S) & 1)
                    # Zeroed here rather than by the wgmma's scale-d flag: the accumulators are
                    # then dead between steps, which ptxas cannot see through the asm operands.
                    T.clear(sT)
                    T.clear(dpT)
                    if config.stats_early:
                        T.copy(lse_s[st, :], lse_r)
                    T.wgmma_gemm(k_s, q_s[st, :, :], sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(v_s, do_s[st, :, :], dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)  # S^T landed; dP^T may still run
                    # P^T is on the path to the dV wgmma: steps every query of which sees every
                    # key skip the mask arithmetic (H200: +1% at D=128, +2-3% causal). Without
                    # skip_mask, `interior` is Python's False and only the masked loop is emitted.
                    if config.stats_early > 1:  # read under the exp2s below, used after the next wait
                        T.copy(delta_s[st, :], delta_r)
                    if skip_mask and sees_all(bx, qb, offset):
                        for i, j in T.Parallel(bm, bn):
                            sT[i, j] = T.exp2(sT[i, j] * scale_log2 - step_stat(lse_s, lse_r, st, j))
                    else:
                        for i, j in T.Parallel(bm, bn):
                            sT[i, j] = prob_T(sT[i, j], i, j, step_stat(lse_s, lse_r, st, j), bx, qb, offset)
                    T.copy(sT, pT)
                    T.wgmma_gemm(pT, do_s[st, :, :], dv, policy=T.GemmWarpPolicy.FullRow)  # dV += P^T dO
                    T.wait_wgmma(1)  # dP^T landed; dV may still run
                    for i, j in T.Parallel(bm, bn):
                        dsT[i, j] = sT[i, j] * (dpT[i, j] - step_stat(delta_s, delta_r, st, j)) * scale
                    if not dq_first:
                        T.wgmma_gemm(dsT, q_s[st, :, :], dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dS^T Q
                    if with_dq:
                        # dQ = dS K sums over all bm keys: every warpgroup's dS^T goes through
                        # shared memory first (generic-proxy writes, then read by the async proxy).
                        # ds_s is free once every warpgroup's previous dQ wgmma retired: before
                        # the dQ barrier below, or (dq_producer) before its arrival on dq_full.
                        if dq_producer:
                            if it > 0:
                                T.mbarrier_wait_parity(dq_full, (it - 1) & 1)
                        T.copy(dsT, ds_s)
                        T.fence_proxy_async()
                        T.sync_threads(1, consumers)
                        T.clear(dq)
                        T.wgmma_gemm(ds_s, k_s, dq, transpose_A=True)
                    if dq_first:
                        T.wgmma_gemm(dsT, q_s[st, :, :], dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dS^T Q
                        T.wait_wgmma(1)  # dQ retired; dK may still run
                        hand_over_dq(dq, dq_s, dq_full, dq_empty, it)
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(empty[st])
                    if dq_producer and not dq_first:
                        hand_over_dq(dq, dq_s, dq_full, dq_empty, it)
                    elif with_dq and not dq_producer:
                        # dq_s is free: the thread that issued the previous reduce-add waited for
                        # its read before it reached the dS barrier every thread has passed since.
                        # (Measured no faster, H200 2026-12-01: this barrier and reduce-add issued
                        # under the next step's S^T/dP^T wgmmas; 80-query steps with dQ^T = K^T dS^T,
                        # FlashAttention-3's hdim-128 tile, whose transposed dS/dQ stores cost more
                        # than the wider wgmmas gain.)
                        T.copy(dq, dq_s)
                        T.fence_proxy_async()
                        T.sync_threads(1, consumers)
                        T.atomic_add(dQacc[bz, qb * bn : (qb + 1) * bn, h, :], dq_s, use_tma=True)
                # K and V are no longer read (every wgmma has retired): dK, dV leave through them.
                T.sync_threads(1, consumers)
                T.copy(dv, v_s)
                T.copy(dk, k_s)
                T.fence_proxy_async()
                T.sync_threads(1, consumers)
                T.copy(v_s, dV[bz, bx * bm : (bx + 1) * bm, by, :])
                T.copy(k_s, dK[bz, bx * bm : (bx + 1) * bm, by, :])

    return body if config.pipeline == "auto" else body_async


@kernel("attention", "flash_bwd", pass_configs=_PASS_CONFIGS)
def flash_bwd_kernel(config: BwdConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float, dq: bool = True):
    """One CTA per (key block, kv head, batch): walks every query block of every query head in the
    GQA group, so dK/dV accumulate in registers and are written once (deterministic, no atomics).
    dq=True: dQ tiles are also atomically added into a zeroed fp32 (B, Sq, H, D) buffer (fast, not
    deterministic). dq=False: dK/dV only, no dQacc argument; `flash_bwd_dq` computes dQ."""
    B, Sq, SqP, Sk, H, HK = dims = _bwd_dims()
    D = headdim
    acc = "float32"
    body = _bwd_body(config, headdim, dtype, causal, groups, scale, dq, dims)

    # T.prim_func needs an explicit signature per argument list: with and without dQacc.
    if dq:

        @T.prim_func
        def flash_bwd(
            Q: _qkv_param("q", (B, Sq, H, D), dtype),
            K: _qkv_param("k", (B, Sk, HK, D), dtype),
            V: _qkv_param("v", (B, Sk, HK, D), dtype),
            dO: T.Tensor((B, Sq, H, D), dtype),
            LSE2: T.Tensor((B, H, SqP), acc),  # base-2 LSE from the preprocess kernel, Sq padded
            Delta: T.Tensor((B, H, SqP), acc),
            dQacc: T.Tensor((B, Sq, H, D), acc),  # zeroed by the caller
            dK: T.Tensor((B, Sk, HK, D), dtype),
            dV: T.Tensor((B, Sk, HK, D), dtype),
        ):
            body(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV)

    else:

        @T.prim_func
        def flash_bwd(
            Q: _qkv_param("q", (B, Sq, H, D), dtype),
            K: _qkv_param("k", (B, Sk, HK, D), dtype),
            V: _qkv_param("v", (B, Sk, HK, D), dtype),
            dO: T.Tensor((B, Sq, H, D), dtype),
            LSE2: T.Tensor((B, H, SqP), acc),
            Delta: T.Tensor((B, H, SqP), acc),
            dK: T.Tensor((B, Sk, HK, D), dtype),
            dV: T.Tensor((B, Sk, HK, D), dtype),
        ):
            body(Q, K, V, dO, LSE2, Delta, None, dK, dV)

    return flash_bwd


@kernel("attention", "flash_bwd_fused", pass_configs=_PASS_CONFIGS)
def flash_bwd_fused_kernel(config: BwdConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float, packed: bool = False):
    """The default backward in one host call: the preprocess (Delta, base-2 LSE, dQacc zeroed),
    flash_bwd (dK, dV, dQ reduce-added into dQacc) and the dQ conversion, as three `T.Kernel`s of
    one prim_func, launched in order on one stream. Same kernels as the three separate launches
    (the preprocess at prep_config(headdim), the main one at `config`); one tvm_ffi call instead of three.
    (H200, session 8: 16.9 vs 17.6 us of host function time per backward; the driver's launches
    and the main kernel's nine TMA descriptor encodes are most of it, not the call itself.)
    packed: one (B, S, 3, H, D) gradient for flash_attn_qkvpacked (no stack of three afterwards):
    dQ is that whole tensor (the conversion writes slice 0 with static inner strides, so its
    stores stay vectorized), dK and dV its slices 1 and 2 (symbolic strides, like q/k/v: the main
    kernel's TMA stores take them as they are)."""
    B, Sq, SqP, Sk, H, HK = dims = _bwd_dims()
    D = headdim
    acc = "float32"
    prep_cfg = prep_config(headdim)
    prep = _prep_body(prep_cfg, headdim, dtype, True, (B, Sq, SqP, H))
    main = _bwd_body(config, headdim, dtype, causal, groups, scale, True, dims)
    blk = prep_cfg.block

    @T.prim_func
    def flash_bwd_fused(
        Q: _qkv_param("q", (B, Sq, H, D), dtype),
        K: _qkv_param("k", (B, Sk, HK, D), dtype),
        V: _qkv_param("v", (B, Sk, HK, D), dtype),
        O: T.Tensor((B, Sq, H, D), dtype),
        dO: T.Tensor((B, Sq, H, D), dtype),
        LSE: T.Tensor((B, H, Sq), acc),
        Delta: T.Tensor((B, H, SqP), acc),
        LSE2: T.Tensor((B, H, SqP), acc),
        dQacc: T.Tensor((B, Sq, H, D), acc),  # scratch, zeroed by the preprocess
        dQ: T.Tensor((B, Sq, 3, H, D), dtype) if packed else T.Tensor((B, Sq, H, D), dtype),
        dK: _qkv_param("dk", (B, Sk, HK, D), dtype) if packed else T.Tensor((B, Sk, HK, D), dtype),
        dV: _qkv_param("dv", (B, Sk, HK, D), dtype) if packed else T.Tensor((B, Sk, HK, D), dtype),
    ):
        prep(O, dO, LSE, Delta, LSE2, dQacc)
        main(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV)
        # dQ conversion, over the preprocess's grid: blk query rows of one head per CTA
        with T.Kernel(T.ceildiv(Sq, blk), H, B, threads=prep_cfg.threads) as (bx, by, bz):
            for i, j in T.Parallel(blk, D):
                if bx * blk + i < Sq:
                    if packed:
                        dQ[bz, bx * blk + i, 0, by, j] = T.Cast(dtype, dQacc[bz, bx * blk + i, by, j])
                    else:
                        dQ[bz, bx * blk + i, by, j] = T.Cast(dtype, dQacc[bz, bx * blk + i, by, j])

    return flash_bwd_fused


# ---------------------------------------------------------------------------------------------
# Backward when every key fits one block: one kernel, no scratch
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmallBwdConfig:
    block_m: int = 128  # keys: all of them (Sk <= block_m)
    block_n: int = 64  # query rows per step
    threads: int = 256

    def for_arch(self, arch: str) -> "SmallBwdConfig":
        return self


SMALL_BWD_KEYS = SmallBwdConfig().block_m  # the op takes flash_bwd_small up to this many keys
SMALL_BWD_HEADDIMS = (64, 128)  # D=256: K, V, dK, dV tiles of 128 keys would not fit shared memory


@kernel("attention", "flash_bwd_small", pass_configs=_PASS_CONFIGS)
def flash_bwd_small_kernel(config: SmallBwdConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float):
    """The whole backward for Sk <= block_m keys, in one kernel and without scratch buffers. One CTA
    per (kv head, batch) holds K, V and the dK, dV accumulators of every key and walks each query
    block of its GQA group's heads (as flash_bwd's CTA walks them for one key block). The
    preprocess folds into the walk: Delta = rowsum(dO * O) and the base-2 LSE come from the step's
    own rows. With a single key block no other CTA adds to a query row's dQ, so the dQ tile is
    stored once in dtype: no fp32 accumulator, no atomics, no conversion kernel. For short
    sequences the host path is the cost: one launch instead of three (~4.5 µs each on the H200
    host) and no scratch allocation. Deterministic."""
    B, Sq, _, Sk, H, HK = _bwd_dims()  # no padded SqP: Delta and the base-2 LSE never reach memory
    D = headdim
    bm, bn = config.block_m, config.block_n
    acc = "float32"
    scale_log2 = scale * LOG2E

    @T.prim_func
    def flash_bwd_small(
        Q: _qkv_param("q", (B, Sq, H, D), dtype),
        K: _qkv_param("k", (B, Sk, HK, D), dtype),
        V: _qkv_param("v", (B, Sk, HK, D), dtype),
        O: T.Tensor((B, Sq, H, D), dtype),
        dO: T.Tensor((B, Sq, H, D), dtype),
        LSE: T.Tensor((B, H, Sq), acc),
        dQ: _qkv_param("dq", (B, Sq, H, D), dtype),  # strided: the packed op's slices of dqkv
        dK: _qkv_param("dk", (B, Sk, HK, D), dtype),
        dV: _qkv_param("dv", (B, Sk, HK, D), dtype),
    ):
        with T.Kernel(HK, B, threads=config.threads) as (by, bz):
            k_s = T.alloc_shared((bm, D), dtype)
            v_s = T.alloc_shared((bm, D), dtype)
            q_s = T.alloc_shared((bn, D), dtype)
            do_s = T.alloc_shared((bn, D), dtype)
            lse_s = T.alloc_shared((bn,), acc)
            delta_s = T.alloc_shared((bn,), acc)
            ds_s = T.alloc_shared((bm, bn), dtype)
            dq_s = T.alloc_shared((bn, D), dtype)
            out_s = T.alloc_shared((bm, D), dtype)  # dV, then dK, on their way out
            sT = T.alloc_fragment((bm, bn), acc)  # S^T, then P^T
            dpT = T.alloc_fragment((bm, bn), acc)  # dP^T = V dO^T
            pT = T.alloc_fragment((bm, bn), dtype)
            dsT = T.alloc_fragment((bm, bn), dtype)
            o_s = T.alloc_shared((bn, D), dtype)
            prod = T.alloc_fragment((bn, D), acc)
            delta = T.alloc_fragment((bn,), acc)
            dq = T.alloc_fragment((bn, D), acc)
            dk = T.alloc_fragment((bm, D), acc)
            dv = T.alloc_fragment((bm, D), acc)

            offset = Sk - Sq
            n_q = T.ceildiv(Sq, bn)
            T.copy(K[bz, 0:bm, by, :], k_s)
            T.copy(V[bz, 0:bm, by, :], v_s)
            T.clear(dk)
            T.clear(dv)
            # Two loops, not one over groups * n_q: with h = it // n_q, qb = it % n_q every strided
            # element access re-derived them (int64 division and modulo per element; 2.7x the fused
            # backward's GPU time on the H200, session 26).
            for hh, qb in T.grid(groups, n_q):
                h = by * groups + hh
                T.copy(Q[bz, qb * bn : (qb + 1) * bn, h, :], q_s)
                T.copy(dO[bz, qb * bn : (qb + 1) * bn, h, :], do_s)
                T.copy(O[bz, qb * bn : (qb + 1) * bn, h, :], o_s)
                for i, j in T.Parallel(bn, D):  # the preprocess's Delta, for this step's rows (the tiles' rows past Sq are zeros)
                    prod[i, j] = T.Cast(acc, o_s[i, j]) * T.Cast(acc, do_s[i, j])
                T.reduce_sum(prod, delta, dim=1)
                for i in T.Parallel(bn):
                    delta_s[i] = delta[i]
                    lse_s[i] = T.if_then_else(qb * bn + i < Sq, LSE[bz, h, T.min(qb * bn + i, Sq - 1)] * LOG2E, 0)
                T.gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    # P^T from S^T and the query's base-2 LSE: a select (lse is -inf on a row that
                    # sees no key, and the tiles' rows past Sk / Sq are zeros)
                    visible = (i < Sk) & (qb * bn + j < Sq)
                    if causal:
                        visible = visible & (i <= qb * bn + j + offset)
                    sT[i, j] = T.if_then_else(visible, T.exp2(sT[i, j] * scale_log2 - lse_s[j]), 0)
                T.copy(sT, pT)
                T.gemm(pT, do_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += P^T dO
                for i, j in T.Parallel(bm, bn):
                    dsT[i, j] = sT[i, j] * (dpT[i, j] - delta_s[j]) * scale  # dS^T, softmax scale folded in
                T.copy(dsT, ds_s)
                T.gemm(dsT, q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dS^T Q
                T.gemm(ds_s, k_s, dq, transpose_A=True, clear_accum=True)  # dQ = dS K: complete (one key block)
                T.copy(dq, dq_s)
                T.copy(dq_s, dQ[bz, qb * bn : (qb + 1) * bn, h, :])
            T.copy(dv, out_s)
            T.copy(out_s, dV[bz, 0:bm, by, :])
            T.copy(dk, out_s)
            T.copy(out_s, dK[bz, 0:bm, by, :])

    return flash_bwd_small


# ---------------------------------------------------------------------------------------------
# Deterministic backward: flash_bwd(dq=False) for dK/dV, and dQ from its own kernel
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DqConfig:
    block_m: int = 128  # query rows per CTA (their dQ rows held in registers)
    block_n: int = 64  # keys per pipeline step
    num_stages: int = 2
    threads: int = 256
    # dS as the register operand of the dQ GEMM; False stages it in shared memory, needed when the
    # GEMM splits N over warps (64 rows on 8 warps, D=256).
    rs_gemm: bool = True

    def for_arch(self, arch: str) -> "DqConfig":
        return self if _is_hopper(arch) else dataclasses.replace(self, num_stages=1)


def dq_default_config(headdim: int, causal: bool, arch: str = "sm_90a") -> DqConfig:
    """Not tuned yet (no GPU when written): mirrors the main backward's tile choices."""
    if not _is_hopper(arch):  # Ampere: one stage, see fwd_default_config; 164 KB shared memory
        return DqConfig(128, 64, 1, 256) if headdim <= 128 else DqConfig(64, 32, 1, 256, False)
    if headdim <= 64:
        return DqConfig(128, 128, 2, 256)
    if headdim <= 128:
        return DqConfig(128, 64, 2, 256)
    # D=256: 64 query rows (two stages of 64-key K/V tiles: 201 KB of shared memory); 64x256 fp32
    # dQ needs 8 warps to stay in registers, so dS goes through shared memory.
    return DqConfig(64, 64, 2, 256, False)


DQ_SEARCH_SPACE = [
    DqConfig(bm, bn, st, th, rs)
    for bm, bn, th, rs in ((128, 64, 256, True), (128, 128, 256, True), (64, 64, 128, True), (64, 128, 128, True), (64, 64, 256, False))
    for st in (1, 2)
]


@kernel("attention", "flash_bwd_dq", pass_configs=_PASS_CONFIGS)
def flash_bwd_dq_kernel(config: DqConfig, headdim: int, dtype: str, causal: bool, groups: int, scale: float):
    """dQ without atomics: one CTA per (query block, head, batch) walks the key blocks its rows see,
    in a fixed order, recomputing P = exp2(S * scale * log2(e) - lse2) from the base-2 LSE that
    flash_bwd_prep writes. dS = P * (dO V^T - Delta); dQ = scale * sum over key blocks of dS K,
    fp32 in registers, written once in dtype. Run to run bitwise identical: no atomics, no
    accumulation order that depends on scheduling. Costs a second S and dP GEMM per (query, key)
    block pair (7 GEMMs in all instead of 5), in exchange for no fp32 dQ buffer and no cast."""
    B, Sq, SqP, Sk, H, HK = _bwd_dims()
    D = headdim
    bm, bn = config.block_m, config.block_n
    acc = "float32"
    scale_log2 = scale * LOG2E

    @T.prim_func
    def flash_bwd_dq(
        Q: _qkv_param("q", (B, Sq, H, D), dtype),
        K: _qkv_param("k", (B, Sk, HK, D), dtype),
        V: _qkv_param("v", (B, Sk, HK, D), dtype),
        dO: T.Tensor((B, Sq, H, D), dtype),
        LSE2: T.Tensor((B, H, SqP), acc),  # base-2 LSE from the preprocess kernel, Sq padded
        Delta: T.Tensor((B, H, SqP), acc),
        dQ: T.Tensor((B, Sq, H, D), dtype),
    ):
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=config.threads) as (bx, by, bz):
            q_s = T.alloc_shared((bm, D), dtype)
            do_s = T.alloc_shared((bm, D), dtype)
            k_s = T.alloc_shared((bn, D), dtype)
            v_s = T.alloc_shared((bn, D), dtype)
            lse_s = T.alloc_shared((bm,), acc)
            delta_s = T.alloc_shared((bm,), acc)
            ds_s = T.alloc_shared((bm, bn), dtype)
            dq_s = T.alloc_shared((bm, D), dtype)
            s = T.alloc_fragment((bm, bn), acc)  # S, then P
            dp = T.alloc_fragment((bm, bn), acc)  # dP = dO V^T
            ds = T.alloc_fragment((bm, bn), dtype)
            dq = T.alloc_fragment((bm, D), acc)

            # Causal: heaviest query tiles first, as in the forward.
            qt = T.ceildiv(Sq, bm) - 1 - bx if causal else bx
            kvh = by // groups
            offset = Sk - Sq  # bottom-right causal alignment
            T.copy(Q[bz, qt * bm : (qt + 1) * bm, by, :], q_s)
            T.copy(dO[bz, qt * bm : (qt + 1) * bm, by, :], do_s)
            T.copy(LSE2[bz, by, qt * bm : (qt + 1) * bm], lse_s)
            T.copy(Delta[bz, by, qt * bm : (qt + 1) * bm], delta_s)
            T.clear(dq)
            if causal:
                # At least one (fully masked, P = 0) step for a tile that sees no key (Sq > Sk), so
                # the pipeline never has zero trips; its rows then write dQ = 0.
                n_blocks = T.max(T.min(T.ceildiv(Sk, bn), T.ceildiv((qt + 1) * bm + offset, bn)), 1)
            else:
                n_blocks = T.ceildiv(Sk, bn)

            for kb in T.Pipelined(n_blocks, num_stages=config.num_stages):
                T.copy(K[bz, kb * bn : (kb + 1) * bn, kvh, :], k_s)
                T.copy(V[bz, kb * bn : (kb + 1) * bn, kvh, :], v_s)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, v_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    # select, not multiply: TMA zero-fills keys >= Sk (score 0, not -inf), and lse2
                    # is -inf on rows that see no key (exp2 -> inf there)
                    if causal:
                        s[i, j] = T.if_then_else(
                            (kb * bn + j < Sk) & (kb * bn + j <= qt * bm + i + offset),
                            T.exp2(s[i, j] * scale_log2 - lse_s[i]),
                            0,
                        )
                    else:
                        s[i, j] = T.if_then_else(kb * bn + j < Sk, T.exp2(s[i, j] * scale_log2 - lse_s[i]), 0)
                for i, j in T.Parallel(bm, bn):
                    ds[i, j] = s[i, j] * (dp[i, j] - delta_s[i]) * scale  # softmax scale folded in
                if config.rs_gemm:
                    T.gemm(ds, k_s, dq, policy=T.GemmWarpPolicy.FullRow)  # dQ += dS K
                else:
                    T.copy(ds, ds_s)
                    T.gemm(ds_s, k_s, dq)

            T.copy(dq, dq_s)
            T.copy(dq_s, dQ[bz, qt * bm : (qt + 1) * bm, by, :])

    return flash_bwd_dq


@dataclass(frozen=True)
class CastConfig:
    block: int = 4096  # elements per CTA: 16 per thread = four 16-byte fp32 loads
    threads: int = 256

    def for_arch(self, arch: str) -> "CastConfig":
        return self


@kernel("attention", "cast_f32", pass_configs=_PASS_CONFIGS)
def cast_f32_kernel(config: CastConfig, dtype: str):
    """dQ conversion: fp32 accumulator -> dtype, flat, symbolic int64 length (B*Sq*H*D may pass 2^31)."""
    N = T.dynamic("N", "int64")
    blk = config.block

    @T.prim_func
    def cast_f32(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, blk), threads=config.threads) as bx:
            base = T.Cast("int64", bx) * blk
            if base + blk <= N:
                for i in T.Parallel(blk):
                    Y[base + i] = T.Cast(dtype, X[base + i])
            else:
                for i in T.Parallel(blk):
                    if base + i < N:
                        Y[base + i] = T.Cast(dtype, X[base + i])

    return cast_f32


flash_fwd_kernel = _arch_aware(flash_fwd_kernel)
flash_bwd_prep_kernel = _arch_aware(flash_bwd_prep_kernel)
flash_bwd_kernel = _arch_aware(flash_bwd_kernel)
flash_bwd_fused_kernel = _arch_aware(flash_bwd_fused_kernel)
flash_bwd_small_kernel = _arch_aware(flash_bwd_small_kernel)
flash_bwd_dq_kernel = _arch_aware(flash_bwd_dq_kernel)
cast_f32_kernel = _arch_aware(cast_f32_kernel)


def default_config(headdim: int, causal: bool, arch: str = "sm_90a", kind: str = "fwd", seqlen: Optional[int] = None):
    """Default config of the forward ("fwd"), backward main ("bwd") or deterministic dQ ("dq") kernel
    (seqlen: see LENGTH_BOUNDS)."""
    if kind == "dq":
        return dq_default_config(headdim, causal, arch)
    return {"fwd": fwd_default_config, "bwd": bwd_default_config}[kind](headdim, causal, arch, seqlen)


SEARCH_SPACE = {"fwd": FWD_SEARCH_SPACE, "bwd": BWD_SEARCH_SPACE, "dq": DQ_SEARCH_SPACE}


def default_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


# (kernel, config, static args) that `tileops export` writes and `tileops check` compiles.
REPRESENTATIVE = [
    (flash_fwd_kernel, fwd_default_config(128, False), dict(headdim=128, dtype="bfloat16", causal=False, groups=1, scale=default_scale(128))),
    (flash_fwd_kernel, fwd_default_config(128, True), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    # the causal D=128 defaults for at most PERSISTENT_CAUSAL_KEYS and SHORT_CAUSAL_KEYS keys
    (flash_fwd_kernel, fwd_default_config(128, True, seqlen=PERSISTENT_CAUSAL_KEYS), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    (flash_fwd_kernel, fwd_default_config(128, True, seqlen=SHORT_CAUSAL_KEYS), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    (flash_fwd_kernel, fwd_default_config(64, False), dict(headdim=64, dtype="bfloat16", causal=False, groups=1, scale=default_scale(64))),
    (flash_fwd_kernel, fwd_default_config(64, True), dict(headdim=64, dtype="bfloat16", causal=True, groups=1, scale=default_scale(64))),
    # the non-causal D=64 default for at most SHORT_ROWS[64] query rows
    (flash_fwd_kernel, fwd_default_config(64, False, seqlen=SHORT_ROWS[64]), dict(headdim=64, dtype="bfloat16", causal=False, groups=1, scale=default_scale(64))),
    # ... and the non-causal D=128 one
    (flash_fwd_kernel, fwd_default_config(128, False, seqlen=SHORT_ROWS[128]), dict(headdim=128, dtype="bfloat16", causal=False, groups=1, scale=default_scale(128))),
    # the hand-synchronized pipelines the tuner may pick (FWD_SEARCH_SPACE)
    (flash_fwd_kernel, FwdConfig(128, 128, 2, 256, "async"), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    (flash_fwd_kernel, FwdConfig(128, 128, 2, 256, "pingpong"), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    (flash_bwd_prep_kernel, prep_config(128), dict(headdim=128, dtype="bfloat16")),
    (flash_bwd_kernel, bwd_default_config(128, True), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    # D=256 keeps TileLang's T.Pipelined backward (the async one needs 64 keys per warpgroup)
    (flash_bwd_kernel, bwd_default_config(256, False), dict(headdim=256, dtype="bfloat16", causal=False, groups=1, scale=default_scale(256))),
    (cast_f32_kernel, CastConfig(), dict(dtype="bfloat16")),
    # the default backward in one host call (preprocess + main + dQ conversion), non-causal: three
    # stages, and two up to BWD_STAGES3_KEYS keys
    (flash_bwd_fused_kernel, bwd_default_config(128, False), dict(headdim=128, dtype="bfloat16", causal=False, groups=1, scale=default_scale(128))),
    (flash_bwd_fused_kernel, bwd_default_config(128, False, seqlen=BWD_STAGES3_KEYS), dict(headdim=128, dtype="bfloat16", causal=False, groups=1, scale=default_scale(128))),
    # the same writing dQ/dK/dV into the slices of one packed (B, S, 3, H, D) gradient (GPT-2's shape)
    (flash_bwd_fused_kernel, bwd_default_config(64, True), dict(headdim=64, dtype="bfloat16", causal=True, groups=1, scale=default_scale(64), packed=True)),
    # at most SMALL_BWD_KEYS keys: the whole backward in one kernel (GQA: a CTA walks its group's heads)
    (flash_bwd_small_kernel, SmallBwdConfig(), dict(headdim=128, dtype="bfloat16", causal=True, groups=4, scale=default_scale(128))),
    # deterministic backward: prep without the dQ accumulator, dK/dV only, dQ without atomics
    (flash_bwd_prep_kernel, prep_config(128), dict(headdim=128, dtype="bfloat16", dq=False)),
    (flash_bwd_kernel, bwd_default_config(128, True), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128), dq=False)),
    (flash_bwd_dq_kernel, dq_default_config(128, True), dict(headdim=128, dtype="bfloat16", causal=True, groups=1, scale=default_scale(128))),
    (flash_bwd_dq_kernel, dq_default_config(256, False), dict(headdim=256, dtype="bfloat16", causal=False, groups=4, scale=default_scale(256))),
]
