"""What the ragged last query tile costs the non-causal forward, side by side with cuDNN.

    python -m benchmarks.diag_attn_tail [--rounds N]     # on the GPU
    python -m benchmarks.diag_attn_tail --warm           # here: compile what it loads (sm_90a)

Why: the long non-causal defaults tile the queries in 192 rows (three consumer warpgroups), and
the #6 shapes' lengths are powers of two: 4096 rows are 21 tiles and 64 rows (D=128), 2048 are 10
and 128 (D=64). If a tile's time does not shrink with its valid rows, the last one costs a full
tile: 22/21 (+4.8%) of the work at 4096 (D=128, the row furthest below its 1.05x target), where
a 128-row tile wastes none. Timing the kernel over query lengths that are whole tiles
(Sq = 20, 21, 22 x 192) beside the power of two, keys fixed, tells the tail's price; the 128 x 128
persistent kernel (the short-row default) at the same lengths tells whether a tile that divides
the length could be the better default there. D=64 (whose op runs the 128-row tile up to 2048
rows) the same, around 2048.

Per case, contenders in turns (`_timing.named_in_turns`), each a config's launcher into
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", action="store_true", help="compile only (no GPU needed)")
    args = p.parse_args(argv)
    if args.warm:
        warm()
        return 0
    rows = []
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
