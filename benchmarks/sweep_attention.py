"""Attention configs side by side: the default and candidates (e.g. the async pipelines), per
shape of the benchmark set, timed in turns in one process. Each candidate's output is checked
against the default's first (max abs difference printed: out and LSE, or dq/dk/dv), so a fast but
wrong kernel shows.

    python -m benchmarks.sweep_attention --warm [--bwd]  # CPU machine: compile every candidate (sm_90a)
    python -m benchmarks.sweep_attention [--bwd]         # H200: TFLOP/s table, JSON under $OUT
    python -m benchmarks.sweep_attention --gpt [--bwd]   # examples/train_gpt.py's attention instead
    python -m benchmarks.sweep_attention --lazy [--warm] # the defaults with lazy O rescaling
    python -m benchmarks.sweep_attention --post-mask [--warm]  # the defaults with the other FwdConfig.post_mask
    python -m benchmarks.sweep_attention --bwd --stats [--warm]     # backward: the defaults with the other BwdConfig.stats_early
    python -m benchmarks.sweep_attention --bwd --dq-first [--warm]  # backward: the defaults with the other dq_first
    python -m benchmarks.sweep_attention --bwd --walk [--shapes 0 3]  # backward: the default twice and with the other reverse (4: D=64 GQA)
    python -m benchmarks.sweep_attention --wide --shapes 2 4 5  # forward, D=64: 192 x 128 in the async pipelines (5: GPT-2's shape)
    python -m benchmarks.sweep_attention --tiles128 --shapes 0 1 3 [--causal-only]  # forward, D=128: 128 x 128 async tiles, persistent or not
    python -m benchmarks.sweep_attention --ablate [--bwd]  # the op's defaults, again (A/A) and with each feature switched
    python -m benchmarks.sweep_attention --stages --shapes 2 4  # forward: the defaults again and with one more K/V stage
    python -m benchmarks.sweep_attention --pingpong --shapes 2 4 0  # forward: the async defaults against FlashAttention-3's warpgroup ping-pong
    python -m benchmarks.sweep_attention --block-n --shapes 2 4 --causal-only  # forward: the defaults again and with 64, 176, 192 keys a step
    python -m benchmarks.sweep_attention --uniform [--bwd]  # the defaults again and with the other uniform_ws (warp-uniform role branches)
    python -m benchmarks.sweep_attention --late-store --causal-only  # the defaults again; persistent ones with FwdConfig.late_store_wait
    python -m benchmarks.sweep_attention --confirm --shapes 2 4 5 1 0  # forward: A/A, tree4 (pinned or not), pinned tree8, D=64 192x128 pinned
    python -m benchmarks.sweep_attention --ab-tree --causal-only --shapes 2 4 5  # forward: default and tree4 in turns (tree4 defaults: against 0, 8 chains, the other uniform_ws)
    python -m benchmarks.sweep_attention --short  # D=64 non-causal, 197-4096 tokens: the 192 x 176 default against the 128 x 128 persistent tile, uniform_ws or not
    python -m benchmarks.sweep_attention --short 128  # the same lengths at D=128: the 192 x 128 default against the 128 x 128 persistent tile, uniform_ws or not
    python -m benchmarks.sweep_attention --vary persistent=1,uniform_ws=1 --vary persistent=1 --causal-only --shapes 0 3  # the default and each variant of it, twice, in turns
    python -m benchmarks.sweep_attention --bwd --vary num_stages=3 --non-causal-only --shape 4,32,32,8192,128  # --shape B,H,HK,S,D: other shapes
    python -m benchmarks.sweep_attention --pin [--tree] [--late-store]  # the defaults again; with FwdConfig.pin_waits, tree_reduce=4, late_store_wait (each also pinned); T.Pipelined defaults: against pinned async tiles

Forward FLOPs = 4 * B * H * S^2 * D, halved when causal; backward 2.5x that (as bench_attention).
--bwd times the backward as the op runs it (`flash_bwd_fused`: preprocess, main kernel, dQ cast).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import sys

# (B, H, HK, S, D) as bench_attention.CASES
SHAPES = [(8, 32, 32, 4096, 128), (2, 16, 16, 16384, 128), (16, 32, 32, 2048, 64), (8, 32, 8, 4096, 128)]
# --shapes may also pick these (indexes after SHAPES'): GQA at D=64, GPT-2 small's attention
EXTRA_SHAPES = [(16, 32, 8, 2048, 64), (32, 12, 12, 1024, 64)]
# --gpt: examples/train_gpt.py's attention (GPT-2 small, 32 x 1024 tokens, causal). 1024 rows are
# 5.33 tiles of 192 (the last two-thirds empty) and 8 of 128.
GPT_SHAPES = [(32, 12, 12, 1024, 64), (16, 32, 32, 2048, 64)]  # and the benchmark set's D=64 shape
# --short: D=64 non-causal at encoder / ViT lengths (~32K tokens a call): the 192-row default
# tile pads 197 rows to 384, 1024 to 1152 (12.5%); a 128-row tile pads less
SHORT_SHAPES = [(160, 16, 16, 197, 64), (64, 16, 16, 512, 64), (56, 16, 16, 577, 64), (42, 16, 16, 768, 64),
                (32, 16, 16, 1024, 64), (21, 16, 16, 1536, 64), (16, 16, 16, 2048, 64), (8, 16, 16, 4096, 64),
                (16, 32, 32, 2048, 64), (10, 16, 16, 3072, 64)]  # the benchmark set's D=64 shape; between 2048 and 4096
CAUSAL = (False, True)
GPT = False
LAZY = False
POST_MASK = False
DQ_PATHS = False
STATS = False
DQ_FIRST = False
WALK = False
PERSISTENT = False
WIDE = False
TILES128 = False
ABLATE = False
PINGPONG = False
STAGES = False
BLOCK_N = False
UNIFORM = False
LATE_STORE = False
TREE = False
PIN = False
CONFIRM = False
AB_TREE = False
SHORT = False
VARY: list = []  # --vary: FwdConfig / BwdConfig field overrides, one dict per candidate


def _gpt_candidates():
    from tilelang_ops.kernels.attention import FwdConfig

    # 192 x 128 with three consumer warpgroups is FlashAttention-3's D=64 tile; the hand-synchronized
    # pipelines compile there without spills at D=64 (128 registers at the 512-thread launch bound,
    # nvcc -Xptxas -v, fifteenth session): not yet timed
    return [FwdConfig(192, 128, 2, 384), FwdConfig(128, 128, 2, 256), FwdConfig(128, 128, 2, 256, "async"),
            FwdConfig(128, 128, 2, 256, "pingpong"), FwdConfig(128, 176, 2, 256, "async"), FwdConfig(128, 64, 2, 256),
            FwdConfig(192, 128, 2, 384, "async"), FwdConfig(192, 128, 2, 384, "pingpong")]


def candidates(headdim: int, causal: bool = False):
    """FwdConfigs to time beside the default at this head dim (the default is added by the caller):
    the hand-synchronized pipelines at FlashAttention-3's tiles (128 query rows, 176 keys a step at
    D=128; the eighth session's sweep tried 128x128 and 192x96), ptxas: no spills. With --lazy:
    the default and those tiles with FwdConfig.lazy_rescale (and without, for comparison)."""
    from tilelang_ops.kernels.attention import FwdConfig, fwd_default_config

    if TILES128 and headdim == 128:
        # causal: 128 x 128 wastes 3% of a 4096-token causal tile set on the diagonal, 128 x 176 7%;
        # non-causal: the default's 192 rows pad 4096 to 4224, and at 128 x 128 O has its own shared
        # buffer in the persistent walk (the next tile's Q lands under this one's epilogue)
        tile = FwdConfig(128, 128, 2, 256, "async", 8.0, post_mask=not causal)
        extra = [dataclasses.replace(tile, post_mask=False, persistent=True)] if not causal else []
        return [fwd_default_config(headdim, causal), tile, dataclasses.replace(tile, persistent=True)] + extra
    if WIDE and headdim == 64:  # FlashAttention-3's D=64 tile: three consumer warpgroups, 192 x 128
        # (twenty-second session: ping-pong and 3 stages lost). T.Pipelined 192 x 128: 2048 keys are
        # 16 blocks of 128 but 11.6 of the default's 176 (3% of the key work padding); the default
        # again, for the run's noise.
        wide = FwdConfig(192, 128, 2, 384, "async", post_mask=True)
        return [wide, dataclasses.replace(wide, persistent=True), FwdConfig(192, 128, 2, 384, post_mask=True),
                fwd_default_config(headdim, causal)]
    if PERSISTENT:  # the async tiles with and without the persistent walk
        tiles = [FwdConfig(128, 128, 2, 256, "async", post_mask=True)] if headdim == 64 else [FwdConfig(128, 176, 2, 256, "async", 8.0)]
        default = fwd_default_config(headdim, causal)
        return [c for t in tiles for c in (t, dataclasses.replace(t, persistent=True)) if c != default]
    if POST_MASK:  # the default against itself with the other masking
        default = fwd_default_config(headdim, causal)
        return [dataclasses.replace(default, post_mask=not default.post_mask)]
    if LAZY:
        tiles = [FwdConfig(192, 128, 2, 384), FwdConfig(128, 176, 2, 256, "async")] if headdim == 128 else [FwdConfig(192, 176, 2, 384), FwdConfig(128, 128, 2, 256, "async")]
        default = fwd_default_config(headdim, causal)
        return [c for t in tiles for c in (t, dataclasses.replace(t, lazy_rescale=8.0)) if c != default]
    if headdim == 128:
        return [FwdConfig(128, 176, 2, 256, "async"), FwdConfig(128, 176, 2, 256, "pingpong"), FwdConfig(128, 144, 2, 256, "pingpong")]
    if headdim == 64:
        if GPT:
            return _gpt_candidates()
        return [FwdConfig(128, 176, 2, 256, "async"), FwdConfig(128, 176, 2, 256, "pingpong"), FwdConfig(192, 128, 2, 384, "async")]
    return []


def pingpong_candidates(default) -> list:
    """--pingpong: cuDNN's D=64 forward (Nsight Compute, session 33) is a ping-pong, two consumer
    warpgroups of 64 x 128 that wait for each GEMM and take turns (a 256-thread named barrier),
    without intra-warpgroup overlap. The default again (A/A), then our tiles in the ping-pong
    pipeline (not persistent: the persistent walk is async-only)."""
    from tilelang_ops.kernels.attention import FwdConfig

    if default.pipeline == "async":
        flat = dataclasses.replace(default, persistent=False)
        out = [default] + ([flat] if default.persistent else []) + [dataclasses.replace(flat, pipeline="pingpong")]
        if not flat.lazy_rescale:
            out.append(dataclasses.replace(flat, pipeline="pingpong", lazy_rescale=8.0))
        return out
    return [default] + [FwdConfig(128, bn, 2, 256, "pingpong", default.lazy_rescale, post_mask=True) for bn in (128, 176)]


def variants(cfg) -> list:
    """--tree / --late-store: cfg with the row reductions as 4 chains, with the O store's wait deferred (persistent)."""
    out = [dataclasses.replace(cfg, tree_reduce=4)] if TREE else []
    return out + ([dataclasses.replace(cfg, late_store_wait=True)] if LATE_STORE and cfg.persistent else [])


def pin_candidates(default, headdim: int) -> list:
    """--pin (FwdConfig.pin_waits, session 38: ptxas had hoisted the full wgmma wait above the
    softmax in the async forwards). An async default: pinned; at D=64 also pinned with lazy
    rescaling (O's rescale now sits between the wait and the next step's issue) and in the
    ping-pong pipeline; then --tree / --late-store on the pinned one. A T.Pipelined default
    (non-causal): the async tiles that lost to it, pinned."""
    from tilelang_ops.kernels.attention import FwdConfig

    if default.pipeline == "auto":
        if headdim == 64:
            return [FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, pin_waits=True)] + variants(default)
        return [FwdConfig(128, bn, 2, 256, "async", lazy_rescale=8.0, pin_waits=True) for bn in (176, 128)] + variants(default)
    pinned = dataclasses.replace(default, pin_waits=True)
    out = [pinned]
    if headdim == 64:
        out += [dataclasses.replace(pinned, lazy_rescale=8.0), dataclasses.replace(pinned, persistent=False, pipeline="pingpong")]
    return out + variants(pinned)


def confirm_candidates(default, headdim: int) -> list:
    """--confirm (session 39, after --pin --tree: pinned alone 0.96-1.01x, pinned with tree4
    1.00-1.04x): the default again (A/A); tree4 without the pin and with it, and pinned with 8
    chains. D=64: also FlashAttention-3's D=64 tile (192 x 128, three consumer warpgroups) in the
    async pipeline, persistent and pinned, whose earlier timings (twenty-second session) ran with
    the hoisted wait. T.Pipelined defaults: tree4 on them and on the pinned async tile."""
    from tilelang_ops.kernels.attention import FwdConfig

    out = [default, dataclasses.replace(default, tree_reduce=4)]
    if default.pipeline == "auto":
        tile = (FwdConfig(128, 128, 2, 256, "async", post_mask=True, persistent=True, pin_waits=True) if headdim == 64
                else FwdConfig(128, 176, 2, 256, "async", lazy_rescale=8.0, pin_waits=True))
    else:
        tile = dataclasses.replace(default, pin_waits=True)
        out.append(dataclasses.replace(tile, tree_reduce=8))
    out.append(dataclasses.replace(tile, tree_reduce=4))
    if headdim == 64:
        wide = FwdConfig(192, 128, 2, 384, "async", post_mask=True, persistent=True, pin_waits=True)
        out += [wide, dataclasses.replace(wide, tree_reduce=4)]
    return out


def bwd_candidates(headdim: int):
    """BwdConfigs to time beside the default backward (the async pipeline at D=64/128): TileLang's
    T.Pipelined kernel at its former defaults, and the async pipeline's other tiles. With
    --dq: the default with the other BwdConfig.dq_producer (the dQ reduce-add issued by the
    producer warpgroup or by a consumer thread), and with three stages."""
    from tilelang_ops.kernels.attention import BwdConfig, bwd_default_config

    if WALK and headdim in (64, 128):  # the default again (the run's noise) and the other BwdConfig.reverse (causal GQA)
        default = bwd_default_config(headdim, True)
        return [default, dataclasses.replace(default, reverse=not default.reverse)]
    if DQ_FIRST and headdim in (64, 128):  # BwdConfig.dq_first: dQ's wgmma before dK's, or not
        default = bwd_default_config(headdim, False)
        return [dataclasses.replace(default, dq_first=not default.dq_first)]
    if STATS and headdim in (64, 128):  # BwdConfig.stats_early: LSE (and Delta) read early
        default = bwd_default_config(headdim, False)
        return [dataclasses.replace(default, stats_early=e) for e in ((0, 1, 2) if headdim == 128 else (0, 1)) if e != default.stats_early]
    if DQ_PATHS and headdim in (64, 128):  # the default: the producer's TMA reduce-add
        default = bwd_default_config(headdim, False)
        other = dataclasses.replace(default, dq_producer=not default.dq_producer)
        return [other, dataclasses.replace(default, num_stages=3)]
    if headdim == 128:
        return [BwdConfig(128, 64, 2, 256), BwdConfig(128, 64, 3, 256, pipeline="async")]
    if headdim == 64:
        return [BwdConfig(128, 128, 1, 256), BwdConfig(128, 64, 2, 256, pipeline="async")]
    return []


def ablations(cfg, headdim: int, causal: bool, groups: int) -> list:
    """--ablate: the default `cfg` again (the run's own noise), then the default with one feature
    switched at a time: the features were kept on sweeps timed in biased turns (docs/benchmarks.md,
    thirtieth session), and a 1-4% gain there is the size of that bias."""
    from tilelang_ops.kernels.attention import BwdConfig

    out = [cfg, cfg]
    if isinstance(cfg, BwdConfig):
        if cfg.pipeline != "async":
            return out
        if headdim == 64:  # at D=128, 128 queries a step need 290 KB of shared memory
            out.append(dataclasses.replace(cfg, block_n=192 - cfg.block_n))  # 64 <-> 128 queries a step
        out.append(dataclasses.replace(cfg, num_stages=5 - cfg.num_stages))  # 2 <-> 3
        if cfg.block_n == 64:
            out.append(dataclasses.replace(cfg, stats_early=1 - min(cfg.stats_early, 1)))
        out.append(dataclasses.replace(cfg, dq_first=not cfg.dq_first))
        if causal and groups > 1:
            out.append(dataclasses.replace(cfg, reverse=not cfg.reverse))
        return out
    out.append(dataclasses.replace(cfg, lazy_rescale=0.0 if cfg.lazy_rescale else 8.0))
    out.append(dataclasses.replace(cfg, post_mask=not cfg.post_mask))
    if cfg.pipeline == "async" and headdim == 64:  # at D=128 the persistent walk lost 0.82-0.97x (session 18)
        out.append(dataclasses.replace(cfg, persistent=not cfg.persistent))
    return out


def _varied(default) -> list:
    """--vary: the default and each variant (its fields replaced, each value cast to the field's
    type), twice, in turns (A B C A B C): the default's second timing is the A/A control."""
    variants = [dataclasses.replace(default, **{f: type(getattr(default, f))(v) for f, v in o.items()}) for o in VARY]
    return ([default] + variants) * 2


def _configs(D: int, S: int, causal: bool, groups: int, bwd: bool, arch: str = "sm_90a") -> list:
    """The configs a shape times, the default first (with --ablate, --pingpong, --stages: the op's own
    default for S keys)."""
    from tilelang_ops.kernels import attention as K

    if bwd:
        default = K.bwd_default_config(D, causal, arch, S)  # the op's, for S keys
        if VARY:
            return _varied(default)
        if UNIFORM:
            return [default, default, dataclasses.replace(default, uniform_ws=not default.uniform_ws)]
        return ablations(default, D, causal, groups) if ABLATE else [default] + bwd_candidates(D)
    default = K.fwd_default_config(D, causal, arch, S if ABLATE or PINGPONG or STAGES or BLOCK_N or UNIFORM or LATE_STORE or TREE or PIN or CONFIRM or AB_TREE or SHORT or VARY else None)
    if VARY:
        return _varied(default)
    if UNIFORM:  # the default again (A/A) and with the other uniform_ws (role branches on a warp-uniform index)
        return [default, default, dataclasses.replace(default, uniform_ws=not default.uniform_ws)]
    if CONFIRM:
        return [default] + confirm_candidates(default, D)
    if SHORT:  # the long default (T.Pipelined, 192 rows) twice, then the short one (128 x 128
        # persistent) and itself with the other uniform_ws, in turns
        long, short = K.fwd_default_config(D, causal, arch), K.fwd_default_config(D, causal, arch, K.SHORT_ROWS[D])
        other = dataclasses.replace(short, uniform_ws=not short.uniform_ws)
        return [long, long, other, short, other, short]
    if AB_TREE:  # session 40: tree4 1.00-1.05x at D=64 causal in two --confirm sweeps; A/B/A/B/A/B settled it
        if default.tree_reduce:  # since then the D=64 causal default: against no tree, 8 chains, the other uniform_ws
            return [default, dataclasses.replace(default, tree_reduce=0), dataclasses.replace(default, tree_reduce=8),
                    dataclasses.replace(default, uniform_ws=not default.uniform_ws)] * 2
        return [default, dataclasses.replace(default, tree_reduce=4)] * 3
    if LATE_STORE or TREE or PIN:  # the default again (A/A); then each candidate asked for
        return [default, default] + pin_candidates(default, D) if PIN else [default, default] + variants(default)
    if BLOCK_N:  # the default again (A/A) and with other key-block widths (fewer steps: less per-step work, more masked waste)
        return [default, default] + [dataclasses.replace(default, block_n=n) for n in (64, 176, 192) if n != default.block_n]
    if PINGPONG:
        return [default] + pingpong_candidates(default)
    if STAGES:  # the default again (A/A) and with one more K/V stage (cuDNN's D=64 forward: 134 KB of shared memory, ours 98)
        return [default, default, dataclasses.replace(default, num_stages=default.num_stages + 1)]
    return ablations(default, D, causal, groups) if ABLATE else [default] + candidates(D, causal)


def jobs(bwd: bool = False):
    """(config, static) of every kernel the sweep runs: default and candidates, causal and not."""
    from tilelang_ops.kernels import attention as K

    out = []
    for B, H, HK, S, D in SHAPES:
        for causal in CAUSAL:
            static = dict(headdim=D, dtype="bfloat16", causal=causal, groups=H // HK, scale=K.default_scale(D))
            for cfg in _configs(D, S, causal, H // HK, bwd):
                if (cfg, static) not in [(c, s) for c, s in out]:
                    out.append((cfg, static))
    return out


def warm(bwd: bool = False) -> int:
    from tilelang_ops.kernels import attention as K

    failed = 0
    for cfg, static in jobs(bwd):
        try:
            (K.flash_bwd_fused_kernel if bwd else K.flash_fwd_kernel).compile(cfg, "sm_90a", **static)
            print("ok", cfg, static["headdim"], static["causal"], static["groups"])
        except Exception as e:  # a candidate may not fit; report and go on
            failed += 1
            print("FAILED", cfg, static, type(e).__name__, str(e).splitlines()[0][:200])
    return failed


def _cases():
    """(B, H, HK, S, D, causal, static args, q, k, v) per shape of SHAPES, non-causal and causal."""
    import torch

    from tilelang_ops.kernels import attention as K

    for B, H, HK, S, D in SHAPES:
        for causal in CAUSAL:
            static = dict(headdim=D, dtype="bfloat16", causal=causal, groups=H // HK, scale=K.default_scale(D))
            q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            yield B, H, HK, S, D, causal, static, q, k, v


def _name(cfg) -> str:
    if isinstance(cfg, str):
        return cfg
    lazy = f"/lazy{cfg.lazy_rescale:g}" if getattr(cfg, "lazy_rescale", 0) else ""
    post = "/postmask" if getattr(cfg, "post_mask", False) else ""
    post += "/dqprod" if getattr(cfg, "dq_producer", False) else ""
    post += "/persistent" if getattr(cfg, "persistent", False) else ""
    post += f"/stats{cfg.stats_early}" if getattr(cfg, "stats_early", 0) else ""
    post += "/dqfirst" if getattr(cfg, "dq_first", False) else ""
    post += "/reverse" if getattr(cfg, "reverse", False) else ""
    post += "/uniform" if getattr(cfg, "uniform_ws", False) else ""
    post += "/latestore" if getattr(cfg, "late_store_wait", False) else ""
    post += f"/tree{cfg.tree_reduce}" if getattr(cfg, "tree_reduce", 0) else ""
    post += "/pin" if getattr(cfg, "pin_waits", False) else ""
    post += "/serial" if not getattr(cfg, "overlap", True) else ""
    post += "/pfirst" if getattr(cfg, "producer_first", False) else ""
    post += "/dynamic" if getattr(cfg, "dynamic", False) else ""
    post += f"/lpt{cfg.lpt}" if getattr(cfg, "lpt", 0) else ""
    return f"{cfg.block_m}x{cfg.block_n}/{cfg.num_stages}/{cfg.threads}/{cfg.pipeline}{lazy}{post}"


def _cudnn(q, k, v, causal, backward=False):
    """SDPA's cuDNN backend on the same tensors ((B, S, H, D) viewed as (B, H, S, D)): the peer row."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(backward) for t in (q, k, v))

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])

    if not backward:
        return fwd
    out = fwd()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)


def _rounds(log: list, i: int) -> dict:
    """Entry i's timings per round (ms) and its place in each round's order, from interleaved's
    log: a median hides a round that ran slow (session 47 saw one schedule's entry 13% slower
    than another entry of the same kernel in one sweep)."""
    order = {}
    for k, r, _ in log:
        order.setdefault(r, []).append(k)
    return dict(rounds_ms=[round(t, 4) for k, _, t in log if k == i], places=[order[r].index(i) for r in sorted(order)])


def main_bwd() -> None:
    import torch

    from tilelang_ops import runtime
    from tilelang_ops.kernels import attention as K
    from tilelang_ops.ops.attention import lse_rows

    from ._timing import bench, first_run, interleaved, table, write_json

    arch = runtime.arch_for_device(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for B, H, HK, S, D, causal, static, q, k, v in _cases():
        shape = f"{B}x{H}/{HK}x{S}x{D}"
        out, lse = torch.ops.tileops.flash_attn_with_lse(q, k, v, causal)
        dout = torch.randn_like(out)
        delta, lse2 = (torch.empty(B, H, lse_rows(S), device="cuda") for _ in range(2))
        dq_acc = torch.empty(B, S, H, D, device="cuda")
        fns, names, checks, ref = [], [], [], None
        grads = [torch.empty_like(t) for t in (q, k, v)]  # shared by every config, as in main()
        for cfg in _configs(D, S, causal, H // HK, True, arch):
            for g in grads:
                g.fill_(float("nan"))
            try:
                kern = runtime.launcher(K.flash_bwd_fused_kernel.compile(cfg, arch, **static))
                run = lambda kern=kern: kern(q, k, v, out, dout, lse, delta, lse2, dq_acc, *grads)
                first_run(run, f"{shape} causal={causal} {_name(cfg)}")
            except Exception as e:
                rows.append(dict(shape=shape, causal=causal, config=str(cfg), error=str(e).splitlines()[0][:80]))
                continue
            ref = ref or [g.float() for g in grads]
            checks.append(max((g.float() - r).abs().max().item() for g, r in zip(grads, ref)))
            fns.append(run)
            names.append(cfg)
        flops = 2.5 * 4.0 * B * H * S * S * D / (2 if causal else 1)
        fns.append(_cudnn(q, k, v, causal, backward=True))
        names.append("sdpa_cudnn")
        checks.append(float("nan"))
        log = []
        times = interleaved(lambda f: bench(f, warmup=5, rep=30), fns, log=log)
        for i, (cfg, t, err) in enumerate(zip(names, times, checks)):
            rows.append(dict(shape=shape, causal=causal, config=_name(cfg), ms=t, tflops=flops / t / 1e9, vs_default=times[0] / t, max_abs_diff=err,
                             **_rounds(log, i)))
        print(f"done bwd {shape} causal={causal}", flush=True)
        write_json("sweep_attention_bwd", rows)  # each shape as it finishes (a hung candidate ends the process)
    print(table(rows, ["shape", "causal", "config", "ms", "tflops", "vs_default", "max_abs_diff", "error"]))


def main() -> None:
    import torch

    from tilelang_ops import runtime
    from tilelang_ops.ops import attention as A

    from ._timing import bench, first_run, interleaved, table, write_json

    arch = runtime.arch_for_device(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for B, H, HK, S, D, causal, static, q, k, v in _cases():
        cfgs = _configs(D, S, causal, H // HK, False, arch)
        fns, names, checks = [], [], []
        ref = None
        # One output pair for every config: where a buffer lies moves a kernel's time by up to
        # 3% (identical kernels writing to their own buffers, session 21).
        out = torch.empty_like(q)
        lse = torch.empty((B, H, S), device="cuda")
        for cfg in cfgs:
            try:  # a dynamic walk with its tile counter, as the op launches it
                kern = A.fwd_config_launcher(cfg, q.device, arch, **static)
            except Exception as e:
                rows.append(dict(shape=f"{B}x{H}/{HK}x{S}x{D}", causal=causal, config=str(cfg), error=str(e)[:80]))
                continue
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            try:
                first_run(lambda: kern(q, k, v, out, lse), f"{B}x{H}/{HK}x{S}x{D} causal={causal} {_name(cfg)}")
            except Exception as e:  # e.g. more shared memory than the SM has
                rows.append(dict(shape=f"{B}x{H}/{HK}x{S}x{D}", causal=causal, config=str(cfg), error=str(e).splitlines()[0][:80]))
                continue
            if ref is None:
                ref = (out.float(), lse.clone())
            err = (out.float() - ref[0]).abs().max().item()
            lerr = (lse - ref[1]).abs().max().item()
            checks.append((err, lerr))
            fns.append(lambda kern=kern: kern(q, k, v, out, lse))
            names.append(cfg)
        flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
        fns.append(_cudnn(q, k, v, causal))
        names.append("sdpa_cudnn")
        checks.append((float("nan"), float("nan")))
        log = []
        times = interleaved(lambda f: bench(f, warmup=5, rep=30), fns, log=log)
        for i, (cfg, t, (err, lerr)) in enumerate(zip(names, times, checks)):
            rows.append(dict(shape=f"{B}x{H}/{HK}x{S}x{D}", causal=causal, config=_name(cfg),
                             ms=t, tflops=flops / t / 1e9, vs_default=times[0] / t, max_abs_diff=err, lse_diff=lerr,
                             **_rounds(log, i)))
        # each shape's rows as they come (a hung candidate must not take the others' with it)
        print(table([r for r in rows if r["shape"] == f"{B}x{H}/{HK}x{S}x{D}" and r["causal"] == causal],
                    ["shape", "causal", "config", "ms", "tflops", "vs_default", "max_abs_diff", "error"]), flush=True)
        write_json("sweep_attention", rows)
    print(table(rows, ["shape", "causal", "config", "ms", "tflops", "vs_default", "max_abs_diff", "lse_diff", "error"]))


def _overrides(text: str) -> dict:
    """'persistent=1,lazy_rescale=8.0' -> {'persistent': 1, 'lazy_rescale': 8.0}: Python literals,
    cast to the config field's type when applied (_varied)."""
    out = {}
    for item in text.split(","):
        field, _, value = item.partition("=")
        try:
            out[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with a Python literal value") from None
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", action="store_true", help="compile every candidate for sm_90a (no GPU needed)")
    ap.add_argument("--bwd", action="store_true", help="the backward's configs instead of the forward's")
    ap.add_argument("--gpt", action="store_true", help="examples/train_gpt.py's shape (causal) and more D=64 tiles")
    ap.add_argument("--lazy", action="store_true", help="forward tiles with and without FwdConfig.lazy_rescale")
    ap.add_argument("--post-mask", action="store_true", help="the forward defaults against themselves with the other FwdConfig.post_mask")
    ap.add_argument("--persistent", action="store_true", help="forward: the async tiles with and without FwdConfig.persistent")
    ap.add_argument("--dq-first", action="store_true", help="--bwd: the defaults against themselves with BwdConfig.dq_first")
    ap.add_argument("--stats", action="store_true", help="--bwd: the defaults against their other BwdConfig.stats_early values")
    ap.add_argument("--dq", action="store_true", help="--bwd: the defaults against their other BwdConfig.dq_producer")
    ap.add_argument("--walk", action="store_true", help="--bwd: the default, itself again and with the other BwdConfig.reverse")
    ap.add_argument("--wide", action="store_true", help="forward, D=64: 192 x 128 tiles in the async pipelines (three consumer warpgroups)")
    ap.add_argument("--tiles128", action="store_true", help="forward, D=128: the default twice, 128 x 128 async tiles (persistent or not)")
    ap.add_argument("--ablate", action="store_true", help="the op's defaults twice and with each feature switched (forward, or --bwd)")
    ap.add_argument("--pingpong", action="store_true", help="forward: the defaults again and in FlashAttention-3's warpgroup ping-pong")
    ap.add_argument("--stages", action="store_true", help="forward: the defaults again and with one more K/V stage")
    ap.add_argument("--block-n", action="store_true", help="forward: the defaults again and with block_n 64, 176, 192")
    ap.add_argument("--uniform", action="store_true", help="the defaults again and with the other uniform_ws (warp-uniform role branches; forward, or --bwd)")
    ap.add_argument("--late-store", action="store_true", help="forward: the defaults again; persistent ones with FwdConfig.late_store_wait")
    ap.add_argument("--tree", action="store_true", help="forward: the defaults again and with FwdConfig.tree_reduce=4")
    ap.add_argument("--pin", action="store_true", help="forward: the defaults again and with FwdConfig.pin_waits (async pipelines; with --tree / --late-store: each also pinned)")
    ap.add_argument("--confirm", action="store_true", help="forward: the defaults again, with tree4 (pinned or not), pinned tree8; D=64: 192 x 128 async persistent pinned")
    ap.add_argument("--ab-tree", action="store_true", help="forward: the default and itself with tree_reduce=4, three times each, in turns; a tree4 default against no tree, 8 chains and uniform_ws, twice")
    ap.add_argument("--short", type=int, nargs="?", const=64, choices=(64, 128), help="non-causal at 197-4096 tokens, head dim 64 (default) or 128: the long default twice, the 128 x 128 persistent tile with uniform_ws and without, in turns")
    ap.add_argument("--vary", action="append", type=_overrides, default=[], metavar="FIELD=VALUE[,...]",
                    help="a candidate: the default with these config fields replaced (repeatable); the default and the candidates, twice, in turns")
    ap.add_argument("--causal-only", action="store_true", help="causal shapes only")
    ap.add_argument("--non-causal-only", action="store_true", help="non-causal shapes only")
    ap.add_argument("--shape", action="append", type=lambda t: tuple(int(x) for x in t.split(",")), metavar="B,H,HK,S,D",
                    help="time this shape instead of SHAPES (repeatable)")
    ap.add_argument("--shapes", type=int, nargs="+", help="only these SHAPES (indexes; with --short: of SHORT_SHAPES)")
    args = ap.parse_args()
    WALK = args.walk
    DQ_PATHS = args.dq
    STATS = args.stats
    DQ_FIRST = args.dq_first
    PERSISTENT = args.persistent
    WIDE = args.wide
    TILES128 = args.tiles128
    ABLATE = args.ablate
    PINGPONG = args.pingpong
    STAGES = args.stages
    BLOCK_N = args.block_n
    UNIFORM = args.uniform
    LATE_STORE = args.late_store
    TREE = args.tree
    PIN = args.pin
    CONFIRM = args.confirm
    AB_TREE = args.ab_tree
    VARY = args.vary
    if args.short:
        SHAPES, CAUSAL, SHORT = [(B, H, HK, S, args.short) for B, H, HK, S, _ in SHORT_SHAPES], (False,), True
    if args.shapes:
        SHAPES = [(SHAPES if args.short else SHAPES + EXTRA_SHAPES)[i] for i in args.shapes]
    if args.causal_only:
        CAUSAL = (True,)
    if args.non_causal_only:
        CAUSAL = (False,)
    if args.shape:
        SHAPES = args.shape
    LAZY = args.lazy
    POST_MASK = args.post_mask
    if args.gpt:
        SHAPES, CAUSAL, GPT = GPT_SHAPES, (True,), True
    if args.warm:
        sys.exit(1 if warm(args.bwd) else 0)
    main_bwd() if args.bwd else main()
