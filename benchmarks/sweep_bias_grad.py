"""The bias gradient (`torch.ops.tileops.bias_grad`, a column sum of an (M, N) bf16 tensor): our
kernel's candidate configs next to PyTorch's `dy.sum(0)` and Inductor's reduction, in GB/s read.

    export TILELANG_CACHE_DIR=$PWD/.tl-cache
    python -m benchmarks.sweep_bias_grad --warm    # CPU machine: compile every candidate (sm_90a)
    python -m benchmarks.sweep_bias_grad           # H200: time them

GPU time from CUDA-graph replays (benchmarks/_timing.graph_ms; the host's launch path taken out),
contenders taking turns (`interleaved`). Every input is larger than the H200's 50 MB L2 except the
smallest, so each replay reads from HBM. Each candidate's output is checked against a float64 sum
first (a wrong config is reported and never chosen). Prints a table and the best config per shape;
JSON to $OUT/sweep_bias_grad.json.
"""
from __future__ import annotations

import argparse

# (M, N): examples/train_gpt.py at 32 x 1024 tokens (QKV 2304, out-projection and MLP
# down-projection 768), and the Linear shapes at 8192 / 16384 tokens.
SHAPES = [(32768, 2304), (32768, 768), (16384, 4096), (8192, 14336)]


def candidates():
    from tilelang_ops.kernels.gemm import BiasGradConfig as B

    return [B(), B(64, 256, 4), B(64, 256, 16), B(128, 256, 4), B(32, 256, 16), B(64, 128, 8), B(32, 512, 8)]


def _compile(cfg, n, arch="sm_90a"):
    from tilelang_ops.kernels import gemm as K

    return K.bias_grad_kernel.compile(cfg, arch, n=n, dtype="bfloat16")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", action="store_true", help="compile every candidate for sm_90a and exit (no GPU needed)")
    a = p.parse_args(argv)
    if a.warm:
        jobs = [(cfg, n) for _, n in SHAPES for cfg in candidates()]
        for cfg, n in jobs:
            _compile(cfg, n)
        print(f"{len(jobs)} bias_grad kernels warm")
        return

    import torch

    from benchmarks._timing import graph_ms, interleaved, table, write_json
    from tilelang_ops import runtime

    inductor_sum = torch.compile(lambda dy: dy.sum(0), fullgraph=True)
    rows = []
    for m, n in SHAPES:
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) + 0.5
        want = dy.double().sum(0)
        fns, names = [], []
        for cfg in candidates():
            kern = runtime.launcher(_compile(cfg, n))
            rows_per = cfg.block_M * cfg.steps
            partial = torch.empty(-(-m // rows_per), n, device="cuda")
            db = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            call = lambda kern=kern, partial=partial, db=db: kern(dy, partial, db)  # noqa: E731
            call()
            err = ((db.double() - want).norm() / want.norm()).item()
            if not err < 1e-2:
                print(f"{m}x{n} {cfg}: WRONG (rel err {err:.2e}), skipped")
                continue
            fns.append(call)
            names.append(f"ours {cfg.block_M}x{cfg.block_N}x{cfg.steps}")
        fns += [lambda: torch.ops.tileops.bias_grad(dy), lambda: dy.sum(0), lambda: dy.sum(0, dtype=torch.float32), lambda: inductor_sum(dy)]
        names += ["op (default)", "torch dy.sum(0)", "torch sum fp32", "inductor sum"]
        times = interleaved(lambda fn: graph_ms(fn, n=10, rep=10), fns)
        gb = m * n * 2 / 1e9
        torch_ms = times[names.index("torch dy.sum(0)")]
        for name, ms in zip(names, times):
            rows.append(dict(shape=f"{m}x{n}", contender=name, us=ms * 1e3, gbps=gb / ms * 1e3, x_torch=torch_ms / ms))
        ours = [r for r in rows if r["shape"] == f"{m}x{n}" and r["contender"].startswith("ours")]
        best = max(ours, key=lambda r: r["gbps"]) if ours else None
        if best:
            print(f"{m}x{n}: best {best['contender']} {best['gbps']:.0f} GB/s, x torch {best['x_torch']:.2f}", flush=True)
        del dy
        torch.cuda.empty_cache()
    write_json("sweep_bias_grad", rows)
    print(table(rows, ["shape", "contender", "us", "gbps", "x_torch"]))


if __name__ == "__main__":
    main()
