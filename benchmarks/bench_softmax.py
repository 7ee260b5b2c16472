"""Row softmax forward and backward vs the copy-bandwidth ceiling, eager torch and torch.compile.

    python -m benchmarks.bench_softmax              # the table (< 3 min on an H200)
    python -m benchmarks.bench_softmax --sweep      # also time every fitting SEARCH_SPACE config (slow)
    python -m benchmarks.bench_softmax --no-compiled  # skip the torch.compile baseline
    python -m benchmarks.bench_softmax --kind log_softmax  # log_softmax and its backward
    python -m benchmarks.bench_softmax --vocab      # language-model logits (tokens x vocabulary)

Bytes moved: forward reads x and writes y (2 * M*N*elt), backward reads dy and y and writes dx
(3 * M*N*elt). The ceiling is `out.copy_(x)` (read + write) on the same tensor size; "% copy" is
our TB/s over copy's TB/s. L2 (50 MB on H200) is flushed before every timed run, for every column.
"""
from __future__ import annotations

import argparse
import time

import torch

import tilelang_ops  # noqa: F401  (registers torch.ops.tileops.*)

from ._timing import bench, interleaved, table, write_json

EIGHT_M = 8 * 2**20
# (M, N): rows of each regime at >= 8M elements, then two large, DRAM-bound shapes.
SHAPES = [(EIGHT_M // n, n) for n in (128, 1024, 8192, 32768, 65536, 131072, 262144)] + [(32768, 8192), (4096, 32768)]
# --vocab: an LM's logits, tokens x vocabulary (Llama 2, GPT-2, Llama 3, Qwen 2): row lengths that
# are no power of two (50257 is odd: no 16-byte vectors), where no measured default applies.
VOCAB_SHAPES = [(8192, 32000), (8192, 50257), (4096, 128256), (2048, 151936)]


def _tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def _compiled(fn):
    torch._dynamo.reset()  # a fresh cache per shape: no automatic-dynamic recompiles, no cache-limit fallback
    return torch.compile(fn, dynamic=False, fullgraph=True)


# kind -> (ours, ours backward, torch, torch backward)
KINDS = {
    "softmax": (torch.ops.tileops.softmax, torch.ops.tileops.softmax_backward, torch.softmax,
                lambda dy, y: torch._softmax_backward_data(dy, y, -1, y.dtype)),
    "log_softmax": (torch.ops.tileops.log_softmax, torch.ops.tileops.log_softmax_backward, torch.log_softmax,
                    lambda dy, y: torch._log_softmax_backward_data(dy, y, -1, y.dtype)),
}


def run_shape(m: int, n: int, dtype: torch.dtype, with_compiled: bool, kind: str = "softmax") -> list[dict]:
    op, op_bwd, ref, ref_bwd = KINDS[kind]
    x = torch.randn(m, n, device="cuda", dtype=dtype) * 3
    elt = x.element_size() * m * n
    out = torch.empty_like(x)
    timer = lambda fn: bench(fn, flush_l2=True)  # noqa: E731
    rows = []

    # forward (copy, ours, eager and compiled take turns: see _timing.interleaved)
    fns = [lambda: out.copy_(x), lambda: op(x, -1), lambda: ref(x, -1)]
    if with_compiled:
        f = _compiled(lambda t: ref(t, -1))
        fns.append(lambda: f(x))
    copy_ms, ours, eager, *comp = interleaved(timer, fns)
    copy_bw = _tbps(2 * elt, copy_ms)
    rows.append(_row(m, n, "fwd", 2 * elt, copy_bw, ours, eager, comp[0] if comp else None))

    # backward
    y = ref(x, -1)
    dy = torch.randn_like(x)
    del out
    fns = [lambda: op_bwd(dy, y, -1), lambda: ref_bwd(dy, y)]
    if with_compiled:
        g = _compiled(ref_bwd)
        fns.append(lambda: g(dy, y))
    ours, eager, *comp = interleaved(timer, fns)
    comp = comp[0] if comp else None
    rows.append(_row(m, n, "bwd", 3 * elt, copy_bw, ours, eager, comp))
    return rows


def _row(m, n, direction, nbytes, copy_bw, ours, eager, comp) -> dict:
    bw = _tbps(nbytes, ours)
    return {
        "shape": f"{m}x{n}",
        "dir": direction,
        "copy TB/s": copy_bw,
        "ours TB/s": bw,
        "% copy": 100 * bw / copy_bw,
        "ours ms": ours,
        "torch TB/s": _tbps(nbytes, eager),
        "compiled TB/s": _tbps(nbytes, comp) if comp is not None else None,
        "x torch": eager / ours,
        "x compiled": comp / ours if comp is not None else None,
    }


def sweep_shape(m: int, n: int, dtype: torch.dtype) -> list[dict]:
    """Every fitting SEARCH_SPACE config (what `tileops tune` would try), forward and backward."""
    from tilelang_ops import runtime
    from tilelang_ops.ops.softmax import TUNABLES

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for op, streams in (("softmax", 2), ("softmax_backward", 3)):
        t = TUNABLES[op]
        default = t.default((m, n), dtype)
        for cfg in t.search_space((m, n), dtype):
            try:
                ms = bench(t.runner(cfg, (m, n), dtype, dev), flush_l2=True)
            except Exception as e:  # a config the compiler rejects for this n: report, keep sweeping
                print(f"  {m}x{n} {op} {runtime.config_str(cfg)}: {type(e).__name__}: {e}")
                continue
            rows.append({"shape": f"{m}x{n}", "op": op, "config": runtime.config_str(cfg) + (" *" if cfg == default else ""),
                         "TB/s": _tbps(streams * m * n * torch.finfo(dtype).bits // 8, ms), "ms": ms})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time every SEARCH_SPACE config (slow: compiles each)")
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kind", default="softmax", choices=sorted(KINDS))
    p.add_argument("--vocab", action="store_true", help="language-model logits shapes (VOCAB_SHAPES) instead of SHAPES")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    rows = []
    shapes = VOCAB_SHAPES if args.vocab else SHAPES
    for m, n in shapes:
        rows += run_shape(m, n, dtype, not args.no_compiled, args.kind)
        print(f"  {m}x{n} done ({time.time() - t0:.0f} s)", flush=True)
    extra = {"dtype": args.dtype, "kind": args.kind, "shapes": "vocab" if args.vocab else "default"}
    if args.sweep:
        sweep = [r for m, n in shapes for r in sweep_shape(m, n, dtype)]
        print(table(sweep, ["shape", "op", "config", "TB/s", "ms"]))  # * = the default config
        extra["sweep"] = sweep
    path = write_json(("softmax" if args.kind == "softmax" else args.kind) + ("_vocab" if args.vocab else ""), rows, extra)
    print(f"wrote {path}; {time.time() - t0:.0f} s total")
    print(f"{args.kind} {args.dtype}, L2 flushed before each run; % copy = ours TB/s / out.copy_(x) TB/s")
    print(table(rows, ["shape", "dir", "copy TB/s", "ours TB/s", "% copy", "torch TB/s", "compiled TB/s", "x torch", "x compiled"]))


if __name__ == "__main__":
    main()
