"""Focused softmax schedule sweep at the shapes that miss their targets (bf16, softmax kind).

    export TILELANG_CACHE_DIR=$PWD/.tl-cache
    python -m benchmarks.sweep_softmax --warm     # CPU machine: compile every candidate (sm_90a)
    python -m benchmarks.sweep_softmax            # H200: time them (< 1 min once the cache is warm)

For each shape and direction it times every candidate config (CUDA events, median of 30 runs,
L2 flushed before each, every kernel warmed first) next to `out.copy_(x)` at the same size,
checks the output against torch (softmax: max |err| within the bf16 tolerances; backward:
relative Frobenius error < 3e-2; a wrong config is reported and never chosen), and for split
configs also times the stats and apply kernels alone. It prints a table, the best config per
shape, and the `MEASURED` entries to paste into tilelang_ops/kernels/softmax.py; JSON goes to
$OUT/sweep_softmax.json (benchmarks/_timing.write_json).

Configs: SoftmaxConfig(schedule, block_m, threads, chunk, min_blocks). `rowsh` = a row in
registers held in the input dtype; `csplit` = split in one launch, a thread-block cluster per
row; min_blocks = __launch_bounds__ min CTAs per SM (register cap); see kernels/softmax.py.
"""
from __future__ import annotations

import argparse
import time

C = None  # SoftmaxConfig, bound lazily (the --warm path imports no CUDA)

EIGHT_M = 8 * 2**20


def candidates() -> dict:
    """(m, n, backward) -> [configs]; the heuristic default is added by `plan()` when missing."""
    from tilelang_ops.kernels.softmax import SoftmaxConfig as S

    split_fwd = [S("split", 1, 256, 8192), S("split", 1, 256, 4096, 8)]
    split_bwd = [S("split", 1, 256, 4096), S("split", 1, 256, 4096, 8)]
    # csplit (one launch, a cluster of n / chunk <= 8 CTAs per row): 64 elements per thread held
    # in bf16 (fwd) fill the GPU in one wave at ~64 registers; 32 per thread at ~48 registers.
    cs = lambda t, c, mb=0: S("csplit", 1, t, c, mb)  # noqa: E731
    return {
        # short rows: one warp per row; registers decide CTAs per SM and so waves (2048 CTAs)
        (8192, 1024, False): [
            S("rows", 4, 128), S("rows", 4, 128, 0, 12), S("rows", 8, 128),
            S("rowsh", 4, 128, 0, 12), S("rowsh", 8, 128, 0, 8), S("rowsh", 8, 128),
        ],
        (8192, 1024, True): [S("rows", 4, 128)],
        # few long rows: split (two launches) vs a whole row per CTA held in bf16 (one launch)
        (256, 32768, False): split_fwd + [cs(128, 8192), cs(256, 8192), S("rowsh", 1, 512, 0, 2), S("rowsh", 1, 1024, 0, 2)],
        (256, 32768, True): split_bwd + [cs(256, 8192), cs(512, 8192), S("rowsh", 1, 1024, 0, 1), S("rowsh", 1, 1024, 0, 2)],
        (128, 65536, False): split_fwd + [cs(128, 8192), cs(256, 16384), cs(256, 8192), S("rowsh", 1, 1024, 0, 1)],
        (128, 65536, True): split_bwd + [cs(256, 8192), cs(512, 16384)],
        (64, 131072, False): split_fwd + [cs(256, 16384), cs(512, 16384)],
        (64, 131072, True): split_bwd + [cs(512, 16384), cs(1024, 16384)],
        (32, 262144, False): split_fwd + [cs(512, 32768), cs(1024, 32768)],
        (32, 262144, True): split_bwd + [cs(1024, 32768)],
        # many long rows: rows (1 CTA/SM at 48 registers) vs rowsh 2 CTAs/SM vs loop
        (4096, 32768, False): [
            S("rows", 1, 1024), S("rowsh", 1, 512, 0, 2), S("rowsh", 1, 1024, 0, 2),
            S("loop", 1, 256, 8192), S("loop", 1, 512, 8192, 2),
        ],
        (4096, 32768, True): [S("loop", 1, 256, 4096), S("rowsh", 1, 1024, 0, 1), S("rowsh", 1, 1024, 0, 2)],
    }


def plan(dtype: str = "bfloat16") -> list[tuple]:
    """[(m, n, backward, cfg, is_default)] in shape order, the heuristic/MEASURED default first."""
    from tilelang_ops.kernels import softmax as K

    rows = []
    for (m, n, bwd), cfgs in candidates().items():
        default = K.default_config(n, dtype, "softmax", bwd, m)
        ordered = [default] + [c for c in cfgs if c != default]
        rows += [(m, n, bwd, c, c == default) for c in ordered]
    return rows


def kernels_of(plan_rows, dtype: str = "bfloat16") -> list[tuple]:
    from tilelang_ops.kernels import softmax as K

    seen, out = set(), []
    for m, n, bwd, cfg, _ in plan_rows:
        for kd, c, st in K.schedule_kernels(cfg, n, dtype, "softmax", bwd):
            key = (kd.name, c, tuple(sorted(st.items())))
            if key not in seen:
                seen.add(key)
                out.append((kd, c, st))
    return out


def _compile_one(args):
    kd_name, cfg, st, arch = args
    from tilelang_ops.kernels import softmax as K

    kd = next(v for v in vars(K).values() if getattr(v, "name", None) == kd_name and hasattr(v, "compile"))
    t = time.time()
    kd.compile(cfg, arch, **st)
    return kd_name, cfg, st, time.time() - t


def warm(arch: str, jobs: int) -> None:
    """Compile every candidate kernel into $TILELANG_CACHE_DIR (works without a GPU)."""
    from concurrent.futures import ProcessPoolExecutor

    from tilelang_ops.runtime import config_str

    ks = kernels_of(plan())
    print(f"compiling {len(ks)} kernels for {arch} with {jobs} processes", flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(jobs) as ex:
        for name, cfg, st, dt in ex.map(_compile_one, [(kd.name, c, st, arch) for kd, c, st in ks]):
            print(f"  {dt:5.1f}s {name} {config_str(cfg)} n={st['n']}" + (f" bwd={st['backward']}" if "backward" in st else ""), flush=True)
    print(f"done in {time.time() - t0:.0f} s")


def _tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def run(rep: int) -> None:
    import torch

    import tilelang_ops  # noqa: F401
    from tilelang_ops.kernels import softmax as K
    from tilelang_ops.ops import softmax as ops
    from tilelang_ops.reference import SOFTMAX_ATOL, SOFTMAX_RTOL
    from tilelang_ops.runtime import config_str

    from ._timing import bench, table, write_json

    dtype = torch.bfloat16
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    rows, best = [], {}
    by_shape: dict = {}
    for m, n, bwd, cfg, is_def in plan():
        by_shape.setdefault((m, n), []).append((bwd, cfg, is_def))
    for (m, n), entries in by_shape.items():
        torch.manual_seed(0)
        x = torch.randn(m, n, device="cuda", dtype=dtype) * 3
        elt = x.numel() * x.element_size()
        out = torch.empty_like(x)
        copy_bw = _tbps(2 * elt, bench(lambda: out.copy_(x), rep=rep, flush_l2=True))
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        ref_f = torch.softmax(x.float(), -1)
        ref_b = torch._softmax_backward_data(dy.float(), y.float(), -1, torch.float32)
        for bwd, cfg, is_def in entries:
            name = config_str(cfg)
            direction = "bwd" if bwd else "fwd"
            nbytes = (3 if bwd else 2) * elt
            try:
                kernels = ops._compile(cfg, "softmax", bwd, n, dtype, dev)
                a, b = (dy, y) if bwd else (x, None)
                o = torch.empty_like(x)
                fn = lambda: ops._run(cfg, kernels, bwd, a, b, o)  # noqa: E731
                res = fn()
                torch.cuda.synchronize()
                if bwd:
                    err = ((res.float() - ref_b).norm() / ref_b.norm()).item()
                    ok = err < 3e-2
                else:
                    err = (res.float() - ref_f).abs().max().item()
                    ok = bool(torch.isclose(res.float(), ref_f, atol=SOFTMAX_ATOL[dtype], rtol=SOFTMAX_RTOL[dtype]).all())
                ms = bench(fn, rep=rep, flush_l2=True)
            except Exception as e:  # a config that fails to compile/launch: report, keep going
                print(f"  {m}x{n} {direction} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            r = {"shape": f"{m}x{n}", "dir": direction, "config": name + (" *" if is_def else ""), "ok": ok,
                 "err": err, "ms": ms, "TB/s": _tbps(nbytes, ms), "copy TB/s": copy_bw,
                 "% copy": 100 * _tbps(nbytes, ms) / copy_bw, "bucket": K.m_bucket(m, sms), "cfg": list(cfg.__dict__.values())}
            if cfg.schedule == "split":  # the two launches alone: where the time goes
                m_, c = x.shape[0], -(-n // cfg.chunk)
                p0 = torch.empty(m_, c, dtype=torch.float32, device="cuda")
                p1 = torch.empty_like(p0)
                bb = y if bwd else a
                r["stats ms"] = bench(lambda: kernels[0](a, bb, p0, p1), rep=rep, flush_l2=True)
                kernels[0](a, bb, p0, p1)
                r["apply ms"] = bench(lambda: kernels[1](a, bb, p0, p1, o), rep=rep, flush_l2=True)
            rows.append(r)
            key = (m, n, direction)
            if ok and (key not in best or ms < best[key]["ms"]):
                best[key] = r
        print(f"  {m}x{n} done ({time.time() - t0:.0f} s)", flush=True)
    path = write_json("sweep_softmax", rows, {"dtype": "bfloat16", "best": [dict(v, key=list(k)) for k, v in best.items()]})
    print(table(rows, ["shape", "dir", "config", "ok", "ms", "TB/s", "% copy", "stats ms", "apply ms"]))
    print("\n* = current default. Best per shape:")
    print(table(list(best.values()), ["shape", "dir", "config", "TB/s", "% copy"]))
    print("\n# paste into MEASURED in tilelang_ops/kernels/softmax.py (only where the best beats the default):")
    for (m, n, direction), r in best.items():
        default = next(x for x in rows if x["shape"] == r["shape"] and x["dir"] == direction and x["config"].endswith(" *"))
        s, bm, t, ch, mb = r["cfg"]
        mark = "" if r is not default and r["ms"] < 0.97 * default["ms"] else "  # default is within 3%: optional"
        print(f'    ("{direction}", {n}, "{r["bucket"]}"): SoftmaxConfig("{s}", {bm}, {t}, {ch}, {mb}),'
              f'  # {m}x{n} {r["% copy"]:.0f}% copy vs default {default["% copy"]:.0f}%{mark}')
    print(f"wrote {path}; {time.time() - t0:.0f} s total")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warm", action="store_true", help="only compile every candidate (no GPU needed)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--list", action="store_true", help="print the candidate kernels and exit")
    p.add_argument("--rep", type=int, default=30)
    args = p.parse_args(argv)
    if args.list:
        from tilelang_ops.runtime import config_str

        for m, n, bwd, cfg, d in plan():
            print(m, n, "bwd" if bwd else "fwd", config_str(cfg), "*" if d else "")
        print(len(kernels_of(plan())), "kernels")
    elif args.warm:
        warm(args.arch, args.jobs)
    else:
        run(args.rep)


if __name__ == "__main__":
    main()
