"""FlashAttention forward and backward: tileops vs SDPA (cuDNN, FlashAttention-2) and FlexAttention.

    python -m benchmarks.bench_attention [--quick] [--no-flex | --flex-budget S] [--no-deterministic] [--case BxH/HKxSxD ...]

TFLOP/s with forward FLOPs = 4 * B * H * Sq * Sk * D (two GEMMs), halved when causal, and backward
FLOPs = 2.5x forward (five GEMMs instead of two). The backward is timed alone: one forward with
autograd, then `torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` per run, which is
the backward kernels (plus a few small elementwise ops) for every implementation. Peers read
(B, H, S, D) tensors, tileops (B, S, H, D): each gets its own layout, no transposes are timed.
`tileops_det` is tileops with the backward under `torch.use_deterministic_algorithms(True)`
(bitwise reproducible: dK/dV kernel + a separate dQ kernel instead of fp32 atomics), timed beside
the default; "bwd det cost" = deterministic backward time / default backward time; its forward
is the default's kernel, so "fwd A/A" (tileops forward time / tileops_det's) is the run's own
noise: ratios to the peers that differ from 1 by less than it are not a difference. It runs with
PyTorch's defaults for that flag, so it includes the NaN fill of the op's fresh buffers
(`torch.utils.deterministic.fill_uninitialized_memory`), as a user's run would.
Writes $OUT/bench_attention.json (or bench_results/) and prints a table last.
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from ._timing import bench, interleaved, table, write_json

# (B, H, HK, S, D): S = seqlen_q = seqlen_k
CASES = [
    (8, 32, 32, 4096, 128),
    (2, 16, 16, 16384, 128),
    (16, 32, 32, 2048, 64),
    (8, 32, 8, 4096, 128),  # GQA: 32 query heads, 8 kv heads
]
QUICK = [(8, 32, 32, 4096, 128), (8, 32, 8, 4096, 128)]
FLEX_BUDGET_S = 100  # start no FlexAttention compile past this wall time (the run must stay < 4 min)
# (session 56, H100: six cases with FlexAttention in 115 s; the two GQA ones were past it)
DETERMINISTIC = {"tileops_det"}  # impls whose backward runs under torch.use_deterministic_algorithms(True)


def _flops(B, H, S, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def _deterministic(fn):
    """fn run under torch.use_deterministic_algorithms(True), the previous setting restored."""

    def run():
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(prev)

    return run


def _impls(B, H, HK, S, D, causal, flex: bool, det: bool = True):
    """name -> (make inputs, forward fn). Inputs: (q, k, v) that require grad."""
    import tilelang_ops  # noqa: F401
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = torch.bfloat16

    def bhsd():
        q = torch.randn(B, H, S, D, device="cuda", dtype=dt, requires_grad=True)
        k = torch.randn(B, HK, S, D, device="cuda", dtype=dt, requires_grad=True)
        v = torch.randn(B, HK, S, D, device="cuda", dtype=dt, requires_grad=True)
        return q, k, v

    def bshd():
        q = torch.randn(B, S, H, D, device="cuda", dtype=dt, requires_grad=True)
        k = torch.randn(B, S, HK, D, device="cuda", dtype=dt, requires_grad=True)
        v = torch.randn(B, S, HK, D, device="cuda", dtype=dt, requires_grad=True)
        return q, k, v

    gqa = {"enable_gqa": True} if HK != H else {}

    def sdpa(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        return f

    impls = {
        "tileops": (bshd, lambda q, k, v: torch.ops.tileops.flash_attn(q, k, v, causal)),
        **({"tileops_det": (bshd, lambda q, k, v: torch.ops.tileops.flash_attn(q, k, v, causal))} if det else {}),
        "sdpa_cudnn": (bhsd, sdpa(SDPBackend.CUDNN_ATTENTION)),
        "sdpa_flash": (bhsd, sdpa(SDPBackend.FLASH_ATTENTION)),
    }
    if flex:
        import torch._dynamo as dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # one compile per case and grad mode: past the default limit (8) dynamo silently runs eager
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 64)
        import torch._functorch.config as functorch_config

        # the benchmark runs backward repeatedly on one graph: donated buffers forbid that
        functorch_config.donated_buffer = False
        compiled = torch.compile(flex_attention)
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, S, S, device="cuda")
        impls["flex_compiled"] = (bhsd, lambda q, k, v: compiled(q, k, v, block_mask=mask, **gqa))
    return impls


def run(cases, flex: bool = True, det: bool = True, flex_budget: float = FLEX_BUDGET_S) -> list[dict]:
    rows = []
    t_start = time.time()
    for B, H, HK, S, D in cases:
        for causal in (False, True):
            use_flex = flex and time.time() - t_start < flex_budget
            fl = _flops(B, H, S, D, causal)
            shape = f"{B}x{H}/{HK}x{S}x{D}"
            # Every implementation's inputs first, then the timings with the implementations
            # taking turns (see _timing.interleaved): timed one after the other, the first one
            # ran on a cooler, faster-clocked GPU.
            live, case_rows = {}, []
            for name, (make, fwd) in _impls(B, H, HK, S, D, causal, use_flex, det).items():
                row = {"impl": name, "shape (BxH/HKxSxD)": shape, "causal": causal}
                case_rows.append(row)
                try:
                    q, k, v = make()
                    out = fwd(q, k, v)
                    dout = torch.randn_like(out)
                    live[name] = (q, k, v, fwd, out, dout)
                except Exception as e:  # a peer without support for a case (e.g. GQA) reports n/a
                    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
            names = list(live)

            def fwd_fn(name):
                q, k, v, fwd, _, _ = live[name]
                return lambda: fwd(q, k, v)

            def bwd_fn(name):
                q, k, v, _, out, dout = live[name]
                bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                return _deterministic(bwd) if name in DETERMINISTIC else bwd

            with torch.no_grad():
                ms_f = interleaved(lambda fn: bench(fn, warmup=5, rep=30), [fwd_fn(n) for n in names])
            ms_b = interleaved(lambda fn: bench(fn, warmup=3, rep=20), [bwd_fn(n) for n in names])
            for row in case_rows:
                if row["impl"] in live:
                    f_ms, b_ms = ms_f[names.index(row["impl"])], ms_b[names.index(row["impl"])]
                    row.update(fwd_ms=f_ms, fwd_tflops=fl / f_ms * 1e-9, bwd_ms=b_ms, bwd_tflops=2.5 * fl / b_ms * 1e-9)
                rows.append(row)
                print(row, flush=True)
            del live
            torch.cuda.empty_cache()
    return rows


def _summary(rows):
    """tileops / best peer, per case and direction."""
    out = []
    keys = sorted({(r["shape (BxH/HKxSxD)"], r["causal"]) for r in rows}, key=str)
    for shape, causal in keys:
        case = [r for r in rows if r["shape (BxH/HKxSxD)"] == shape and r["causal"] == causal and "error" not in r]
        ours = next((r for r in case if r["impl"] == "tileops"), None)
        line = {"shape (BxH/HKxSxD)": shape, "causal": causal}
        for d in ("fwd", "bwd"):
            for r in case:
                line[f"{d} {r['impl']}"] = r[f"{d}_tflops"]
            cudnn = next((r for r in case if r["impl"] == "sdpa_cudnn"), None)
            if ours and cudnn:
                line[f"{d} vs cudnn"] = ours[f"{d}_tflops"] / cudnn[f"{d}_tflops"]
        det = next((r for r in case if r["impl"] == "tileops_det"), None)
        if ours and det:  # the deterministic backward's cost: its time over the default's
            line["bwd det cost"] = det["bwd_ms"] / ours["bwd_ms"]
            # tileops_det's forward is the same kernel as tileops': their ratio is the run's noise
            line["fwd A/A"] = ours["fwd_ms"] / det["fwd_ms"]
        out.append(line)
    return out


def _parse_case(text: str) -> tuple:
    """'8x32/8x4096x128' -> (8, 32, 8, 4096, 128)."""
    m = re.fullmatch(r"(\d+)x(\d+)/(\d+)x(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--case wants BxH/HKxSxD, e.g. 8x32/8x4096x128; got {text!r}")
    return tuple(int(g) for g in m.groups())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="two cases only")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take ~10-30 s per case)")
    p.add_argument("--flex-budget", type=float, default=FLEX_BUDGET_S, help=f"seconds after which no case starts a FlexAttention compile (default {FLEX_BUDGET_S}; a large value times it in every case)")
    p.add_argument("--no-deterministic", action="store_true", help="skip tileops_det (the deterministic backward)")
    p.add_argument("--case", action="append", type=_parse_case, help="B x H/HK x S x D, e.g. 1x33/33x16384x128 (repeatable; replaces the default set)")
    args = p.parse_args(argv)
    t0 = time.time()
    rows = run(args.case or (QUICK if args.quick else CASES), flex=not args.no_flex, det=not args.no_deterministic, flex_budget=args.flex_budget)
    summary = _summary(rows)
    path = write_json("bench_attention", rows, {"summary": summary, "wall_s": time.time() - t0})
    impls = ["tileops", "sdpa_cudnn", "sdpa_flash", "flex_compiled"]
    cols = ["shape (BxH/HKxSxD)", "causal"]
    cols += [f"fwd {i}" for i in impls] + ["fwd vs cudnn"] + [f"bwd {i}" for i in ["tileops", "tileops_det", *impls[1:]]]
    cols += ["bwd vs cudnn", "bwd det cost"]
    cols = [c for c in cols if any(c in r for r in summary)]
    print(f"\nwrote {path} ({time.time() - t0:.0f} s). TFLOP/s, bf16, {torch.cuda.get_device_name()}:")
    print(table(summary, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
