"""LayerNorm forward and backward vs the copy-bandwidth ceiling, eager torch and torch.compile.

    python -m benchmarks.bench_norm            # the table (~1 min on an H200)
    python -m benchmarks.bench_norm --sweep    # also time the fitting search-space configs
    python -m benchmarks.bench_norm --add-only # only add_layer_norm (the residual add fused in)

Cases (M rows of n, x dtype -> output dtype): the training example's fp32 residual stream into
bf16 under autocast (eager PyTorch: `layer_norm` in fp32, then the cast kernel; its backward casts
dy back to fp32 first), and 16-bit models' rows. Bytes moved: forward reads x, writes y (+ 8 bytes
per row of statistics); backward reads dy and x, writes dx. The ceiling is `out.copy_(x)` on the
forward's read size; "% copy" is our TB/s over copy's. L2 is flushed before every timed run.
Peers in the same run, taking turns: eager PyTorch and `torch.compile` of the same math (inductor
fuses the normalization and the cast). "fwd+bwd" is a training step's share, forward and
backward through autograd (`.backward(dy)`), the same harness for ours, eager and compiled (whose
backward inductor also generates).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import tilelang_ops  # noqa: F401  (registers torch.ops.tileops.*)

from ._timing import bench, interleaved, table, write_json

BF, F32 = torch.bfloat16, torch.float32
# (M, n, x dtype, output dtype)
CASES = [
    (16384, 768, F32, BF),  # GPT-2 small, batch 16 x 1024, fp32 residual stream under bf16 autocast
    (16384, 768, BF, BF),
    (16384, 4096, BF, BF),  # Llama-7B width
    (8192, 8192, BF, BF),
    (65536, 1024, F32, F32),
]


def _tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def _eager_fwd(x, w, b, od):
    y = F.layer_norm(x, x.shape[-1:], w, b)
    return y if y.dtype == od else y.to(od)


def _eager_bwd(dy, x, w, b, mean, rstd):
    # what autograd runs for layer_norm(+ cast): dy back to x's dtype, then aten's backward
    return torch.ops.aten.native_layer_norm_backward(dy.to(x.dtype), x, x.shape[-1:], mean, rstd, w, b, [True, True, True])


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, fullgraph=True)


def run_case(m: int, n: int, dt: torch.dtype, od: torch.dtype, with_compiled: bool) -> list[dict]:
    x = torch.randn(m, n, device="cuda", dtype=dt) * 2 + 0.5
    w = torch.randn(n, device="cuda", dtype=dt)
    b = torch.randn(n, device="cuda", dtype=dt)
    dy = torch.randn(m, n, device="cuda", dtype=od)
    es, eo = x.element_size(), torch.finfo(od).bits // 8
    fwd_bytes = m * n * (es + eo) + 8 * m
    bwd_bytes = m * n * (eo + 2 * es) + 8 * m
    out = torch.empty_like(x)
    timer = lambda fn: bench(fn, flush_l2=True)  # noqa: E731
    label = f"{m}x{n} {str(dt)[6:]}->{str(od)[6:]}"

    fns = [lambda: out.copy_(x), lambda: torch.ops.tileops.layer_norm(x, w, b, 1e-5, od), lambda: _eager_fwd(x, w, b, od)]
    if with_compiled:
        cf = _compiled(lambda x, w, b: _eager_fwd(x, w, b, od))
        fns.append(lambda: cf(x, w, b))
    copy_ms, ours, eager, *comp = interleaved(timer, fns)
    copy_bw = _tbps(2 * m * n * es, copy_ms)
    rows = [_row(label, "fwd", fwd_bytes, copy_bw, ours, eager, comp[0] if comp else None)]

    _, mean, rstd = torch.ops.tileops.layer_norm(x, w, b, 1e-5, od)
    _, tmean, trstd = torch.native_layer_norm(x, (n,), w, b, 1e-5)  # aten's own statistics, its shapes
    fns = [lambda: torch.ops.tileops.layer_norm_backward(dy, x, w, mean, rstd), lambda: _eager_bwd(dy, x, w, b, tmean, trstd)]
    ours, eager = interleaved(timer, fns)
    rows.append(_row(label, "bwd", bwd_bytes, copy_bw, ours, eager, None))

    # a training step's share: forward + backward through autograd, the same harness for all three
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))

    def step(f):
        def run():
            xs.grad = ws.grad = bs.grad = None
            f(xs, ws, bs).backward(dy)

        return run

    fns = [step(lambda x, w, b: torch.ops.tileops.layer_norm(x, w, b, 1e-5, od)[0]), step(lambda x, w, b: _eager_fwd(x, w, b, od))]
    if with_compiled:
        fns.append(step(_compiled(lambda x, w, b: _eager_fwd(x, w, b, od))))
    ours, eager, *comp = interleaved(timer, fns)
    rows.append(_row(label, "fwd+bwd", fwd_bytes + bwd_bytes, copy_bw, ours, eager, comp[0] if comp else None))
    return rows


# add_layer_norm: (M, n, stream dtype, branch dtype, output dtype)
ADD_CASES = [(16384, 768, F32, BF, BF), (16384, 4096, BF, BF, BF)]


def _eager_add_fwd(x, r, w, b, od):
    h = x + r
    return h, _eager_fwd(h, w, b, od)


def run_add_case(m: int, n: int, dt: torch.dtype, rt: torch.dtype, od: torch.dtype, with_compiled: bool) -> list[dict]:
    """add_layer_norm against `h = x + r; layer_norm(h)` eager and compiled: forward, and forward +
    backward through autograd with gradients into both h (the stream's later use) and y."""
    x = torch.randn(m, n, device="cuda", dtype=dt) * 2 + 0.5
    r = torch.randn(m, n, device="cuda", dtype=rt)
    w, b = torch.randn(n, device="cuda", dtype=dt), torch.randn(n, device="cuda", dtype=dt)
    dy, dh = torch.randn(m, n, device="cuda", dtype=od), torch.randn(m, n, device="cuda", dtype=dt)
    es, rs, eo = x.element_size(), r.element_size(), torch.finfo(od).bits // 8
    fwd_bytes = m * n * (2 * es + rs + eo) + 8 * m  # x, r in; h, y out
    bwd_bytes = m * n * (eo + 3 * es + rs) + 8 * m  # dy, dh, h in; dx, dr out
    out = torch.empty_like(x)
    timer = lambda fn: bench(fn, flush_l2=True)  # noqa: E731
    label = f"add {m}x{n} {str(dt)[6:]}+{str(rt)[6:]}->{str(od)[6:]}"
    fns = [lambda: out.copy_(x), lambda: torch.ops.tileops.add_layer_norm(x, r, w, b, 1e-5, od), lambda: _eager_add_fwd(x, r, w, b, od)]
    if with_compiled:
        cf = _compiled(lambda x, r, w, b: _eager_add_fwd(x, r, w, b, od))
        fns.append(lambda: cf(x, r, w, b))
    copy_ms, ours, eager, *comp = interleaved(timer, fns)
    copy_bw = _tbps(2 * m * n * es, copy_ms)
    rows = [_row(label, "fwd", fwd_bytes, copy_bw, ours, eager, comp[0] if comp else None)]
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]

    def step(f):
        def run():
            for t in leaves:
                t.grad = None
            torch.autograd.backward(f(*leaves), (dh, dy))

        return run

    fns = [step(lambda x, r, w, b: torch.ops.tileops.add_layer_norm(x, r, w, b, 1e-5, od)[:2]), step(lambda x, r, w, b: _eager_add_fwd(x, r, w, b, od))]
    if with_compiled:
        fns.append(step(_compiled(lambda x, r, w, b: _eager_add_fwd(x, r, w, b, od))))
    ours, eager, *comp = interleaved(timer, fns)
    rows.append(_row(label, "fwd+bwd", fwd_bytes + bwd_bytes, copy_bw, ours, eager, comp[0] if comp else None))
    return rows


def _row(label, direction, nbytes, copy_bw, ours, eager, comp) -> dict:
    bw = _tbps(nbytes, ours)
    return {
        "case": label, "dir": direction, "copy TB/s": copy_bw, "ours TB/s": bw, "% copy": 100 * bw / copy_bw,
        "ours ms": ours, "torch TB/s": _tbps(nbytes, eager), "compiled TB/s": _tbps(nbytes, comp) if comp else None,
        "x torch": eager / ours, "x compiled": comp / ours if comp else None,
    }


def sweep_case(m: int, n: int, dt: torch.dtype, od: torch.dtype) -> list[dict]:
    """Every fitting search-space config, forward (ctas_per_sm does not apply) and backward."""
    from tilelang_ops import runtime
    from tilelang_ops.kernels import norm as K
    from tilelang_ops.ops import norm as N
    from tilelang_ops.ops._checks import TL_DTYPE

    arch, dev = runtime.arch_for_device(0), torch.device("cuda", 0)
    x = torch.randn(m, n, device="cuda", dtype=dt)
    w = torch.randn(n, device="cuda", dtype=dt)
    y = torch.empty(m, n, device="cuda", dtype=od)
    dx, dy = torch.empty_like(x), torch.randn_like(y)
    mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
    rows = []
    for direction, cfg in sweep_jobs(n, TL_DTYPE[dt]):
        name = runtime.config_str(cfg) + (" *" if cfg == K.default_config(n, TL_DTYPE[dt], direction == "bwd") else "")
        if direction == "fwd":
            f = runtime.launcher(N.compile_kernel("fwd", n, arch, cfg, dtype=dt, wdtype=dt, odtype=od, eps=1e-5))
            ms = bench(lambda: f(x, w, w, y, mean, rstd), flush_l2=True)
            rows.append({"case": f"{m}x{n}", "dir": "fwd", "config": name, "TB/s": _tbps(m * n * (x.element_size() + y.element_size()), ms)})
            continue
        g = runtime.launcher(N.compile_kernel("bwd", n, arch, cfg, dtype=dt, wdtype=dt, dydtype=od))
        grid = N.bwd_grid(m, runtime.sm_count(dev) * cfg.ctas_per_sm, cfg.block_m)
        parts, dw, db = torch.empty(2, grid, n, device="cuda"), torch.empty_like(w), torch.empty_like(w)
        ms = bench(lambda: g(dy, x, w, mean, rstd, dx, parts, dw, db), flush_l2=True)
        rows.append({"case": f"{m}x{n}", "dir": "bwd", "config": name, "TB/s": _tbps(m * n * (2 * x.element_size() + dy.element_size()), ms)})
    return rows


def sweep_jobs(n: int, dtype: str) -> list[tuple]:
    """(direction, config) that --sweep times (the cache-warming script compiles the same list):
    the fitting search-space configs; the forward ignores ctas_per_sm, so it takes one value."""
    from tilelang_ops.kernels import norm as K

    cfgs = [c for c in K.search_space(n, dtype) if c.ctas_per_sm in (2, 4)]
    return [("bwd", c) for c in cfgs] + [("fwd", c) for c in cfgs if c.ctas_per_sm == K.NormConfig.ctas_per_sm]


SWEEP_CASES = [(16384, 768, F32, BF), (16384, 4096, BF, BF)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time the search-space configs of SWEEP_CASES")
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--add-only", action="store_true", help="only add_layer_norm's cases")
    args = p.parse_args(argv)
    t0 = time.time()
    rows = []
    for case in [] if args.add_only else CASES:
        rows += run_case(*case, not args.no_compiled)
        print(f"  {case[:2]} done ({time.time() - t0:.0f} s)", flush=True)
    for case in ADD_CASES:
        rows += run_add_case(*case, not args.no_compiled)
        print(f"  add {case[:2]} done ({time.time() - t0:.0f} s)", flush=True)
    extra = {}
    if args.sweep:
        sweep = [r for case in SWEEP_CASES for r in sweep_case(*case)]
        extra["sweep"] = sweep
        print(table(sweep, ["case", "dir", "config", "TB/s"]))
    print("JSON:", write_json("bench_norm", rows, extra))
    print(table(rows, ["case", "dir", "copy TB/s", "ours TB/s", "% copy", "torch TB/s", "compiled TB/s", "x torch", "x compiled"]))


if __name__ == "__main__":
    main()
