"""The attention forward with and without its LSE output, side by side with cuDNN, in one process.

    python -m benchmarks.diag_attn_lse [--rounds N]

Why: `bench_attention` times `flash_attn` under `torch.no_grad()`, which from the fifth to the
fifty-fourth session ran the kernel variant with no LSE output (`lse=False`), while
`sweep_attention` times the LSE one (the training forward). The two are the same CUDA less the
LSE store, but ptxas schedules them apart (1472 against 1432 SASS instructions at the 192 x 128
D=128 default, registers and spills equal), and the non-causal 4096-token D=128 row read 580-622
TFLOP/s in the benches and 605-640 in the sweeps. Since the fifty-fifth session `flash_attn` runs
the LSE kernel into a scratch LSE. Contenders per shape, in turns
(`_timing.interleaved`; each entry's per-round times are kept):

- `op flash_attn`: `torch.ops.tileops.flash_attn` under no_grad (what bench_attention times);
- `op with_lse`: `torch.ops.tileops.flash_attn_with_lse`;
- `kernel lse` / `kernel nolse`: the default config's launchers into preallocated buffers;
- `cudnn bhsd`: SDPA's cuDNN backend on contiguous (B, H, S, D) tensors (bench_attention's peer);
- `cudnn view`: the same on our (B, S, H, D) tensors viewed as (B, H, S, D) (sweep_attention's).

Writes $OUT/diag_attn_lse.json and prints a table last.
"""
from __future__ import annotations

import argparse

import torch

from ._timing import first_run, named_in_turns, table, write_json

CASES = [  # (B, H, HK, S, D, causal)
    (8, 32, 32, 4096, 128, False),
    (8, 32, 8, 4096, 128, False),
    (2, 16, 16, 16384, 128, False),
    (16, 32, 32, 2048, 64, False),
    (8, 32, 32, 4096, 128, True),
]


def contenders(B, H, HK, S, D, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tilelang_ops import runtime
    from tilelang_ops.kernels import attention as K
    from tilelang_ops.ops import attention as A

    dt, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    q = torch.randn(B, S, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(B, S, HK, D, device=dev, dtype=dt) for _ in range(2))
    qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    arch = runtime.arch_for_device(dev)
    cfg = K.fwd_default_config(D, causal, arch, S)
    static = dict(A.kernel_static("fwd", D, causal, H // HK, None), dtype="bfloat16")  # as the op builds it
    with_lse = A.fwd_config_launcher(cfg, dev, arch, **static)
    no_lse = A.fwd_config_launcher(cfg, dev, arch, **static, lse=False)
    out, lse = torch.empty_like(q), torch.empty(B, H, S, device=dev)
    gqa = {"enable_gqa": True} if H != HK else {}

    def cudnn(a, b, c):
        def f():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal, **gqa)

        return f

    fns = {
        "op flash_attn": lambda: torch.ops.tileops.flash_attn(q, k, v, causal),
        "op with_lse": lambda: torch.ops.tileops.flash_attn_with_lse(q, k, v, causal),
        "kernel lse": lambda: with_lse(q, k, v, out, lse),
        "kernel nolse": lambda: no_lse(q, k, v, out),
        "cudnn bhsd": cudnn(qc, kc, vc),
        "cudnn view": cudnn(*(t.transpose(1, 2) for t in (q, k, v))),
    }
    # the four of ours must agree bitwise (same kernel, same inputs)
    ref = torch.ops.tileops.flash_attn(q, k, v, causal)
    for name in ("op with_lse", "kernel lse", "kernel nolse"):
        out.fill_(float("nan"))
        first_run(fns[name], f"{B}x{H}/{HK}x{S}x{D} causal={causal} {name}")
        got = fns[name]()
        got = out if got is None else (got[0] if isinstance(got, tuple) else got)
        if not torch.equal(got, ref):
            raise SystemExit(f"{name} differs from flash_attn at {B}x{H}/{HK}x{S}x{D} causal={causal}")
    return cfg, fns


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    with torch.no_grad():
        for B, H, HK, S, D, causal in CASES:
            cfg, fns = contenders(B, H, HK, S, D, causal)
            flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
            timed = named_in_turns(fns, args.rounds)
            for name, (t, rounds_ms) in timed.items():
                rows.append(dict(shape=f"{B}x{H}/{HK}x{S}x{D}", causal=causal, impl=name, ms=t, tflops=flops / t / 1e9,
                                 vs_kernel_lse=timed["kernel lse"][0] / t, config=str(cfg) if "op" in name or "kernel" in name else "",
                                 rounds_ms=rounds_ms))
            print(f"done {B}x{H}/{HK}x{S}x{D} causal={causal}", flush=True)
            write_json("diag_attn_lse", rows)
    print(table(rows, ["shape", "causal", "impl", "ms", "tflops", "vs_kernel_lse"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
