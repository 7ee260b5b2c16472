"""Candidate GEMM schedules at the shapes where we trail cuBLAS; picks the per-M-bucket defaults.

    python -m benchmarks.sweep_gemm            # on the H200: < 3 min with the cache warmed here
    python -m benchmarks.sweep_gemm --warm     # on any machine: pre-compile every kernel (sm_90a)

For each shape it times every candidate config of that shape's kernel (the raw TileLang kernel,
no op layer) next to cuBLAS, in two ways:

- `gpu`: a CUDA graph of `GRAPH_N` back-to-back launches, replayed and timed with CUDA events
  (median of `REP` replays / GRAPH_N): GPU time only, no host launch cost. Same for torch.
- `call` (one row per shape, `config=op default`): `torch.ops.tileops.gemm/linear` timed the way
  bench_gemm times it (CUDA events around each call), next to torch timed the same way, plus the
  host µs per call of our op, of the raw kernel and of torch. When `call` is far below `gpu`, the
  gap is host overhead, not the schedule.

Correctness: relative Frobenius error of every candidate's output vs torch (bf16; rows above
2e-2 are marked BAD and never chosen).

Output: a table per shape, `BEST` per shape, and `OVERRIDE` lines for
`tilelang_ops/kernels/gemm.py: DEFAULT_OVERRIDES` (only where a candidate beats the current
default by more than 2%); JSON to $OUT/sweep_gemm.json (benchmarks/_timing.write_json).
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import math
import sys
import time

import torch

ARCH = "sm_90a"
DT = torch.bfloat16
DEVICE = "cuda"
GRAPH_N = 10
REP = 10


def _cfg(bm, bn, bk, st, th=256, sw=8, pol="Square", mb=0, pipe="auto", tma=False):
    from tilelang_ops.kernels.gemm import GemmConfig

    return GemmConfig(bm, bn, bk, st, th, sw, pol, mb, pipe, tma_store=tma)


def candidates():
    """{group: (static kwargs, [configs], [(what, m)])}: one kernel per (group, config); M is symbolic."""
    C0 = _cfg(128, 256, 64, 3)  # the current default
    big = [C0, _cfg(128, 256, 64, 4, pol="FullRow"), _cfg(128, 256, 64, 4), _cfg(256, 128, 64, 3)]
    small = [_cfg(128, 128, 64, 4), _cfg(128, 128, 64, 3), _cfg(128, 128, 128, 3), _cfg(64, 256, 64, 4, th=128)]
    gemm = dict(layout="nn", rows=0, dtype="bfloat16", batched=False, bias=False, activation="none", save_preact=False)
    lin = dict(layout="nt", rows=0, dtype="bfloat16", batched=False, bias=True, activation="gelu_tanh", save_preact=False)
    nt_plain = dict(lin, bias=False, activation="none")
    tn_extra = [_cfg(128, 256, 64, 4, pol="FullRow"), _cfg(128, 128, 64, 4), _cfg(128, 192, 64, 4), _cfg(128, 256, 64, 3, sw=0)]
    wave11008 = [_cfg(128, 176, 64, 3), _cfg(128, 176, 64, 4), _cfg(128, 176, 64, 4, pol="FullRow")]
    # two CTAs per SM: 128x128 tiles, 96 KB of shared memory each, registers 80 at launch
    # (min_blocks=2), setmaxnreg 24 (producer) / 104 (consumers) = 29.7K of the CTA's 30.7K
    two = [_cfg(128, 128, 64, 2, mb=2), _cfg(128, 128, 32, 4, mb=2)]  # (FullRow: nvcc fails)
    wave14336 = [_cfg(128, 224, 64, 3), _cfg(128, 224, 64, 3, pol="FullRow")]
    # the async pipeline (one wgmma k-step in flight, stages released after it retired) against
    # the auto pipeline's best schedules
    # (C leaves from registers when the stages and a C tile do not both fit: 128x256 with 4 stages)
    asy = [_cfg(128, 256, 64, 4, pipe="async"), _cfg(128, 256, 64, 4, pol="FullRow", pipe="async"), _cfg(128, 256, 64, 3, pol="FullRow", pipe="async"),
           _cfg(128, 192, 64, 4, pipe="async"), _cfg(128, 256, 32, 8, pol="FullRow", pipe="async")]
    asy_two = [_cfg(128, 128, 64, 2, mb=2, pipe="async"), _cfg(128, 128, 32, 4, mb=2, pipe="async")]
    return {
        **_tile_groups(gemm, lin, nt_plain),
        **_pingpong_groups(gemm, lin),
        **_gpt_groups(gemm, lin, nt_plain),
        **_split_groups(gemm),
        **_uniform_groups(gemm, lin),
        "async_nn_8192_8192": (dict(gemm, n=8192, k=8192), [C0] + asy, [("gemm", 8192)]),
        # 8192^3 in 128x256 tiles: 2048 tiles = 15.5 waves of 132 SMs (the last half empty); 128x224:
        # 2368 = 17.9 waves, 128x192: 2752 = 20.8 (their ragged last column wastes 1.2% / 0.8%)
        "wave_nn_8192_8192": (dict(gemm, n=8192, k=8192), [C0, _cfg(128, 256, 64, 4), _cfg(128, 224, 64, 3), _cfg(128, 224, 64, 3, pol="FullRow"),
                                                             _cfg(128, 224, 64, 4), _cfg(128, 192, 64, 4), _cfg(128, 192, 64, 5)], [("gemm", 8192)]),
        # The same kernels at 8448 rows, where 128 x 256 tiles (and cuBLAS's 256 x 128) fill whole
        # waves of 132 SMs (8192³: 2112 = 16 waves, against 2048 = 15.5 at 8192 rows): how much of
        # each GEMM's time its partial last wave costs, ours against cuBLAS's. Groups "fullwave_*".
        **_beside_defaults({"fullwave_nn_8192_8192": (dict(gemm, n=8192, k=8192), [("gemm", 8192), ("gemm", 8448)]),
                            "fullwave_nn_4096_14336": (dict(gemm, n=4096, k=14336), [("gemm", 8192), ("gemm", 8448)]),
                            "fullwave_lin_14336_4096": (dict(lin, n=14336, k=4096), [("linear", 8192), ("linear", 8448)])}, []),
        "async_nn_4096_4096": (dict(gemm, n=4096, k=4096), [C0, _cfg(128, 256, 64, 4)] + asy + asy_two, [("gemm", 1024), ("gemm", 4096), ("gemm", 16384)]),
        "async_nn_3072_768": (dict(gemm, n=3072, k=768), [C0, _cfg(128, 128, 32, 4, mb=2)] + asy + asy_two, [("gemm", 1024), ("gemm", 4096), ("gemm", 16384)]),
        "async_nn_14336_4096": (dict(gemm, n=14336, k=4096), [C0, _cfg(128, 224, 64, 3, pol="FullRow")] + asy, [("gemm", 1024), ("gemm", 8192)]),
        "async_nn_4096_14336": (dict(gemm, n=4096, k=14336), [C0] + asy, [("gemm", 8192)]),
        "async_lin_14336_4096": (dict(lin, n=14336, k=4096), [C0] + asy, [("linear", 8192)]),
        "async_lin_3072_768": (dict(lin, n=3072, k=768), [C0, _cfg(128, 128, 64, 2, mb=2)] + asy + asy_two, [("linear", 4096), ("linear", 16384)]),
        "async_tn_4096x14336": (dict(gemm, layout="tn", rows=4096, n=14336, k=0), [C0] + asy, [("wgrad", 8192)]),
        "async_tn_14336x4096": (dict(gemm, layout="tn", rows=14336, n=4096, k=0), [C0] + asy, [("wgrad", 8192)]),
        "nn_4096_4096": (dict(gemm, n=4096, k=4096), big + small + [_cfg(128, 256, 64, 3, sw=0)] + two, [("gemm", 1024), ("gemm", 4096)]),
        # K=768: 12 k-steps of 64 (6 of 128): shallow pipelines, wide K tiles
        "nn_3072_768": (dict(gemm, n=3072, k=768), big + small + [_cfg(128, 256, 128, 2), _cfg(128, 256, 64, 2), _cfg(128, 128, 64, 2), _cfg(128, 128, 128, 2)] + two,
                        [("gemm", 1024), ("gemm", 4096), ("gemm", 16384)]),
        # N tiles that fill the last wave at M=1024 (132 SMs): 11008 = 62.5 x 176 -> 504 tiles = 3.8
        # waves (128x256: 344 = 2.6); 14336 = 64 x 224 -> 512 tiles = 3.9 waves (128x256: 448 = 3.4).
        # (176 only for "nt": an "nn" B tile 176 wide has no canonical wgmma shared layout.)
        "nn_11008_4096": (dict(gemm, n=11008, k=4096), big + [_cfg(128, 128, 64, 4), _cfg(128, 192, 64, 4)], [("gemm", 1024), ("gemm", 4096)]),
        "nn_14336_4096": (dict(gemm, n=14336, k=4096), big[:3] + [_cfg(128, 128, 64, 4), _cfg(128, 192, 64, 4)] + wave14336, [("gemm", 1024)]),
        # linear + bias + gelu_tanh ("nt" with the epilogue) over the bench_gemm set, beside each
        # shape's current default (the ping-pong overrides among them: 4096x4096x4096 and the
        # 11008x4096 ones were chosen against ping-pong candidates only, before the tanh.approx epilogue)
        **_beside_defaults({f"lin_{n}_{k}": (dict(lin, n=n, k=k), [("linear", m) for m in (1024, 4096, 16384)])
                            for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (11008, 4096), (3072, 768))},
                           big + [_cfg(128, 128, 64, 4), _cfg(128, 192, 64, 4)]),
        "lin_two_3072_768": (dict(lin, n=3072, k=768), [C0, _cfg(128, 192, 64, 4)] + two, [("linear", m) for m in (1024, 4096, 16384)]),
        "lin_wave_11008_4096": (dict(lin, n=11008, k=4096), [C0] + wave11008, [("linear", 1024), ("linear", 4096)]),
        "lin_wave_14336_4096": (dict(lin, n=14336, k=4096), [C0] + wave14336, [("linear", 1024), ("linear", 4096)]),
        # the same GEMM without bias/activation: the epilogue's cost is the difference
        "ntplain_14336_4096": (dict(nt_plain, n=14336, k=4096), [C0], [("linear_noepi", 8192)]),
        "ntplain_4096_4096": (dict(nt_plain, n=4096, k=4096), [C0], [("linear_noepi", 4096)]),
        # K=768, where the fused Linear trails cuBLASLt most (0.85-0.92x): its ping-pong schedules
        # without bias and activation, beside pp_lin_3072_768 (the same schedules with them)
        **_beside_defaults({"ntplain_3072_768": (dict(nt_plain, n=3072, k=768), [("linear_noepi", 4096), ("linear_noepi", 16384)])},
                           [_cfg(128, 128, 64, 6, pipe="pingpong"), _cfg(128, 192, 64, 5, pipe="pingpong"),
                            _cfg(128, 128, 64, 5, pipe="pingpong", tma=True), _cfg(128, 192, 64, 3, pipe="pingpong", tma=True)]),
        # Deep K at the board's power limit (session 33): at clocks locked by Nsight Compute these
        # kernels take cuBLAS's cycles, at 700 W they run at a 2-3% lower SM clock, moving 19% more
        # DRAM bytes. Tile-row panels of 16 (and 4, none) change the rows x columns of tiles that
        # run at once, hence the bytes each wave reads from DRAM. Groups "raster_*".
        **_beside_defaults({"raster_nn_4096_14336": (dict(gemm, n=4096, k=14336), [("gemm", 8192), ("gemm", 16384)]),
                            "raster_nt_4096_14336": (dict(nt_plain, n=4096, k=14336), [("linear_noepi", 8192)]),
                            "raster_nn_8192_8192": (dict(gemm, n=8192, k=8192), [("gemm", 8192)]),
                            # the MLP's 14336-wide outputs over K=4096 (up projection, forward
                            # and dH): 0.86-0.90x cuBLAS on an H100 (session 65, --mlp-gemms)
                            "raster_nn_14336_4096": (dict(gemm, n=14336, k=4096), [("gemm", 8192)]),
                            "raster_lin_14336_4096": (dict(lin, n=14336, k=4096), [("linear", 8192)])},
                           [_cfg(128, 256, 64, 3, sw=16), _cfg(128, 256, 64, 3, sw=4), _cfg(128, 256, 64, 3, sw=0), _cfg(128, 256, 64, 4, sw=16)]),
        # The H200-swept ping-pong defaults at the Llama MLP widths against the T.Pipelined
        # 128x256 tiles, for another Hopper board: on an H100 (session 56, bench_gemm) these
        # shapes read 0.77-0.90x cuBLAS as gemm (0.98-1.06x on the H200), 0.82-0.97x as the
        # fused Linear; the 128x256 tiles won all of them there (session 57: the H100's own
        # entries). Groups "board_*"; "board1k_*": the same at 1024 rows, where the H100 keeps
        # the ping-pong defaults (gemm 0.98-1.00x, the Linear 0.885-0.96x in GPU time, session 56).
        **_beside_defaults({f"board{tag}_{name}_{n}_4096": (dict(static, n=n, k=4096), [(what, m) for m in ms])
                            for tag, ms in (("", (4096, 16384)), ("1k", (1024,)))
                            for name, static, what in (("nn", gemm, "gemm"), ("lin", lin, "linear")) for n in (11008, 14336)},
                           big),
        # The same on the H100 at N=4096 and 8192³, the shapes where the 128x256 tiles it already
        # runs (the rule, or an "sm_9" 128x256 entry) read lowest in its bench_gemm runs
        # (0.92-0.97x cuBLAS per call, sessions 58-59). Groups "boardn_*".
        **_beside_defaults({f"boardn_{name}_4096_{k}": (dict(static, n=4096, k=k), [(what, m) for m in (4096, 16384)])
                            for name, static, what in (("nn", gemm, "gemm"), ("lin", lin, "linear")) for k in (4096, 14336)}
                           | {"boardn_nn_8192_8192": (dict(gemm, n=8192, k=8192), [("gemm", 8192)])},
                           big),
        # the MLP block's backward (d=4096, hidden=14336, 8192 tokens): dX of the down and up
        # projections ("nn") and both weight gradients ("tn", reduction over the 8192 tokens)
        "nn_4096_14336": (dict(gemm, n=4096, k=14336), big + [_cfg(128, 128, 64, 4), _cfg(128, 192, 64, 4)], [("gemm", 8192)]),
        "tn_4096x14336": (dict(gemm, layout="tn", rows=4096, n=14336, k=0), big + tn_extra, [("wgrad", 8192)]),
        "tn_14336x4096": (dict(gemm, layout="tn", rows=14336, n=4096, k=0), big + tn_extra, [("wgrad", 8192)]),
    }


def _selected(gname: str, groups) -> bool:
    """--group patterns are shell-style (`--group 'pp_*'`); none given: every group."""
    return not groups or any(fnmatch.fnmatchcase(gname, g) for g in groups)


def _tile_groups(gemm, lin, nt_plain):
    """Tiles larger than 128x256 at the MLP block's six GEMMs (8192 tokens) and 8192^3. The GEMMs run
    at the board's 700 W limit, the SM clock falling to 1605-1845 MHz (nvidia-smi dmon, twenty-seventh
    session), so bytes moved per FLOP cost clock; cuBLAS runs 192x192, 256x128 and 320x128 tiles
    there. A 192x192 tile (three consumer warpgroups of 64x192) moves 96 FLOP per byte loaded from
    L2, 128x256 85; 256x128 (two warpgroups of 128x128) as many, with 20% fewer shared-memory bytes
    read per wgmma FLOP than 64x256 warpgroup tiles. (192x256 with three warpgroups fails in nvcc:
    three stages and its C tile exceed shared memory.) Groups "tile_*"."""
    cands = [_cfg(192, 192, 64, 4, th=384, pol="FullRow"), _cfg(192, 192, 64, 3, th=384, pol="FullRow"), _cfg(256, 128, 64, 4)]
    spec = {
        "tile_nn_8192_8192": (dict(gemm, n=8192, k=8192), [("gemm", 8192)]),
        "tile_lin_14336_4096": (dict(lin, n=14336, k=4096), [("linear", 8192)]),  # MLP up, forward
        "tile_ntplain_4096_14336": (dict(nt_plain, n=4096, k=14336), [("linear_noepi", 8192)]),  # MLP down, forward
        "tile_nn_14336_4096": (dict(gemm, n=14336, k=4096), [("gemm", 8192)]),  # dX of the down projection
        "tile_nn_4096_14336": (dict(gemm, n=4096, k=14336), [("gemm", 8192)]),  # dX of the up projection
        "tile_tn_4096x14336": (dict(gemm, layout="tn", rows=4096, n=14336, k=0), [("wgrad", 8192)]),
        "tile_tn_14336x4096": (dict(gemm, layout="tn", rows=14336, n=4096, k=0), [("wgrad", 8192)]),
    }
    return _beside_defaults(spec, cands)


def _pingpong_groups(gemm, lin):
    """The persistent ping-pong pipeline against each shape's current default, over the bench_gemm
    set and the MLP block's backward GEMMs. Groups "pp_*": 128x128 and 128x192 tiles per consumer
    warpgroup (and one consumer warpgroup per CTA, two CTAs per SM: the same overlap left to the
    SM's scheduler; 0.63-0.95x the default everywhere, eleventh session); "pp2_*": 64x256 tiles
    (m64n256 wgmmas read less shared memory per FLOP than 2 x m64n128) and wider panels."""
    return {**_pp_groups("pp", gemm, lin, [_cfg(128, 128, 64, 6, pipe="pingpong"), _cfg(128, 128, 64, 7, pipe="pingpong"), _cfg(128, 192, 64, 5, pipe="pingpong"),
                                          _cfg(128, 128, 64, 6, sw=16, pipe="pingpong"), _cfg(128, 128, 64, 3, th=128, mb=2, pipe="async")]),
            **_pp_groups("pp2", gemm, lin, [_cfg(64, 256, 64, 5, pipe="pingpong"), _cfg(64, 256, 64, 5, sw=16, pipe="pingpong"),
                                           _cfg(128, 192, 64, 5, sw=16, pipe="pingpong"), _cfg(128, 128, 64, 7, sw=16, pipe="pingpong")]),
            # "ppt_*": the ping-pong pipeline with the TMA-store epilogue (GemmConfig.tma_store;
            # two C tiles of shared memory cost stages: 128x128 fits 5, 128x192 3)
            **_pp_groups("ppt", gemm, lin, [_cfg(128, 128, 64, 5, pipe="pingpong", tma=True), _cfg(128, 128, 64, 5, sw=16, pipe="pingpong", tma=True),
                                           _cfg(128, 128, 64, 4, pipe="pingpong", tma=True), _cfg(128, 192, 64, 3, pipe="pingpong", tma=True)])}


def _gpt_groups(gemm, lin, nt_plain):
    """examples/train_gpt.py's GEMMs (GPT-2 small: d=768, 16 x 1024 tokens), forward and backward,
    so one sweep tells whether its other Linears (qkv, proj, MLP down; still nn.Linear) would gain
    from ours. Groups "gpt_*"; the forward rows of qkv/proj/down are timed without their bias."""
    cands = [_cfg(128, 256, 64, 3), _cfg(128, 256, 64, 4), _cfg(128, 128, 64, 4), _cfg(128, 128, 64, 6, pipe="pingpong"),
             _cfg(128, 128, 64, 7, sw=16, pipe="pingpong"), _cfg(128, 192, 64, 5, pipe="pingpong")]
    m = 16384
    spec = {}
    for name, out_f, in_f in (("qkv", 2304, 768), ("proj", 768, 768), ("up", 3072, 768), ("down", 768, 3072)):
        fwd = dict(lin, n=out_f, k=in_f) if name == "up" else dict(nt_plain, n=out_f, k=in_f)
        spec[f"gpt_{name}_fwd"] = (fwd, [("linear" if name == "up" else "linear_noepi", m)])
        spec[f"gpt_{name}_dx"] = (dict(gemm, n=in_f, k=out_f), [("gemm", m)])  # dX = dY @ W
        spec[f"gpt_{name}_dw"] = (dict(gemm, layout="tn", rows=out_f, n=in_f, k=0), [("wgrad", m)])  # dW = dYᵀ X
    return _beside_defaults(spec, cands)


def _split_groups(gemm):
    """Split-K weight gradients ("tn", `GemmConfig.split_k`) at examples/train_gpt.py's shapes
    (16 x 1024 tokens): few output tiles, a long reduction. Groups "split_*"."""
    def c(bm, bn, st, th, pol, split, sw=0):
        return _cfg(bm, bn, 64, st, th, sw, pol) if split == 1 else dataclasses.replace(_cfg(bm, bn, 64, st, th, sw, pol), split_k=split)

    t192 = [c(192, 192, 4, 384, "FullRow", s) for s in (1, 2, 3, 4)] + [c(192, 192, 4, 384, "FullRow", 2, sw=8)]
    t128 = [c(128, 256, 3, 256, "Square", s) for s in (2, 3, 4)] + [c(128, 128, 4, 256, "Square", s) for s in (2, 4)] + [c(128, 192, 4, 256, "Square", 4)]
    out = {}
    for name, out_f, in_f in (("up", 3072, 768), ("down", 768, 3072), ("qkv", 2304, 768), ("proj", 768, 768)):
        extra = [c(192, 192, 4, 384, "FullRow", 8), c(128, 128, 4, 256, "Square", 8)] if name == "proj" else []
        spec = {f"split_{name}": (dict(gemm, layout="tn", rows=out_f, n=in_f, k=0), [("wgrad", 16384)])}
        out.update(_beside_defaults(spec, t192 + t128 + extra))
    return out


def _pp_groups(prefix, gemm, lin, pp):
    ms = [1024, 4096, 16384]
    spec = {f"{prefix}_nn_{n}_{k}": (dict(gemm, n=n, k=k), [("gemm", m) for m in ms]) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (11008, 4096), (3072, 768))}
    spec[f"{prefix}_nn_8192_8192"] = (dict(gemm, n=8192, k=8192), [("gemm", 8192)])
    spec[f"{prefix}_nn_4096_14336"][1].append(("gemm", 8192))  # the MLP's dX of the down projection
    spec.update({f"{prefix}_lin_{n}_{k}": (dict(lin, n=n, k=k), [("linear", m) for m in ms]) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (11008, 4096), (3072, 768))})
    spec[f"{prefix}_tn_4096x14336"] = (dict(gemm, layout="tn", rows=4096, n=14336, k=0), [("wgrad", 8192)])
    spec[f"{prefix}_tn_14336x4096"] = (dict(gemm, layout="tn", rows=14336, n=4096, k=0), [("wgrad", 8192)])
    return _beside_defaults(spec, pp)


def _uniform_groups(gemm, lin):
    """Each shape's default, then the same config with its warp-role branches on a warp-uniform
    index (GemmConfig.uniform_ws, runtime.uniform_warpgroups: the k-step's wgmma descriptors on
    the uniform datapath, no R2UR before each wgmma). Groups "uniform_*"."""
    from tilelang_ops.ops import gemm as G

    spec = {"uniform_nn_8192_8192": (dict(gemm, n=8192, k=8192), [("gemm", 8192)]),
            "uniform_nn_4096_4096": (dict(gemm, n=4096, k=4096), [("gemm", 1024), ("gemm", 4096)]),
            "uniform_nn_4096_14336": (dict(gemm, n=4096, k=14336), [("gemm", 8192)]),
            "uniform_lin_14336_4096": (dict(lin, n=14336, k=4096), [("linear", 8192)]),
            "uniform_lin_3072_768": (dict(lin, n=3072, k=768), [("linear", 4096)])}
    out = {}
    for name, (static, shapes) in spec.items():
        defaults = [G.config_for(static["layout"], static["n"], static["k"], DT, ARCH, rows=static["rows"], m=m) for _, m in shapes]
        out[name] = (static, list(dict.fromkeys(defaults + [dataclasses.replace(c, uniform_ws=True) for c in defaults])), shapes)
    return out


def _beside_defaults(spec, cands):
    """{group: (static, shapes)} -> {group: (static, configs, shapes)}: each shape's current
    default (what the op runs for its M bucket) first, then the candidates, each once."""
    from tilelang_ops.ops import gemm as G

    out = {}
    for name, (static, shapes) in spec.items():
        defaults = [G.config_for(static["layout"], static["n"], static["k"], DT, ARCH, rows=static["rows"], m=m) for _, m in shapes]
        out[name] = (static, list(dict.fromkeys(defaults + cands)), shapes)
    return out


def _jobs(groups=None):
    """(kernel def, config, static) for every candidate plus what the ops' default path loads."""
    from tilelang_ops.kernels import gemm as K
    from tilelang_ops.ops import gemm as G

    jobs = {}
    for gname, (static, cfgs, shapes) in candidates().items():
        if not _selected(gname, groups):
            continue
        for c in cfgs:
            jobs[(c, tuple(sorted(static.items())))] = (K.matmul_kernel, c, static)
        for _, m in shapes:  # the op-level call path: the default config of the call's bucket
            c = G.config_for(static["layout"], static["n"], static["k"], DT, ARCH, rows=static["rows"], m=m)
            jobs[(c, tuple(sorted(static.items())))] = (K.matmul_kernel, c, static)
    return list(jobs.values())


def warm(groups=None) -> int:
    jobs, failed, t0 = _jobs(groups), 0, time.time()
    for i, (kdef, cfg, static) in enumerate(jobs):
        t1 = time.time()
        try:
            kdef.compile(cfg, ARCH, **static)
            status = "ok"
        except Exception as e:  # report and go on
            failed += 1
            status = f"FAILED {type(e).__name__}: {str(e)[-300:]}"
        print(f"[{i + 1}/{len(jobs)}] {static['layout']} n={static['n']} k={static['k']} {static['activation']} {cfg}: {status} ({time.time() - t1:.1f} s)", flush=True)
    print(f"{len(jobs)} kernels ({failed} failed) in {time.time() - t0:.0f} s")
    return 1 if failed else 0


def _graph_ms(fn) -> float:
    from benchmarks._timing import graph_ms

    return graph_ms(fn, GRAPH_N, REP)


def _short(c) -> str:
    extra = (f"/mb{c.min_blocks}" if c.min_blocks else "") + (f"/{c.pipeline}" if c.pipeline != "auto" else "") + (f"/split{c.split_k}" if c.split_k > 1 else "")
    extra += "/tmastore" if c.tma_store else ""
    return f"{c.block_M}x{c.block_N}x{c.block_K}/s{c.num_stages}/t{c.threads}/sw{c.swizzle}/{c.policy}{extra}"


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def _table(rows, cols) -> str:
    cols = [c for c in cols if any(r.get(c) is not None for r in rows)]
    w = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols)]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run(groups=None) -> int:
    import torch.nn.functional as F

    import tilelang_ops  # noqa: F401
    from benchmarks._timing import bench, first_run, host_us, interleaved, write_json
    from tilelang_ops.kernels import gemm as K
    from tilelang_ops.ops import gemm as G
    from tilelang_ops.runtime import arch_for_device

    arch = arch_for_device(torch.cuda.current_device())
    t_start = time.time()
    rows, best_rows, overrides = [], [], []
    for gname, (static, cfgs, shapes) in candidates().items():
        if not _selected(gname, groups):
            continue
        n, k, rows_tn = static["n"], static["k"], static["rows"]
        for what, m in shapes:
            torch.manual_seed(0)
            bias = torch.randn(n, device=DEVICE, dtype=DT) if static["bias"] else None
            if what == "wgrad":  # "tn": (m, rows)ᵀ @ (m, n), reduction over the m tokens
                a = torch.randn(m, rows_tn, device=DEVICE, dtype=DT)
                b = w = torch.randn(m, n, device=DEVICE, dtype=DT) * m**-0.5
                c = torch.empty(rows_tn, n, device=DEVICE, dtype=DT)
            else:
                a = torch.randn(m, k, device=DEVICE, dtype=DT)
                w = torch.randn(n, k, device=DEVICE, dtype=DT) * k**-0.5  # nt: (N, K)
                b = w.t().contiguous() if static["layout"] == "nn" else w  # nn: (K, N)
                c = torch.empty(m, n, device=DEVICE, dtype=DT)
            if what == "wgrad":
                ref_fn = lambda: torch.matmul(a.t(), b)  # noqa: E731
                op_fn = lambda: torch.ops.tileops.gemm_tn(a, b)  # noqa: E731
            elif what == "gemm":
                ref_fn = lambda: torch.matmul(a, b)  # noqa: E731
                op_fn = lambda: torch.ops.tileops.gemm(a, b)  # noqa: E731
            elif what == "linear":
                ref_fn = lambda: torch._addmm_activation(bias, a, w.t(), use_gelu=True)  # noqa: E731
                op_fn = lambda: torch.ops.tileops.linear(a, w, bias, "gelu_tanh")  # noqa: E731
            else:
                ref_fn = lambda: torch.matmul(a, w.t())  # noqa: E731
                op_fn = lambda: torch.ops.tileops.gemm_nt(a, w)  # noqa: E731
            ref = F.gelu(F.linear(a, w, bias), approximate="tanh") if what == "linear" else ref_fn()
            flop = 2.0 * m * n * (rows_tn if what == "wgrad" else k)
            shape = f"{what} {rows_tn}x{n}x{m}" if what == "wgrad" else f"{what} {m}x{n}x{k}"
            default = G.config_for(static["layout"], n, k, DT, arch, rows=rows_tn, m=m)
            res, timed = [], []  # timed: (row, cfg, fn) of every candidate that ran and was checked
            for cfg in dict.fromkeys(cfgs):
                row = dict(shape=shape, group=gname, config=_short(cfg), default=cfg == default)
                try:
                    kern = K.matmul_kernel.compile(cfg, arch, **static)
                    args = (a, b, bias, c) if bias is not None else (a, b, c)
                    if cfg.split_k > 1:  # the fp32 partials workspace
                        args += (torch.empty(cfg.split_k, rows_tn, n, device=DEVICE),)
                    c.fill_(float("nan"))  # an unwritten element fails the check
                    first_run(lambda: kern(*args), f"{shape} {_short(cfg)}")  # a hang ends the sweep in 60 s
                    row["rel_err"] = _rel_err(c, ref)
                    timed.append((row, cfg, lambda kern=kern, args=args: kern(*args)))
                except Exception as e:  # one failing candidate must not stop the sweep
                    row.update(error=f"{type(e).__name__}: {e}"[:160], ok=False)
                rows.append(row)
            # candidates and cuBLAS take turns (three rounds, median): timed one after another,
            # the first ran on a cooler GPU at a higher clock
            t_ref, *ts = interleaved(_graph_ms, [ref_fn] + [fn for _, _, fn in timed])
            for (row, cfg, _), t in zip(timed, ts):
                ok = row["rel_err"] < 2e-2 and not math.isnan(row["rel_err"])
                row.update(gpu_ms=t, TFLOPs=flop / t / 1e9, torch_TFLOPs=flop / t_ref / 1e9, ratio=t_ref / t, ok=ok)
                res.append((t if ok else float("inf"), cfg, row))
            # the op path as bench_gemm sees it: per-call events (host cost included) and host µs
            try:
                op_fn()
                torch.cuda.synchronize()
                t_op, t_ref_call = interleaved(lambda fn: bench(fn, rep=30), (op_fn, ref_fn))
                kd = K.matmul_kernel.compile(default, arch, **static)
                args_d = (a, b, bias, c) if bias is not None else (a, b, c)
                if default.split_k > 1:
                    args_d += (torch.empty(default.split_k, rows_tn, n, device=DEVICE),)
                rows.append(dict(shape=shape, group=gname, config="op default (per call)", default=True, TFLOPs=flop / t_op / 1e9,
                                 torch_TFLOPs=flop / t_ref_call / 1e9, ratio=t_ref_call / t_op, call_ms=t_op,
                                 op_host_us=host_us(op_fn, n=300, warmup=30), kernel_host_us=host_us(lambda: kd(*args_d), n=300, warmup=30),
                                 torch_host_us=host_us(ref_fn, n=300, warmup=30)))
            except Exception as e:
                rows.append(dict(shape=shape, group=gname, config="op default (per call)", error=f"{type(e).__name__}: {e}"[:160]))
            if res:
                t_best, cfg_best, row_best = min(res, key=lambda r: r[0])
                t_def = next((r[0] for r in res if r[1] == default), None)
                gain = (t_def / t_best) if t_def else float("nan")
                best_rows.append(dict(shape=shape, best=_short(cfg_best), TFLOPs=row_best["TFLOPs"], ratio=row_best["ratio"], vs_default=gain))
                if what != "linear_noepi" and t_def and gain > 1.02:
                    key = ("sm_9", static["layout"], K.m_bucket(m), n, rows_tn if what == "wgrad" else k)
                    overrides.append(f"    {key!r}: {cfg_best!r},  # {shape}: {gain:.3f}x the default, {row_best['ratio']:.3f}x cuBLAS")
            del a, w, b, c, bias, ref
            torch.cuda.empty_cache()
    cols = ["shape", "config", "default", "TFLOPs", "torch_TFLOPs", "ratio", "rel_err", "op_host_us", "kernel_host_us", "torch_host_us", "error"]
    print(_table(rows, cols))
    print()
    print(_table(best_rows, ["shape", "best", "TFLOPs", "ratio", "vs_default"]))
    for r in best_rows:
        print(f"BEST {r['shape']}: {r['best']} {r['TFLOPs']:.0f} TFLOP/s, {r['ratio']:.3f}x cuBLAS, {r['vs_default']:.3f}x default")
    print("# paste into tilelang_ops/kernels/gemm.py DEFAULT_OVERRIDES (one key per (layout, M bucket, n, k);")
    print("# when two shapes of one bucket disagree keep the larger-M one; \"sm_9\" serves every Hopper board,")
    print(f"# {torch.cuda.get_device_name()!r} in its place this one only):")
    for line in overrides:
        print("OVERRIDE" + line)
    path = write_json("sweep_gemm", rows, {"best": best_rows, "overrides": overrides, "wall_s": time.time() - t_start})
    print(f"wrote {path} in {time.time() - t_start:.0f} s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", action="store_true", help="only compile every kernel for sm_90a (no GPU needed)")
    p.add_argument("--list", action="store_true", help="print the kernels and exit")
    p.add_argument("--group", action="append", help="only these candidate groups (see candidates(); shell patterns: 'pp_*')")
    args = p.parse_args(argv)
    if args.list:
        jobs = _jobs(args.group)
        for _, cfg, static in jobs:
            print(static["layout"], static["n"], static["k"], static["activation"], cfg)
        print(len(jobs), "kernels")
        return 0
    if args.warm:
        return warm(args.group)
    if not torch.cuda.is_available():
        print("no CUDA device: use --warm here, run the sweep on the GPU host", file=sys.stderr)
        return 2
    return run(args.group)


if __name__ == "__main__":
    raise SystemExit(main())
