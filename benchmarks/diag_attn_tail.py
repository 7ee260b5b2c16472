"""What the ragged last query tile costs the non-causal forward, side by side with cuDNN.

    python -m benchmarks.diag_attn_tail [--rounds N] [--in-turns]    # on the GPU
    python -m benchmarks.diag_attn_tail --warm [--in-turns]          # here: compile what it loads (sm_90a)

Why: the long non-causal defaults tile the queries in 192 rows (three consumer warpgroups), and
the #6 shapes' lengths are powers of two: 4096 rows are 21 tiles and 64 rows (D=128), 2048 are 10
and 128 (D=64). If a tile's time does not shrink with its valid rows, the last one costs a full
tile: 22/21 (+4.8%) of the work at 4096 (D=128, the row furthest below its 1.05x target), where
a 128-row tile wastes none. Timing the kernel over query lengths that are whole tiles
(Sq = 20, 21, 22 x 192) beside the power of two, keys fixed, tells the tail's price; the 128 x 128
persistent kernel (the short-row default) at the same lengths tells whether a tile that divides
the length could be the better default there. D=64 (whose op runs the 128-row tile up to 2048
rows) the same, around 2048.

Per case, contenders in turns (`_timing.interleaved`), each a config's launcher into
preallocated buffers, as the op launches it: `t192` (the long non-causal default), `p128` (the
short-row default: 128 x 128, persistent) and `cudnn` (SDPA's cuDNN backend on (B, H, S, D)
tensors). TFLOP/s count only the valid rows: 4 * B * H * Sq * Sk * D.
Writes $OUT/diag_attn_tail.json and prints a table last.
"""
from __future__ import annotations

import argparse

import torch

from ._timing import first_run, named_in_turns, table, write_json

# (B, H, Sk, D, query lengths): the keys fixed, the queries whole 192-row tiles and the power of two
CASES = [
    (8, 32, 4096, 128, (3840, 4032, 4096, 4224)),
    (16, 32, 2048, 64, (1920, 2048, 2112)),
]


def _configs(headdim: int) -> dict:
    from tilelang_ops.kernels import attention as K

    # None: the long-sequence default; 1024 rows: the short-row one (both head dims)
    return {"t192": K.fwd_default_config(headdim, False, "sm_90a"), "p128": K.fwd_default_config(headdim, False, "sm_90a", 1024)}


def _static(headdim: int) -> dict:
    """flash_fwd_kernel's arguments as the op passes them (a persistent grid: fwd_config_launcher's)."""
    from tilelang_ops.ops import attention as A

    return dict(A.kernel_static("fwd", headdim, False, 1, None), dtype="bfloat16")


def warm() -> None:
    """Compile the kernels this script loads, for a 132-SM GPU (the persistent grid's default)."""
    from tilelang_ops.kernels import attention as K

    for _, _, _, D, _ in CASES:
        for name, cfg in _configs(D).items():
            K.flash_fwd_kernel.compile(cfg, "sm_90a", **_static(D))
            print(f"warm: D={D} {name} {cfg}", flush=True)


def contenders(B, H, Sq, Sk, D):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tilelang_ops import runtime
    from tilelang_ops.ops import attention as A

    dt, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    q = torch.randn(B, Sq, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(B, Sk, H, D, device=dev, dtype=dt) for _ in range(2))
    qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    arch = runtime.arch_for_device(dev)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qc, kc, vc)

    ref = cudnn().transpose(1, 2).float()
    fns = {}
    for name, cfg in _configs(D).items():
        launch = A.fwd_config_launcher(cfg, dev, arch, **_static(D))
        out, lse = torch.full_like(q, float("nan")), torch.empty(B, H, Sq, device=dev)
        first_run(lambda: launch(q, k, v, out, lse), f"{name} {B}x{H}x{Sq}x{Sk}x{D}")
        err = ((out.float() - ref).norm() / ref.norm()).item()  # NaN (an unwritten row) fails too
        if not err <= 1e-2:
            raise SystemExit(f"{name} disagrees with cuDNN at {B}x{H}x{Sq}x{Sk}x{D}: relative error {err}")
        fns[name] = lambda launch=launch, out=out, lse=lse: launch(q, k, v, out, lse)
    fns["cudnn"] = cudnn
    return fns


# --in-turns: (B, H, Sk, D, query lengths) whose lengths all take turns in one round robin, so a
# drift of the GPU's clock between cases cannot pass for a cost of the length (session 62: the same
# 21 tiles ran 5% apart in two cases, cuDNN flat), with the long default as it is (`t192`) and with
# FwdConfig.skip_dead (`t192skip`: the last tile's warpgroups whose rows are all past Sq issue no
# wgmma)
IN_TURNS = [(8, 32, 4096, 128, (4032, 4096, 4224)), (8, 32, 4096, 64, (4032, 4096))]
# (B, Sq, Sk, H, D): ragged shapes on which --in-turns first checks t192skip's output and LSE
# against a float32 reference (1, 17, 64 and 33 rows past whole 192-row tiles)
SKIP_CHECKS = [(2, 193, 1000, 4, 128), (1, 401, 300, 2, 128), (2, 448, 4097, 2, 64), (1, 1185, 17, 3, 64)]


def _in_turns_configs(headdim: int) -> dict:
    import dataclasses

    t192 = _configs(headdim)["t192"]
    return {"t192": t192, "t192skip": dataclasses.replace(t192, skip_dead=True)}


def warm_in_turns() -> None:
    from tilelang_ops.kernels import attention as K

    for D in sorted({c[3] for c in IN_TURNS}):
        for name, cfg in _in_turns_configs(D).items():
            K.flash_fwd_kernel.compile(cfg, "sm_90a", **_static(D))
            print(f"warm: D={D} {name} {cfg}", flush=True)


def check_skip() -> None:
    """t192skip on NaN-poisoned out and lse against a float32 reference: every row written, out
    within 1e-2 relative error, lse within 1e-2."""
    from tilelang_ops import runtime
    from tilelang_ops.ops import attention as A

    dev = torch.device("cuda", torch.cuda.current_device())
    for B, Sq, Sk, H, D in SKIP_CHECKS:
        q = torch.randn(B, Sq, H, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / D ** 0.5
        ref_lse = s.logsumexp(-1)
        ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())
        launch = A.fwd_config_launcher(_in_turns_configs(D)["t192skip"], dev, runtime.arch_for_device(dev), **_static(D))
        out, lse = torch.full_like(q, float("nan")), torch.full((B, H, Sq), float("nan"), device=dev)
        first_run(lambda: launch(q, k, v, out, lse), f"t192skip {B}x{Sq}x{Sk}x{H}x{D}")
        err = ((out.float() - ref).norm() / ref.norm()).item()
        lse_err = (lse - ref_lse).abs().max().item()
        if not (err <= 1e-2 and lse_err <= 1e-2):
            raise SystemExit(f"t192skip wrong at {B}x{Sq}x{Sk}x{H}x{D}: out relative error {err}, lse max error {lse_err}")
        print(f"check t192skip {B}x{Sq}x{Sk}x{H}x{D}: out {err:.2e}, lse {lse_err:.2e}", flush=True)


def in_turns_contenders(B, H, Sk, D, lengths):
    """The long default with and without skip_dead, and cuDNN, at each length, on the same keys;
    each output checked against cuDNN's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tilelang_ops import runtime
    from tilelang_ops.ops import attention as A

    dt, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    k, v = (torch.randn(B, Sk, H, D, device=dev, dtype=dt) for _ in range(2))
    kc, vc = (t.transpose(1, 2).contiguous() for t in (k, v))
    launches = {name: A.fwd_config_launcher(cfg, dev, runtime.arch_for_device(dev), **_static(D)) for name, cfg in _in_turns_configs(D).items()}
    fns = {}
    for Sq in lengths:
        q = torch.randn(B, Sq, H, D, device=dev, dtype=dt)
        qc = q.transpose(1, 2).contiguous()

        def cudnn(qc=qc):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qc, kc, vc)

        ref = cudnn().transpose(1, 2).float()
        for name, launch in launches.items():
            out, lse = torch.full_like(q, float("nan")), torch.empty(B, H, Sq, device=dev)
            first_run(lambda: launch(q, k, v, out, lse), f"{name}@{Sq} {B}x{H}x{Sk}x{D}")
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err <= 1e-2:
                raise SystemExit(f"{name}@{Sq} disagrees with cuDNN at {B}x{H}x{Sk}x{D}: relative error {err}")
            fns[f"{name}@{Sq}"] = lambda launch=launch, q=q, out=out, lse=lse: launch(q, k, v, out, lse)
        fns[f"cudnn@{Sq}"] = cudnn
    return fns


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", action="store_true", help="compile only (no GPU needed)")
    p.add_argument("--in-turns", action="store_true", help="IN_TURNS: the lengths of a shape in one round robin")
    args = p.parse_args(argv)
    if args.warm:
        warm_in_turns() if args.in_turns else warm()
        return 0
    rows = []
    if args.in_turns:
        with torch.no_grad():
            check_skip()
            for B, H, Sk, D, lengths in IN_TURNS:
                t = named_in_turns(in_turns_contenders(B, H, Sk, D, lengths), args.rounds)
                for name, (ms, rounds_ms) in t.items():
                    Sq = int(name.split("@")[1].split()[0])
                    rows.append(dict(shape=f"{B}x{H}x{Sk}x{D}", impl=name, tiles192=-(-Sq // 192), ms=ms, ms_per_tile=ms / -(-Sq // 192),
                                     tflops=4.0 * B * H * Sq * Sk * D / ms / 1e9, rounds_ms=rounds_ms))
                print(f"done {B}x{H}x{Sk}x{D} in turns", flush=True)
                write_json("diag_attn_tail_in_turns", rows)
        print(table(rows, ["shape", "impl", "tiles192", "ms", "ms_per_tile", "tflops"]))
        return 0
    with torch.no_grad():
        for B, H, Sk, D, lengths in CASES:
            for Sq in lengths:
                fns = contenders(B, H, Sq, Sk, D)
                flops = 4.0 * B * H * Sq * Sk * D
                t = named_in_turns(fns, args.rounds)
                for name, (ms, rounds_ms) in t.items():
                    rows.append(dict(shape=f"{B}x{H}x{Sq}x{Sk}x{D}", tiles192=-(-Sq // 192), impl=name, ms=ms, tflops=flops / ms / 1e9,
                                     vs_cudnn=t["cudnn"][0] / ms, rounds_ms=rounds_ms))
                print(f"done {B}x{H}x{Sq}x{Sk}x{D}", flush=True)
                write_json("diag_attn_tail", rows)
    print(table(rows, ["shape", "tiles192", "impl", "ms", "tflops", "vs_cudnn"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
