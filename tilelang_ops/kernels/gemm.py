"""Tensor-core GEMM with a fused bias + activation epilogue, and the pieces its backward needs.

One builder, three operand layouts (row-major storage everywhere):

    layout  C (rows × N)        A stored     B stored     reduction  used by
    "nn"    A @ B               (M, K)       (K, N)       K static   gemm, linear's dX = dZ @ W
    "nt"    A @ Bᵀ              (M, K)       (N, K)       K static   linear forward, gemm's dA
    "tn"    Aᵀ @ B              (K, P)       (K, N)       K dynamic  weight gradients dW = dZᵀ @ X

For "nn"/"nt" the row count M (tokens) is symbolic and N, K (weight shapes) are static, so one
kernel serves every token count. For "tn" the output (P, N) is a weight shape (static) and the
reduction runs over the symbolic token dimension. `batched=True` adds a symbolic leading batch
dimension to A, B and C, mapped to gridDim.z.

On sm_90a, TileLang lowers T.copy global→shared inside T.Pipelined to TMA (out-of-range rows and
columns are zero-filled, so ragged tiles need no guards in the main loop) and T.gemm to wgmma,
and warp-specializes the loop: `threads` counts consumer threads only; a 128-thread producer
warpgroup is added. TMA needs every row stride to be a multiple of 16 bytes: the op layer pads
K and N to multiples of 8 elements before calling these kernels.

Three Hopper main loops (`GemmConfig.pipeline`): "auto" (that T.Pipelined loop), "async" (our own
producer/consumer mbarrier ring, one wgmma batch in flight) and "pingpong" (the async ring made
persistent: one CTA per SM walks the tiles, each consumer warpgroup computes its own tiles and
the two take turns at the main loop, so one's epilogue runs under the other's k-steps; C leaves
from registers or, with `tma_store`, through the warpgroup's own shared tile and a TMA store). Which
one serves a shape is measured: DEFAULT_OVERRIDES.
"""
# No `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations below
# against the closure, and string annotations would not see shapes used only there.
import dataclasses
import math
from dataclasses import dataclass

import tilelang.language as T

from ..runtime import HAND_SYNC_PASS_CONFIGS, PERSISTENT_CTAS, PRODUCER_REGS, kernel, warpgroup_regs

DTYPES = ("float16", "bfloat16")
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
LAYOUTS = ("nn", "nt", "tn")


@dataclass(frozen=True)
class GemmConfig:
    block_M: int = 128
    block_N: int = 256
    block_K: int = 64
    num_stages: int = 3
    threads: int = 256  # consumer threads under warp specialization (Hopper adds a producer warpgroup)
    swizzle: int = 8  # T.use_swizzle panel size (L2 reuse across neighbouring CTAs); 0 = off
    policy: str = "Square"  # T.GemmWarpPolicy member: Square | FullRow | FullCol
    # CTAs resident per SM (__launch_bounds__' second argument); 2 lets one CTA's epilogue overlap
    # the other's main loop. The setmaxnreg split that fits is derived (`warpgroup_regs`).
    # 0 = TileLang's defaults (one CTA per SM, 24/240).
    min_blocks: int = 0
    # "auto": TileLang's warp-specialized T.Pipelined, each k-step's wgmma drained before the next
    # (warpgroup_wait<0>). "async": our own producer/consumer mbarrier pipeline that keeps one
    # k-step's wgmma in flight while the next is issued, releasing a stage only after its wgmma
    # retired (sm_90 only; see `body_async` in `matmul_kernel`). "pingpong": async, persistent
    # (one CTA per SM walks the tiles), each consumer warpgroup a whole block_M x block_N tile of
    # its own, so one warpgroup's epilogue overlaps the other's main loop (`body_pingpong`).
    pipeline: str = "auto"
    # Weight gradients ("tn") only: the token reduction cut into `split_k` slices, one CTA each
    # (gridDim.z), fp32 partial tiles summed and cast by a second kernel of the same launch. For
    # a small output with a long reduction (GPT-2's 3072x768 over 16384 tokens: 72 tiles of
    # 128x256 on 132 SMs) the one-tile-per-CTA grid leaves SMs idle; 64 tiles of 192x192 x 2
    # slices fill one wave (cuBLAS's choice there). Deterministic: a fixed summation order.
    split_k: int = dataclasses.field(default=1, metadata={"omit_default": True})
    # "pingpong" only: C leaves through a shared tile of the warpgroup's own (stmatrix) and a TMA
    # store, as cuBLAS's epilogues do, instead of straight from the wgmma fragment, whose 4-byte
    # stores fill half of each 32-byte sector: twice the store sectors, and the stores throttle
    # the load/store queue (Nsight Compute at 4096x3072x768, session 32). Costs two C tiles of
    # shared memory, i.e. stages.
    tma_store: bool = dataclasses.field(default=False, metadata={"omit_default": True})

    # warp-role branches on a warp-uniform index (runtime.uniform_warpgroups)
    uniform_ws: bool = dataclasses.field(default=False, metadata={"omit_default": True})

    @property
    def min_sm(self) -> int:
        # wgmma + TMA + setmaxnreg: no sm_80 form. Split-K neither: on sm_80 TileLang 0.1.15's
        # cp.async pipeline fails in codegen on the slice's symbolic trip count (Ampere's default
        # table never splits).
        return 90 if self.pipeline != "auto" or self.split_k > 1 else 0

    def __post_init__(self):
        if self.tma_store and self.pipeline != "pingpong":
            raise ValueError(f"GemmConfig.tma_store is the 'pingpong' pipeline's epilogue, got pipeline={self.pipeline!r}")

    def pass_configs(self) -> dict:
        if self.tma_store:
            # The two warpgroups' C tiles are each used in one warp-specialized branch: the
            # shared-memory planner would give both the same bytes.
            return {**HAND_SYNC_PASS_CONFIGS, "tl.disable_shared_memory_reuse": True}
        return HAND_SYNC_PASS_CONFIGS if self.pipeline != "auto" else {}


# Defaults per (arch, shape class). The static dims (N, K; output rows for "tn") are baked into
# a kernel; the symbolic token count M only selects one of three buckets (`m_bucket`), each with
# its own lazily compiled kernel, so a layer still compiles at most three kernels.
_HOPPER_LARGE = GemmConfig(128, 256, 64, 3, 256, 8, "Square")  # 760 TFLOP/s at 8192³ (cuBLAS 783)
_HOPPER_NARROW = GemmConfig(128, 128, 64, 4, 256, 8, "Square")  # N ≤ 128: a 256-wide tile would be half empty
_AMPERE = GemmConfig(128, 128, 32, 3, 256, 8, "Square")  # no wgmma/TMA: mma.sync + cp.async, 164 KB smem
_AMPERE_TN = GemmConfig(128, 128, 32, 2, 256, 8, "Square")  # 3 cp.async stages over a symbolic trip count fail to lower

# Symbolic-M buckets: bucket b serves M <= M_BUCKET_BOUNDS[b] (the last one: everything larger).
# For "nn"/"nt" M is the row count (times the batch); for "tn" it is the token (reduction) count.
M_BUCKET_BOUNDS = (1536, 6144)
M_BUCKET_NAMES = ("m<=1536", "m<=6144", "m>6144")
M_BUCKET_REP = (1024, 4096, 16384)  # representative M per bucket: wave counts, tuning shapes


def m_bucket(m: int) -> int:
    return 0 if m <= 1536 else (1 if m <= 6144 else 2)


# Measured winners that override the rule below, looked up most specific first:
# ("sm_9", layout, bucket, n, k), then ("sm_9", layout, bucket, None, k) (any n), then
# ("sm_9", layout, bucket, None, None) (whole bucket). k is the output rows for "tn". An entry
# whose first element is a device name as torch reports it ("NVIDIA H100 80GB HBM3") serves that
# board only and is looked up (the same three ways) before the "sm_9" ones.
# Fill from `python -m benchmarks.sweep_gemm` (its "OVERRIDE" lines paste here).
_PP = GemmConfig(128, 128, 64, 6, 256, 8, "Square", 0, "pingpong")  # persistent ping-pong, 128x128 per warpgroup
_PP16 = GemmConfig(128, 128, 64, 6, 256, 16, "Square", 0, "pingpong")  # the same, panels of 16 tile rows
_PP16S7 = dataclasses.replace(_PP16, num_stages=7)  # and 7 stages (224 KB)
_PP7 = dataclasses.replace(_PP, num_stages=7)  # 7 stages, panels of 8
_PP192 = GemmConfig(128, 192, 64, 5, 256, 8, "Square", 0, "pingpong")  # 128x192 per warpgroup, 5 stages
# With the TMA-store epilogue (GemmConfig.tma_store): each warpgroup's C tile in shared memory
# leaves room for 5 stages of 128x128, 3 of 128x192.
_PPT = dataclasses.replace(_PP, num_stages=5, tma_store=True)
_PPT16 = dataclasses.replace(_PP16, num_stages=5, tma_store=True)
_PPT192 = dataclasses.replace(_PP192, num_stages=3, tma_store=True)
_S4 = GemmConfig(128, 256, 64, 4, 256, 8, "Square")  # T.Pipelined 128x256, 4 stages
_S4ROW = dataclasses.replace(_S4, policy="FullRow")  # the same, warps stacked along M
_H100 = "NVIDIA H100 80GB HBM3"  # torch's name of the H100 SXM: the key of its own entries
DEFAULT_OVERRIDES: dict[tuple, GemmConfig] = {
    # benchmarks/sweep_gemm.py on one H200 (bf16; GPU time from CUDA-graph replays, contenders and
    # cuBLAS in turns). "2 CTAs/SM" = min_blocks=2 (setmaxnreg 24/104): one CTA's epilogue overlaps
    # the other's main loop. "pingpong": persistent, each consumer warpgroup its own tile, the
    # epilogue of one overlapping the main loop of the other — wins where the epilogue (bias +
    # gelu_tanh, or K=768's short main loops) weighs; loses at M=1024 (about one tile per
    # warpgroup: the turns serialize) and at deep K without an epilogue (not explained: see
    # docs/benchmarks.md). Eleventh session: `session11/call1` and `call3`.
    # Swept on the H200 and keyed by "sm_9", so an H100 runs them too, except where it has its own
    # entries (below).
    # K=768 (12 k-steps a tile, so the epilogue weighs): the TMA-store ping-pong, session 32
    # (`sweep_gemm --group 'ppt_*'`, call 4; before it C left from registers in half-filled
    # sectors). 1024x3072x768: 518 vs 495 for the async 128x192 (1.05x), 1.00x cuBLAS;
    # 4096x3072x768: 603 vs 547 for the rule default (1.10x), 1.03x; 16384x3072x768: 594 vs 540
    # for _PP192 (1.10x), 0.99x.
    ("sm_9", "nn", 0, 3072, 768): _PPT192,
    ("sm_9", "nn", 1, 3072, 768): _PPT192,
    ("sm_9", "nn", 2, 3072, 768): _PPT,
    ("sm_9", "nn", 2, 768, 3072): _PP,  # 16384x768x3072 (GPT-2's MLP dX): 686 vs 635 (1.08x), 1.06x cuBLAS (session14/call1)
    ("sm_9", "nn", 2, 768, 2304): _PP,  # 16384x768x2304 (GPT-2's QKV dX): 673 vs 642 (1.05x), 1.00x cuBLAS (session15/call2)
    ("sm_9", "nn", 1, 4096, 4096): _S4,  # 4096^3: 1.03x default (fifth session)
    # 8192^3: 680 vs 649 TFLOP/s (1.05x), 1.01x cuBLAS; 128x224 and 128x192 (fewer idle SMs in the
    # last wave) 0.72-0.92x cuBLAS (`sweep_gemm --group wave_nn_8192_8192`, session20/call4)
    ("sm_9", "nn", 2, 8192, 8192): _S4,
    ("sm_9", "nn", 0, 11008, 4096): _S4ROW,  # 1024x11008x4096: 1.04x default, 1.12x cuBLAS
    ("sm_9", "nn", 1, 11008, 4096): _PP16S7,  # 4096x11008x4096: 691 vs 657 for _PP (1.05x; call1: _PP 1.025x the auto default), 1.08x cuBLAS
    # ("sm_9", "nn", 2, 11008, 4096): the rule default. _PPT swept 1.025x it (663 vs 647, session 32
    # call 5) but bench_gemm then gave the same ratio to cuBLAS with either (0.962-0.964, calls 5-6).
    ("sm_9", "nn", 1, 14336, 4096): _PP16S7,  # 4096x14336x4096: 671 vs 635 (1.06x), 0.99x cuBLAS (call3)
    # 14336 = 64 tiles of 224: 512 tiles at M=1024 fill 3.9 waves of 132 SMs (128x256: 3.4) (fifth session)
    ("sm_9", "nn", 0, 14336, 4096): _PP7,  # 1024x14336x4096: 697 vs 654 for 128x224 (1.07x), 1.12x cuBLAS
    ("sm_9", "nn", 2, 14336, 4096): _PP192,  # 16384x14336x4096: 659 vs 639 (1.03x), 0.99x cuBLAS
    # "nt" = linear (+ bias + gelu_tanh epilogue), ratios to cuBLASLt's _addmm_activation (fifth session:
    # session5/call1 and call4; eleventh: the pingpong rows, session11/call1)
    ("sm_9", "nt", 2, 768, 3072): _PP,  # 16384x768x3072 (GPT-2's MLP down-projection): 672 vs 622 (1.08x), 1.07x cuBLAS (session15/call2)
    # 4096x4096x4096: 631 vs 605 for _PP7 (1.04x), 0.99x cuBLASLt (session 34 call 1; session 33 call 6:
    # the 128x256/s4 forms 1.05x _PP7 in bench runs). _PP7 had won session 31's sweep against
    # ping-pong candidates only, before the tanh.approx epilogue.
    ("sm_9", "nt", 1, 4096, 4096): _S4ROW,
    ("sm_9", "nt", 2, 4096, 4096): _S4ROW,  # 16384x4096x4096: 1.026x default, 0.955x
    # (call 3 re-ran the call-1 winners beside 7 stages: _PP16S7 won again where listed)
    ("sm_9", "nt", 0, 14336, 4096): _PP16S7,  # 1024x14336x4096: 719 vs 659 for _PP16 (call1: _PP16 681 vs 611 for 128x224), 1.06x
    # 4096x14336x4096: 630 vs 591 for _PP16S7 (1.07x), 0.95x (session 31 call 3); bench_gemm (call 4)
    # showed no difference either way, as for 4096^3 above
    ("sm_9", "nt", 1, 14336, 4096): _PP7,
    # 16384x14336x4096: 643 vs 626 for _PP16 (1.03x; the other two TMA-store 128x128 forms 641), 1.01x
    # (session 32 call 4; _PP16 641 vs 622, 1.03x, in session 11)
    ("sm_9", "nt", 2, 14336, 4096): _PPT,
    # ("sm_9", "nt", 0, 4096, 14336): the default 128x256/s3, 639 vs 611 for the former _PP16S7 (1.05x), 0.93x (session 31 call 3)
    # ("sm_9", "nt", 1, 4096, 14336): the default 128x256/s3 (678-659 vs 658-647 for s4/FullRow, calls 1 and 3)
    # 16384x11008x4096: 641 vs 625 for 128x256/s4/FullRow (1.03x; the other TMA-store forms 634-638), 1.01x
    # (session 32 call 4; 128x256/s4/FullRow was 1.06x the rule default in session 5)
    ("sm_9", "nt", 2, 11008, 4096): _PPT16,
    # 1024x11008x4096: 587 vs 566 for _PP16S7 (1.04x), 0.99x cuBLASLt (session 34 call 1); 614 vs 578
    # (1.06x) in session 33 call 6
    ("sm_9", "nt", 0, 11008, 4096): _S4ROW,
    ("sm_9", "nt", 1, 11008, 4096): _PP16S7,  # 4096x11008x4096: 661 vs 646 for _PP16 (call1: _PP16 1.14x 128x176), 1.05x
    ("sm_9", "nt", 0, 3072, 768): GemmConfig(block_M=128, block_N=192, block_K=64, num_stages=4, threads=256, swizzle=8, policy="Square"),  # 1024x3072x768: 1.265x default, 1.132x
    # 4096x3072x768: 525 vs 454 for _PP (1.16x), 0.99x cuBLASLt; 16384x3072x768: 530 vs 493 for _PP192
    # (1.08x), 0.99x (the TMA-store epilogue, session 32 call 4)
    ("sm_9", "nt", 1, 3072, 768): _PPT192,
    ("sm_9", "nt", 2, 3072, 768): _PPT,
    # The H100 SXM: the H200's ping-pong winners at K=4096 and N of 11008 / 14336 (M > 1536) read
    # 0.64-0.85x cuBLAS there, the T.Pipelined 128x256 tiles 0.94-1.00x (`sweep_gemm --group
    # 'board_*'`, session 57 call 1; TFLOP/s vs cuBLAS in the same run). At 16384x11008x4096 "nn"
    # the rule default already won (669, 0.987x). At M <= 1536 and K=768 the "sm_9" ping-pong
    # entries read 0.97-1.02x there (session 56 bench_gemm) and stay (at 1024 rows each won its
    # shape in `sweep_gemm --group 'board1k_*'`, session 58 call 1).
    (_H100, "nn", 1, 11008, 4096): _S4ROW,  # 650 vs 481 for _PP16S7 (1.35x), 0.991x cuBLAS
    (_H100, "nn", 1, 14336, 4096): _S4ROW,  # 674 vs 549 (1.23x), 0.943x
    (_H100, "nn", 2, 14336, 4096): _HOPPER_LARGE,  # 667 vs 527 for _PP192 (1.27x), 0.971x
    (_H100, "nt", 1, 11008, 4096): _S4ROW,  # + bias + gelu_tanh: 633 vs 510 (1.24x), 0.997x cuBLASLt
    (_H100, "nt", 2, 11008, 4096): _S4ROW,  # 643 vs 533 for _PPT16 (1.21x), 0.971x
    (_H100, "nt", 1, 14336, 4096): _HOPPER_LARGE,  # 654 vs 579 for _PP7 (1.13x), 0.957x
    (_H100, "nt", 2, 14336, 4096): _HOPPER_LARGE,  # 650 vs 543 for _PPT (1.20x), 0.971x
    # 16384x4096x4096: the 4-stage tile the "sm_9" table gives 4096 rows, 668 vs 636 for the rule's
    # 3 stages (1.05x), 0.992x cuBLAS (`sweep_gemm --group 'boardn_*'`, session 59 call 4; the
    # other N=4096 shapes, 8192^3 and the MLP's weight gradients kept their defaults there); 655
    # vs 650 on the next host (call 5), whose bench_gemm read 0.972x cuBLAS in GPU time against
    # 0.939-0.950 for the 3-stage tile in four earlier runs.
    (_H100, "nn", 2, 4096, 4096): _S4,
}


def default_config(arch: str, n: int, layout: str = "nn", k: int = 0, bucket: int = 2, board: str | None = None) -> GemmConfig:
    """Schedule for an output with `n` (static) columns, reduction `k` ("nn"/"nt"; output rows
    for "tn") and symbolic-M bucket `bucket` (see `m_bucket`) on a GPU named `board` (torch's
    device name; None: the "sm_9" entries only)."""
    if not arch.startswith("sm_9"):
        return _AMPERE_TN if layout == "tn" else _AMPERE
    for tag in (board, "sm_9") if board else ("sm_9",):
        for key in ((tag, layout, bucket, n, k), (tag, layout, bucket, None, k), (tag, layout, bucket, None, None)):
            hit = DEFAULT_OVERRIDES.get(key)
            if hit is not None:
                return hit
    if layout == "tn" and bucket >= 1:
        split = tn_split_config(k, n)
        if split is not None:
            return split
    if n <= 128:
        return _HOPPER_NARROW
    # No rule by wave count: 128×128 tiles just double the CTAs per wave (one CTA per SM either
    # way, smem and setmaxnreg-bound), so at M=1024, N=4096 the 128 CTAs of 128×256 are already
    # ~one full wave. Measured per-bucket winners go into DEFAULT_OVERRIDES.
    return _HOPPER_LARGE


def grad_act_config(cfg: GemmConfig) -> GemmConfig:
    """The schedule of a `grad_act` GEMM (the output gradient of an MLP's activation) given the
    plain "nn" GEMM's: its epilogue is written for TileLang's T.Pipelined kernel, so a hand-
    synchronized default gives way to the 128x256 T.Pipelined tile (Hopper's rule)."""
    if cfg.pipeline == "auto" and cfg.split_k == 1:
        return cfg
    return _HOPPER_LARGE


# Split-K weight gradients ("tn"): when the 128x256 output tiles leave SMs idle (GPT-2's
# 3072x768 over 16384 tokens: 72 tiles on 132 SMs, 0.64x cuBLAS), slice the token reduction so
# tiles x slices fill one wave as closely as possible without a second (a partial second wave
# costs as much as a whole one). benchmarks/sweep_gemm.py --group 'split_*' on one H200
# (session14/call2, bf16, 16384 tokens, TFLOP/s vs cuBLAS): 3072x768 192x192/2 733 vs 656 (3
# slices, 1.45 waves: 546; 4: 637); 768x3072 709 vs 615; 2304x768 128x256/2 631 vs 642 (192x192/2,
# 96 CTAs: 597); 768x768 192x192/8 539 vs 549 (the unsplit default: 128).
_TN_SPLIT_TILES = (GemmConfig(192, 192, 64, 4, 384, 0, "FullRow"), GemmConfig(128, 256, 64, 3, 256, 0, "Square"))
MAX_SPLIT_K = 8


def tn_split_config(rows: int, n: int, sms: int = PERSISTENT_CTAS):
    """The split-K schedule for a (rows x n) weight gradient whose unsplit grid would not fill the
    SMs, or None: of the two tiles, the one whose tiles x slices (2..MAX_SPLIT_K, at most `sms`)
    keeps the most SMs busy (ties: the first, 192x192)."""
    if math.ceil(rows / 128) * math.ceil(n / 256) >= sms:
        return None
    best, best_ctas = None, 0
    for cfg in _TN_SPLIT_TILES:
        tiles = math.ceil(rows / cfg.block_M) * math.ceil(n / cfg.block_N)
        split = min(MAX_SPLIT_K, sms // tiles)
        if split >= 2 and tiles * split > best_ctas:
            best, best_ctas = dataclasses.replace(cfg, split_k=split), tiles * split
    return best


SEARCH_SPACE = [
    GemmConfig(128, 256, 64, 3, 256, 8),
    _PP,  # Hopper only (filtered out for older GPUs by the op's search space)
    GemmConfig(128, 256, 64, 3, 256, 16),
    GemmConfig(256, 128, 64, 3, 256, 8),
    GemmConfig(128, 128, 64, 4, 256, 8),
    GemmConfig(128, 256, 64, 4, 256, 8),
    GemmConfig(128, 256, 64, 4, 256, 8, "FullRow"),
    GemmConfig(256, 128, 64, 4, 256, 8),
    GemmConfig(128, 192, 64, 4, 256, 8),
    _PP16S7,
    _PPT,  # the ping-pong with the TMA-store epilogue (K=768's and the 16384-token Linears' default)
    GemmConfig(128, 128, 64, 2, 256, 8, "Square", 2),  # two CTAs per SM
]


# Split-K weight-gradient schedules `tileops tune` tries for "tn" beside SEARCH_SPACE.
TN_SPLIT_SPACE = [dataclasses.replace(tile, split_k=s) for tile in _TN_SPLIT_TILES for s in (2, 3, 4)]


def _gelu_tanh(x):
    """0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³), with tanh.approx.f32: one MUFU
    operation an element, as CUTLASS's GELU_taylor epilogue. The exact sigmoid form x / (1 +
    e^(-2u)) takes two (ex2 + rcp), and in an epilogue that no main loop hides (one tile per CTA
    at M=1024) the 16-a-clock MUFU unit is what it waits on. tanh.approx's relative error is ~2^-11:
    |error| ≤ 2.5e-4·|x|, below bf16's rounding of the output except for x < -2, where the output
    (> -0.05) carries that absolute error."""
    u = x * (T.float32(math.sqrt(2 / math.pi)) + T.float32(math.sqrt(2 / math.pi) * 0.044715) * x * x)
    half = T.float32(0.5) * x
    return half + half * T.call_extern("float32", "__tanhf", u)


def _sigmoid(x):
    """1 / (1 + e^-x) by rcp.approx. A plain `/` is IEEE division here (nvcc keeps -prec-div): a
    Newton step, an FCHK range check and a branch to a slow path per element. (0.5·(1 + tanh(x/2))
    would take one MUFU op, but tanh.approx's absolute error near ±1 swamps silu's small outputs
    at x < -4, where this form stays within a few ulp.)"""
    return T.fast_rcp(T.float32(1) + T.exp(-x))


def _act(x, activation: str):
    """Activation of a float32 value, as TIR."""
    if activation == "none":
        return x
    if activation == "relu":
        return T.max(x, T.float32(0))
    if activation == "gelu":
        return T.float32(0.5) * x * (T.float32(1) + T.erf(x * T.float32(1 / math.sqrt(2))))
    if activation == "gelu_tanh":
        return _gelu_tanh(x)
    if activation == "silu":
        return x * _sigmoid(x)
    raise ValueError(f"unknown activation {activation!r}")


def _act_grad(z, activation: str):
    """d act / dz at z (float32), as TIR."""
    if activation == "none":
        return T.float32(1)
    if activation == "relu":
        return T.if_then_else(z > T.float32(0), T.float32(1), T.float32(0))
    if activation == "gelu":
        cdf = T.float32(0.5) * (T.float32(1) + T.erf(z * T.float32(1 / math.sqrt(2))))
        pdf = T.exp(T.float32(-0.5) * z * z) * T.float32(1 / math.sqrt(2 * math.pi))
        return cdf + z * pdf
    if activation == "gelu_tanh":
        k0, k1 = T.float32(math.sqrt(2 / math.pi)), T.float32(0.044715)
        t = T.tanh(k0 * (z + k1 * z * z * z))
        return T.float32(0.5) * (T.float32(1) + t) + T.float32(0.5) * z * (T.float32(1) - t * t) * k0 * (
            T.float32(1) + T.float32(3) * k1 * z * z
        )
    if activation == "silu":
        s = _sigmoid(z)
        return s * (T.float32(1) + z * (T.float32(1) - s))
    raise ValueError(f"unknown activation {activation!r}")


@kernel("gemm", "matmul")
def matmul_kernel(
    config: GemmConfig,
    *,
    layout: str,
    n: int,
    k: int,
    dtype: str,
    rows: int = 0,
    batched: bool = False,
    bias: bool = False,
    activation: str = "none",
    save_preact: bool = False,
    grad_act: str = "none",
    ctas: int = PERSISTENT_CTAS,
):
    """C = act(op(A) @ op(B) + bias), fp32 accumulation, output in `dtype`.

    ctas: the "pingpong" pipeline's grid, one CTA per SM (the op passes the device's SM count;
    other pipelines ignore it).

    Static: n (C columns), k (reduction for "nn"/"nt"), rows (C rows, "tn" only). Symbolic: M
    (C rows for "nn"/"nt"), K (reduction for "tn"), batch. Arguments in order:
    A, B, [Bias (n,)], C, [Z (pre-activation, same shape as C) when save_preact], and with
    config.split_k > 1 ("tn" only) P: the (split_k, rows, n) fp32 partials workspace.

    grad_act (an activation; "nn", auto pipeline, no bias or activation): the backward of
    act(Z) fused into the GEMM that produces its output gradient, C = (A @ B) * act'(Z), with Z an
    input; P (ceil(M / block_M), n) fp32 takes the column sums of C's row tiles and DB (n,) their
    sum, the bias gradient (a second kernel of the launch, fixed order). Arguments: A, B, Z, C, P,
    DB. It replaces `act_grad_kernel`'s pass over dY, Z and dZ (an MLP's up-projection backward).
    """
    bm, bn, bk = config.block_M, config.block_N, config.block_K
    split = config.split_k
    if split > 1 and (layout != "tn" or batched or config.pipeline != "auto" or bias or save_preact or activation != "none"):
        raise ValueError(f"split_k={split}: only the weight-gradient layout 'tn', not batched, pipeline 'auto', no bias or activation")
    if grad_act != "none" and (layout != "nn" or batched or config.pipeline != "auto" or split > 1 or bias or save_preact or activation != "none"):
        raise ValueError(f"grad_act={grad_act!r}: only layout 'nn', not batched, pipeline 'auto', no split, bias or activation")
    accum = "float32"
    policy = getattr(T.GemmWarpPolicy, config.policy)
    trans_a, trans_b = layout == "tn", layout == "nt"
    if layout == "tn":
        M, K = rows, T.dynamic("K")
    else:
        M, K = T.dynamic("M"), k
    N = n
    Bt = T.dynamic("batch") if batched else None
    lead = (Bt,) if batched else ()
    a_shape = lead + ((K, M) if trans_a else (M, K))
    b_shape = lead + ((N, K) if trans_b else (K, N))
    c_shape = lead + (M, N)
    a_tile = (bk, bm) if trans_a else (bm, bk)
    b_tile = (bn, bk) if trans_b else (bk, bn)
    # Ragged last N tile: clamp the bias index (those columns are clipped by the store anyway).
    n_ragged = N % bn != 0
    n_blocks = T.ceildiv(N, bn)
    m_blocks = T.ceildiv(M, bm)

    def tile(X, ix, r, c, shape):
        """The (shape) tile of X at tile coordinates (r, c), as a region (what T.tma_copy takes)."""
        return X[ix + (slice(r * shape[0], (r + 1) * shape[0]), slice(c * shape[1], (c + 1) * shape[1]))]

    def a_src(A, ix, by, kk):
        return tile(A, ix, kk, by, a_tile) if trans_a else tile(A, ix, by, kk, a_tile)

    def b_src(B, ix, bx, kk):
        return tile(B, ix, bx, kk, b_tile) if trans_b else tile(B, ix, kk, bx, b_tile)

    hand_sync = config.pipeline != "auto"
    pingpong = config.pipeline == "pingpong"
    consumers = config.threads
    if pingpong and consumers != 256:
        raise ValueError(f"pipeline 'pingpong' takes threads=256 (two consumer warpgroups), got {consumers}")

    TURN = 2  # ping-pong: named barriers 2 and 3 (0: __syncthreads, 1: the async pipeline's consumers)
    EPI = 4  # ping-pong with tma_store: named barriers 4 and 5, each warpgroup's own C tile

    @T.macro
    def sync(before_store, w):
        # Hand-synchronized pipelines only (TileLang's sync pass is off there): a named barrier
        # over the threads that share C_s — the consumers (1; the producer warpgroup may have
        # exited), or in the ping-pong pipeline warpgroup w alone (EPI + w: the other one is in
        # its main loop). Before a TMA store the generic-proxy writes to C_s must be made visible
        # to the async proxy.
        if hand_sync:
            if before_store:
                T.fence_proxy_async()
            if w is None:
                T.sync_threads(1, consumers)
            else:
                T.sync_threads(EPI + w, 128)

    # Async pipeline: when its stages and a C tile do not both fit in the CTA's share of 227 KB of
    # shared memory, C leaves straight from registers. (The auto pipeline overlaps its C tile with
    # the stages.) Ping-pong stores from registers unless tma_store gives each warpgroup a C tile
    # of its own (see body_pingpong); either way its stores overlap the other's main loop.
    smem_budget = 227 * 1024 // max(config.min_blocks, 1)
    direct_store = (pingpong and not config.tma_store) or (
        not pingpong and hand_sync and config.num_stages * (bm * bk + bk * bn) * 2 + bm * bn * 2 > smem_budget  # 16-bit dtypes
    )

    @T.macro
    def store(C_f, C_s, dst, reuse_after, w):
        """C_f (cast to dtype) into the global tile `dst`: through C_s and a TMA store, or straight
        from registers under direct_store. reuse_after: C_s is written again afterwards (the TMA
        store's elected thread waits until it has read C_s; the barrier holds the others until
        then). w: the ping-pong warpgroup whose tile C_s is (None: every consumer's)."""
        if direct_store:
            T.copy(C_f, dst)
        else:
            T.copy(C_f, C_s)
            sync(True, w)
            T.copy(C_s, dst)
            if reuse_after:
                sync(False, w)

    @T.macro
    def epilogue(C_f, C_s, Bias, C, Z, ix, bx, by, w):
        """Bias and activation in registers (no extra pass over global memory), then C (and the
        pre-activation Z) out. w: the ping-pong warpgroup (None elsewhere)."""
        if bias:
            for i, j in T.Parallel(bm, bn):
                col = T.min(bx * bn + j, N - 1) if n_ragged else bx * bn + j
                C_f[i, j] = C_f[i, j] + T.Cast(accum, Bias[col])
        if save_preact:
            store(C_f, C_s, Z[ix + (by * bm, bx * bn)], True, w)
        if activation != "none":
            for i, j in T.Parallel(bm, bn):
                C_f[i, j] = _act(C_f[i, j], activation)
        # A ping-pong warpgroup writes C_s again at its next tile: wait for this store's read.
        store(C_f, C_s, C[ix + (by * bm, bx * bn)], w is not None, w)

    @T.macro
    def grad_epilogue(C_f, C_s, Z, C, P, bx, by):
        """grad_act: C = C_f * act'(Z), and the column sums of C's tile (as stored, in dtype, which
        is what eager sums) into P[by]. Z's tile is copied into C_s after the main loop (TileLang
        makes it 16-byte loads by the consumer threads, not a TMA; loading it into registers before
        the loop instead, in C_f's layout, ran 0.04 ms slower at the MLP shape on an H100, session
        64). Rows past the matrix read 0 and C_f is 0 there, so they add nothing to the sums. The
        sums: each thread sums whole columns of C_s (TileLang 0.1.15 cannot reduce C_f's wgmma
        layout over rows); 32-row partials reduced across warps eight times ran 0.035 ms slower."""
        part = T.alloc_fragment((2, bn), accum)  # two half-columns a thread (as layout inference lays it out)
        colsum = T.alloc_fragment((bn,), accum)
        T.copy(Z[by * bm, bx * bn], C_s)
        for i, j in T.Parallel(bm, bn):
            C_f[i, j] = C_f[i, j] * _act_grad(T.Cast(accum, C_s[i, j]), grad_act)
        T.copy(C_f, C_s)
        T.copy(C_s, C[by * bm, bx * bn])
        T.clear(part)
        for h, j in T.Parallel(2, bn):
            for i in T.serial(bm // 2):
                part[h, j] += T.Cast(accum, C_s[h * (bm // 2) + i, j])
        T.reduce_sum(part, colsum, dim=0)
        for j in T.Parallel(bn):
            if bx * bn + j < N:
                P[by, bx * bn + j] = colsum[j]

    @T.macro
    def body_auto(A, B, Bias, C, Z, bx, by, bz, P=None):
        if config.min_blocks:
            T.annotate_min_blocks_per_sm(config.min_blocks)
            if config.min_blocks > 1:  # TileLang's 24/240 would not fit two CTAs' registers
                T.annotate_producer_reg_dealloc(PRODUCER_REGS)
                T.annotate_consumer_reg_alloc(warpgroup_regs(config.threads, config.min_blocks))
        ix = (bz,) if batched else ()
        A_s = T.alloc_shared(a_tile, dtype)
        B_s = T.alloc_shared(b_tile, dtype)
        C_f = T.alloc_fragment((bm, bn), accum)
        C_s = T.alloc_shared((bm, bn), dtype)
        if config.swizzle:
            T.use_swizzle(config.swizzle)
        T.clear(C_f)
        if split > 1:
            # Slice bz of the k-steps: [bz * chunk, min((bz + 1) * chunk, nk)), possibly empty.
            chunk = T.ceildiv(T.ceildiv(K, bk), split)
            for kk in T.Pipelined(T.max(T.min(chunk, T.ceildiv(K, bk) - bz * chunk), 0), num_stages=config.num_stages):
                T.copy(a_src(A, ix, by, bz * chunk + kk), A_s)
                T.copy(b_src(B, ix, bx, bz * chunk + kk), B_s)
                T.gemm(A_s, B_s, C_f, transpose_A=trans_a, transpose_B=trans_b, policy=policy)
            T.copy(C_f, Z[bz, by * bm, bx * bn])  # Z: the fp32 partials P (see `launch`)
        else:
            for kk in T.Pipelined(T.ceildiv(K, bk), num_stages=config.num_stages):
                T.copy(a_src(A, ix, by, kk), A_s)
                T.copy(b_src(B, ix, bx, kk), B_s)
                # Each k-step ends in warpgroup_wait<0>: with T.wgmma_gemm + T.wait_wgmma(1) here,
                # TileLang 0.1.15's pipeline releases the stage (empty-barrier arrive) *before* the
                # wait, so the next TMA load could overwrite operands a wgmma still reads. The
                # "async" pipeline below places the release itself.
                T.gemm(A_s, B_s, C_f, transpose_A=trans_a, transpose_B=trans_b, policy=policy)
            if grad_act != "none":
                grad_epilogue(C_f, C_s, Z, C, P, bx, by)
            else:
                epilogue(C_f, C_s, Bias, C, Z, ix, bx, by, None)

    S = config.num_stages
    cwg = tuple(range(consumers // 128))  # consumer warpgroups; the producer is the next one

    # The async pipelines' two loops over one tile's k-steps. Stage number g = g0 + kk runs on
    # across the tiles of a persistent CTA (g0: the tile's first; None: 0, a single tile) and
    # picks the ring slot g % S and the phase parity (g // S) & 1. (Expressions, not names bound
    # in the macros: binding the loop variable to a new name would rename it in the generated
    # code, and with it every kernel's cache key.)
    def stage(g0, kk):
        return kk if g0 is None else g0 + kk

    def slot(g0, kk):
        return stage(g0, kk) % S

    def parity(g0, kk):
        return (stage(g0, kk) // S) & 1

    @T.macro
    def load_k_steps(A, B, A_s, B_s, full, empty, ix, xy, g0, nk):
        # xy: the tile's (bx, by), indexed where used (a buffer stays a load in place, not a copy)
        for kk in T.serial(nk):
            T.mbarrier_wait_parity(empty[slot(g0, kk)], parity(g0, kk) ^ 1)
            T.tma_copy(a_src(A, ix, xy[1], kk), A_s[slot(g0, kk), :, :], barrier=full[slot(g0, kk)])
            T.tma_copy(b_src(B, ix, xy[0], kk), B_s[slot(g0, kk), :, :], barrier=full[slot(g0, kk)])
            T.mbarrier_arrive(full[slot(g0, kk)])

    @T.macro
    def mma_k_steps(A_s, B_s, full, empty, C_f, g0, nk):
        # k-step kk-1's stage is released once its wgmma batch retired (see body_async); the
        # tile's last stage is the caller's to release.
        for kk in T.serial(nk):
            T.mbarrier_wait_parity(full[slot(g0, kk)], parity(g0, kk))
            T.wgmma_gemm(A_s[slot(g0, kk), :, :], B_s[slot(g0, kk), :, :], C_f, transpose_A=trans_a, transpose_B=trans_b, policy=policy)
            T.wait_wgmma(1)
            if kk > 0:
                T.mbarrier_arrive(empty[(stage(g0, kk) + S - 1) % S])

    @T.macro
    def body_async(A, B, Bias, C, Z, bx, by, bz):
        # CUTLASS-style warp specialization with explicit mbarriers: full[s] completes when the
        # stage's TMA bytes landed, empty[s] when every consumer thread released it. A consumer
        # issues k-step kk's wgmma, waits until at most one batch is in flight (so k-step kk-1's
        # retired) and only then releases kk-1's stage: the tensor cores never drain between
        # k-steps, and the producer never overwrites operands a wgmma still reads.
        T.annotate_min_blocks_per_sm(max(config.min_blocks, 1))
        ix = (bz,) if batched else ()
        A_s = T.alloc_shared((S,) + a_tile, dtype)
        B_s = T.alloc_shared((S,) + b_tile, dtype)
        C_f = T.alloc_fragment((bm, bn), accum)
        C_s = None if direct_store else T.alloc_shared((bm, bn), dtype)
        full = T.alloc_barrier([128] * S)
        empty = T.alloc_barrier([consumers] * S)
        if config.swizzle:
            T.use_swizzle(config.swizzle)
        nk = T.ceildiv(K, bk)
        # Two loops, one per role (a shared loop makes ptxas allocate the producer's branch with
        # the consumers' registers: it spills under setmaxnreg.dec).
        with T.ws(len(cwg)):
            T.dec_max_nreg(PRODUCER_REGS)
            load_k_steps(A, B, A_s, B_s, full, empty, ix, (bx, by), None, nk)
        with T.ws(*cwg):
            T.inc_max_nreg(warpgroup_regs(consumers, max(config.min_blocks, 1)))
            T.clear(C_f)
            mma_k_steps(A_s, B_s, full, empty, C_f, None, nk)
            T.wait_wgmma(0)
            if not direct_store:
                # If the shared-memory planner ever lets C_s overlap the stages, the other
                # consumer warpgroup's last wgmma may still be reading them: meet first.
                T.sync_threads(1, consumers)
            epilogue(C_f, C_s, Bias, C, Z, ix, bx, by, None)

    # Persistent ping-pong: PERSISTENT_CTAS CTAs (one per SM) walk the output tiles. The producer
    # loads every tile's k-steps, in tile order, into one ring of S stages; consumer warpgroup w
    # computes the tiles i = w, w + 2, ... of its CTA (each a whole bm x bn tile: 128 threads,
    # bm*bn/128 fp32 accumulators each), so stage number g = i*nk + kk is known to both sides.
    # While one warpgroup runs its epilogue (bias, activation, stores), the
    # other's k-steps keep the tensor cores busy: the epilogue and the tile's pipeline fill no
    # longer sit between two main loops (what bounds the non-persistent kernels at K=768).
    m_tiles = m_blocks * n_blocks
    n_tiles = m_tiles * Bt if batched else m_tiles
    grid = T.min(n_tiles, ctas)

    @T.macro
    def set_tile(tc, t):
        """tc[0:3] = (bx, by, bz) of tile t, computed once per tile into registers: panels of
        `swizzle` tile rows walked column by column, so the CTAs running at once share their A
        rows and B columns in L2. (Every value is non-negative: C's truncating / and % suffice,
        where floordiv/floormod would expand into sign tests at every use.)"""
        r = T.truncmod(t, m_tiles) if batched else t
        tc[2] = T.truncdiv(t, m_tiles) if batched else 0
        if config.swizzle:
            sw = config.swizzle
            panel = T.truncdiv(r, sw * n_blocks)
            rows = T.min(sw, m_blocks - panel * sw)  # the last panel may be shorter
            tc[0] = T.truncdiv(r - panel * sw * n_blocks, rows)
            tc[1] = panel * sw + T.truncmod(r - panel * sw * n_blocks, rows)
        else:
            tc[0] = T.truncmod(r, n_blocks)
            tc[1] = T.truncdiv(r, n_blocks)

    @T.macro
    def consumer(A_s, B_s, full, empty, C_f, C_s, tc, Bias, C, Z, bid, w, n_mine, nk):
        # The two warpgroups take turns at the main loop (named barriers TURN + w: bar.sync on
        # one's own, bar.arrive on the other's once its k-steps are issued). Besides keeping one
        # warpgroup's wgmmas from contending with the other's, the turns keep the stage ring
        # safe: a warpgroup waiting on a stage's `full` barrier must be at most one lap ahead of
        # it (the wait tests the phase's parity), which running ahead into its next tile while
        # the other still consumes the tile between would break. Warpgroup 1 primes the ring; a
        # warpgroup passes the turn only if the CTA has a next tile, so every bar.sync has exactly
        # one matching bar.arrive.
        T.inc_max_nreg(warpgroup_regs(consumers))
        if w == 1:
            T.named_barrier_arrive(TURN, 256)
        for j in T.serial(T.truncdiv(n_mine - w + 1, 2)):
            i = 2 * j + w
            set_tile(tc, bid + i * grid)
            T.clear(C_f)
            T.sync_threads(TURN + w, 256)
            mma_k_steps(A_s, B_s, full, empty, C_f, i * nk, nk)
            if i + 1 < n_mine:
                T.named_barrier_arrive(TURN + 1 - w, 256)
            T.wait_wgmma(0)
            T.mbarrier_arrive(empty[(i * nk + nk - 1) % S])  # the tile's last stage
            epilogue(C_f, C_s, Bias, C, Z, (tc[2],) if batched else (), tc[0], tc[1], w)

    @T.macro
    def body_pingpong(A, B, Bias, C, Z, bid):
        T.annotate_min_blocks_per_sm(1)
        A_s = T.alloc_shared((S,) + a_tile, dtype)
        B_s = T.alloc_shared((S,) + b_tile, dtype)
        C0 = T.alloc_fragment((bm, bn), accum)  # warpgroup 0's tile
        C1 = T.alloc_fragment((bm, bn), accum)  # warpgroup 1's
        # each warpgroup's C tile (tma_store; the planner's reuse is off, see pass_configs)
        C_s0 = T.alloc_shared((bm, bn), dtype) if config.tma_store else None
        C_s1 = T.alloc_shared((bm, bn), dtype) if config.tma_store else None
        tc = T.alloc_local((3,), "int32")  # the current tile's (bx, by, bz), per thread
        full = T.alloc_barrier([128] * S)
        empty = T.alloc_barrier([128] * S)  # one consumer warpgroup reads a stage
        nk = T.ceildiv(K, bk)
        n_mine = T.truncdiv(n_tiles - bid + grid - 1, grid)  # tiles bid, bid + grid, ...
        with T.ws(2):
            T.dec_max_nreg(PRODUCER_REGS)
            for i in T.serial(n_mine):
                set_tile(tc, bid + i * grid)
                load_k_steps(A, B, A_s, B_s, full, empty, (tc[2],) if batched else (), tc, i * nk, nk)
        with T.ws(0):
            consumer(A_s, B_s, full, empty, C0, C_s0, tc, Bias, C, Z, bid, 0, n_mine, nk)
        with T.ws(1):
            consumer(A_s, B_s, full, empty, C1, C_s1, tc, Bias, C, Z, bid, 1, n_mine, nk)

    body = body_async if hand_sync else body_auto
    # T.Pipelined adds its producer warpgroup itself; the async pipelines declare it.
    cta_threads = consumers + 128 if hand_sync else consumers

    # split_k: the partial tiles' sum, cast to dtype (rows and n are static here: the guards go
    # only where a block would overhang).
    rbm, rbn = 16, 256
    guard = rows % rbm != 0 or n % rbn != 0

    @T.macro
    def reduce_partials(P, C):
        with T.Kernel(T.ceildiv(N, rbn), T.ceildiv(M, rbm), threads=256) as (bx, by):
            acc = T.alloc_fragment((rbm, rbn), accum)
            T.clear(acc)
            for z in T.unroll(split):
                for i, j in T.Parallel(rbm, rbn):
                    if guard:
                        acc[i, j] += T.if_then_else((by * rbm + i < M) & (bx * rbn + j < N), P[z, by * rbm + i, bx * rbn + j], 0.0)
                    else:
                        acc[i, j] += P[z, by * rbm + i, bx * rbn + j]
            T.copy(acc, C[by * rbm, bx * rbn])

    @T.macro
    def launch(A, B, Bias, C, Z):
        if split > 1:  # Z is the partials workspace here
            with T.Kernel(n_blocks, m_blocks, split, threads=cta_threads) as (bx, by, bz):
                body(A, B, Bias, C, Z, bx, by, bz)
            reduce_partials(Z, C)
        elif pingpong:
            with T.Kernel(grid, threads=384) as bid:
                body_pingpong(A, B, Bias, C, Z, bid)
        elif batched:
            with T.Kernel(n_blocks, m_blocks, Bt, threads=cta_threads) as (bx, by, bz):
                body(A, B, Bias, C, Z, bx, by, bz)
        else:
            with T.Kernel(n_blocks, m_blocks, threads=cta_threads) as (bx, by):
                body(A, B, Bias, C, Z, bx, by, None)

    # T.prim_func needs explicit signatures: one per argument combination we ship.
    if grad_act != "none":
        MB = T.dynamic("MB")  # = ceil(M / block_M): the op allocates the partials so
        fold = _fold_partials(N, dtype, MB)

        @T.prim_func
        def matmul(
            A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), Z: T.Tensor(c_shape, dtype), C: T.Tensor(c_shape, dtype),
            P: T.Tensor((MB, N), accum), DB: T.Tensor((N,), dtype),
        ):
            with T.Kernel(n_blocks, m_blocks, threads=cta_threads) as (bx, by):
                body(A, B, None, C, Z, bx, by, None, P)
            fold(P, DB)  # a second kernel of the same launch: DB = the partials summed in a fixed order

    elif bias and save_preact:

        @T.prim_func
        def matmul(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), C: T.Tensor(c_shape, dtype), Z: T.Tensor(c_shape, dtype)):
            launch(A, B, Bias, C, Z)

    elif bias:

        @T.prim_func
        def matmul(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), C: T.Tensor(c_shape, dtype)):
            launch(A, B, Bias, C, None)

    elif save_preact:

        @T.prim_func
        def matmul(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor(c_shape, dtype), Z: T.Tensor(c_shape, dtype)):
            launch(A, B, None, C, Z)

    elif split > 1:

        @T.prim_func
        def matmul(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor(c_shape, dtype), P: T.Tensor((split, M, N), accum)):
            launch(A, B, None, C, P)

    else:

        @T.prim_func
        def matmul(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor(c_shape, dtype)):
            launch(A, B, None, C, None)

    return matmul


@dataclass(frozen=True)
class ActGradConfig:
    block_M: int = 64  # rows per CTA: also the bias-grad partial count, ceil(M/64)·n fp32 (~1.5% extra traffic in bf16)
    block_N: int = 256  # 256 threads: 4 columns × 16 rows each, 8-byte accesses, no register spills
    threads: int = 256


def default_act_grad_config(arch: str, n: int) -> ActGradConfig:
    return ActGradConfig()


@dataclass(frozen=True)
class ColsumConfig:
    block_rows: int = 32  # partial rows folded per step (32 × 64 fp32 = 8 KB in flight per CTA)
    block_N: int = 64
    threads: int = 256


def _fold_partials(n: int, dtype: str, MB):
    """A kernel (macro) folding fp32 partial column sums P (MB, n) into DB (n,) in dtype: rows in a
    fixed order, so the bias gradients built on it are deterministic (no atomics)."""
    cs = ColsumConfig()
    rb, cbn = cs.block_rows, cs.block_N

    @T.macro
    def fold(P, DB):
        with T.Kernel(T.ceildiv(n, cbn), threads=cs.threads) as bx:
            acc = T.alloc_fragment((rb, cbn), "float32")
            total = T.alloc_fragment((cbn,), "float32")
            T.clear(acc)
            for it in T.serial(T.ceildiv(MB, rb)):
                for i, j in T.Parallel(rb, cbn):
                    acc[i, j] += T.if_then_else(it * rb + i < MB, T.if_then_else(bx * cbn + j < n, P[it * rb + i, bx * cbn + j], T.float32(0)), T.float32(0))
            T.reduce_sum(acc, total, dim=0)
            for j in T.Parallel(cbn):
                if bx * cbn + j < n:
                    DB[bx * cbn + j] = T.Cast(dtype, total[j])

    return fold


@kernel("gemm", "act_grad")
def act_grad_kernel(config: ActGradConfig, *, n: int, dtype: str, activation: str, bias_grad: bool = True, single: bool = False):
    """dZ = dY * act'(Z), and with bias_grad the bias gradient DB = column sums of dZ (in dtype).

    One pass over two (M, n) inputs. With bias_grad, the same launch (one host call: a second
    `T.Kernel` in the prim_func runs after the first) also writes one fp32 partial column sum per
    block_M rows, ceil(M/block_M)·n (~1.5% extra traffic in bf16), and a second kernel folds them
    in a fixed order (deterministic, no atomics). For relu, Z may be the activation's output:
    relu'(z) = [z > 0] = [relu(z) > 0].

    single (with bias_grad; for a few row blocks): one kernel, no partials. Each CTA walks every
    row block of its column panel and writes DB itself; a second kernel launch costs more host
    time (~4.5 µs on the H200 host) than these rows take on the GPU.
    """
    bm, bn = config.block_M, config.block_N
    M = T.dynamic("M")
    MB = T.dynamic("MB")  # = ceil(M / block_M): the op allocates the partials so

    @T.macro
    def dz_tile(DY, Z, DZ, g, by, bx):
        """g = one (bm, bn) tile of dZ (0 outside the matrix), stored to DZ."""
        T.clear(g)
        # Full tiles run branch-free (vectorized); only ragged edge tiles pay for guards.
        if by * bm + bm <= M and bx * bn + bn <= n:
            for i, j in T.Parallel(bm, bn):
                g[i, j] = T.Cast("float32", DY[by * bm + i, bx * bn + j]) * _act_grad(T.Cast("float32", Z[by * bm + i, bx * bn + j]), activation)
                DZ[by * bm + i, bx * bn + j] = T.Cast(dtype, g[i, j])
        else:
            for i, j in T.Parallel(bm, bn):
                if by * bm + i < M:
                    if bx * bn + j < n:
                        g[i, j] = T.Cast("float32", DY[by * bm + i, bx * bn + j]) * _act_grad(T.Cast("float32", Z[by * bm + i, bx * bn + j]), activation)
                        DZ[by * bm + i, bx * bn + j] = T.Cast(dtype, g[i, j])

    @T.macro
    def dz_body(DY, Z, DZ, P):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(M, bm), threads=config.threads) as (bx, by):
            g = T.alloc_fragment((bm, bn), "float32")
            colsum = T.alloc_fragment((bn,), "float32")
            dz_tile(DY, Z, DZ, g, by, bx)
            if bias_grad:
                T.reduce_sum(g, colsum, dim=0)
                for j in T.Parallel(bn):
                    if bx * bn + j < n:
                        P[by, bx * bn + j] = colsum[j]

    @T.macro
    def single_body(DY, Z, DZ, DB):
        with T.Kernel(T.ceildiv(n, bn), threads=config.threads) as bx:
            g = T.alloc_fragment((bm, bn), "float32")
            acc = T.alloc_fragment((bm, bn), "float32")
            colsum = T.alloc_fragment((bn,), "float32")
            T.clear(acc)
            for by in T.serial(T.ceildiv(M, bm)):
                dz_tile(DY, Z, DZ, g, by, bx)
                for i, j in T.Parallel(bm, bn):
                    acc[i, j] += g[i, j]
            T.reduce_sum(acc, colsum, dim=0)
            for j in T.Parallel(bn):
                if bx * bn + j < n:
                    DB[bx * bn + j] = T.Cast(dtype, colsum[j])

    colsum_body = _fold_partials(n, dtype, MB)

    # T.prim_func needs an explicit signature per argument list: with and without the bias gradient.
    if bias_grad and single:

        @T.prim_func
        def act_grad(DY: T.Tensor((M, n), dtype), Z: T.Tensor((M, n), dtype), DZ: T.Tensor((M, n), dtype), DB: T.Tensor((n,), dtype)):
            single_body(DY, Z, DZ, DB)

    elif bias_grad:

        @T.prim_func
        def act_grad(
            DY: T.Tensor((M, n), dtype), Z: T.Tensor((M, n), dtype), DZ: T.Tensor((M, n), dtype),
            P: T.Tensor((MB, n), "float32"), DB: T.Tensor((n,), dtype),
        ):
            dz_body(DY, Z, DZ, P)
            colsum_body(P, DB)

    else:

        @T.prim_func
        def act_grad(DY: T.Tensor((M, n), dtype), Z: T.Tensor((M, n), dtype), DZ: T.Tensor((M, n), dtype)):
            dz_body(DY, Z, DZ, None)

    return act_grad


@dataclass(frozen=True)
class BiasGradConfig:
    block_M: int = 64  # rows per step: 64 × 256 fp32 accumulators, 64 registers per thread
    block_N: int = 256
    steps: int = 8  # row blocks per CTA: one fp32 partial row per block_M·steps rows (0.4% extra traffic in bf16)
    threads: int = 256


def default_bias_grad_config(arch: str, n: int) -> BiasGradConfig:
    return BiasGradConfig()


@kernel("gemm", "bias_grad")
def bias_grad_kernel(config: BiasGradConfig, *, n: int, dtype: str, single: bool = False):
    """DB = column sums of DY (M, n), fp32 accumulation, written in dtype: the bias gradient of a
    linear layer without activation (with one, act_grad_kernel folds it into dZ's pass).

    A read-only pass at bandwidth: each CTA sums block_M·steps rows of a block_N column panel into
    registers and writes one fp32 partial row; a second kernel of the same launch (one host call)
    folds the partials in a fixed order (deterministic). PyTorch's `dy.sum(0)` runs this column
    reduction at about 1.7 TB/s on an H200 (a GPT step's profile).

    single (for up to a few row blocks): one kernel, no partials: each CTA sums all M rows of its
    panel and writes DB (a second launch costs more host time than a few row blocks take).
    """
    bm, bn, steps = config.block_M, config.block_N, config.steps
    M = T.dynamic("M")
    MB = T.dynamic("MB")  # = ceil(M / (block_M · steps)): the op allocates the partials so
    fold = _fold_partials(n, dtype, MB)

    @T.macro
    def panel_sum(DY, colsum, bx, r_first, nblocks):
        """colsum = sums of rows [r_first, r_first + nblocks·bm) ∩ [0, M) of column panel bx."""
        acc = T.alloc_fragment((bm, bn), "float32")
        T.clear(acc)
        for s in T.serial(nblocks):
            r0 = r_first + s * bm
            # Full blocks run branch-free (vectorized); only ragged edges pay for guards.
            if r0 + bm <= M and bx * bn + bn <= n:
                for i, j in T.Parallel(bm, bn):
                    acc[i, j] += T.Cast("float32", DY[r0 + i, bx * bn + j])
            else:
                for i, j in T.Parallel(bm, bn):
                    if r0 + i < M:
                        if bx * bn + j < n:
                            acc[i, j] += T.Cast("float32", DY[r0 + i, bx * bn + j])
        T.reduce_sum(acc, colsum, dim=0)

    if single:

        @T.prim_func
        def bias_grad(DY: T.Tensor((M, n), dtype), DB: T.Tensor((n,), dtype)):
            with T.Kernel(T.ceildiv(n, bn), threads=config.threads) as bx:
                colsum = T.alloc_fragment((bn,), "float32")
                panel_sum(DY, colsum, bx, 0, T.ceildiv(M, bm))
                for j in T.Parallel(bn):
                    if bx * bn + j < n:
                        DB[bx * bn + j] = T.Cast(dtype, colsum[j])

        return bias_grad

    @T.prim_func
    def bias_grad(DY: T.Tensor((M, n), dtype), P: T.Tensor((MB, n), "float32"), DB: T.Tensor((n,), dtype)):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(M, bm * steps), threads=config.threads) as (bx, by):
            colsum = T.alloc_fragment((bn,), "float32")
            panel_sum(DY, colsum, bx, by * steps * bm, steps)
            for j in T.Parallel(bn):
                if bx * bn + j < n:
                    P[by, bx * bn + j] = colsum[j]
        fold(P, DB)

    return bias_grad


# (kernel, config, static) that `tileops export` writes and `tileops check` / the compile tests
# build for sm_90a and sm_80: one per kernel shape the library runs (layouts, epilogues, batched).
# The "tn" entry uses 2 stages because sm_80's cp.async pipeline cannot lower 3 stages over a
# symbolic trip count; on sm_90a (TMA + mbarriers) the default keeps 3.
_TN_BOTH = GemmConfig(128, 256, 64, 2, 256, 8)
REPRESENTATIVE = [
    (matmul_kernel, _HOPPER_LARGE, dict(layout="nt", n=4096, k=4096, rows=0, dtype="bfloat16", batched=False, bias=True, activation="gelu_tanh", save_preact=True)),
    (matmul_kernel, _HOPPER_LARGE, dict(layout="nt", n=4096, k=4096, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)),
    (matmul_kernel, _HOPPER_LARGE, dict(layout="nn", n=4096, k=4096, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)),
    (matmul_kernel, _TN_BOTH, dict(layout="tn", n=4096, k=0, rows=4096, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)),
    (matmul_kernel, _HOPPER_NARROW, dict(layout="nn", n=128, k=64, rows=0, dtype="float16", batched=True, bias=False, activation="none", save_preact=False)),
    (matmul_kernel, DEFAULT_OVERRIDES[("sm_9", "nn", 0, 3072, 768)], dict(layout="nn", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)),
    (matmul_kernel, _PP, dict(layout="nt", n=3072, k=768, rows=0, dtype="bfloat16", batched=False, bias=True, activation="gelu_tanh", save_preact=True)),
    (matmul_kernel, tn_split_config(3072, 768), dict(layout="tn", n=768, k=0, rows=3072, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)),
    # nn.MLP's backward: the up-projection's output gradient with act' in the epilogue
    (matmul_kernel, _HOPPER_LARGE, dict(layout="nn", n=14336, k=4096, dtype="bfloat16", grad_act="gelu_tanh")),
    (act_grad_kernel, ActGradConfig(), dict(n=4096, dtype="bfloat16", activation="gelu_tanh")),
    (act_grad_kernel, ActGradConfig(), dict(n=4096, dtype="bfloat16", activation="gelu_tanh", bias_grad=False)),
    (act_grad_kernel, ActGradConfig(), dict(n=4096, dtype="bfloat16", activation="gelu_tanh", single=True)),
    (bias_grad_kernel, BiasGradConfig(), dict(n=4096, dtype="bfloat16")),
    (bias_grad_kernel, BiasGradConfig(), dict(n=4096, dtype="bfloat16", single=True)),
]
