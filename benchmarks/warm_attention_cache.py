"""Pre-compile, on a machine without a GPU, every attention kernel the GPU tests and the benchmark use.

    TILELANG_CACHE_DIR=/work/main/.tl-cache python -m benchmarks.warm_attention_cache [-j 2] [--quick | --tune | --fuzz]

Fills TileLang's disk cache for sm_90a (the H200) with the exact kernels the op layer will ask for
(same builder, default config, static args and target), so carrying `.tl-cache` to the GPU host
turns each first call into a cache load instead of a ~5 s nvcc compile. `--quick` covers only the
benchmark's kernels; `--tune` the search spaces `tileops tune --op flash_attn --op
flash_attn_backward --op flash_attn_backward_dq` times (bf16, head dims 64 and 128, causal and
not, MHA). Both backward paths are warmed: the default one (bwd_fused, and bwd_fused_packed for MHA; prep, bwd, cast when dlse is given) and the
deterministic one (prep_nodq, bwd_nodq, dq; under torch.use_deterministic_algorithms(True)).

`--manifest FILE` lists the cache entries used (relative to the cache root; each entry's
executable.so embeds the cubin). They compress ~50x with xz (near-identical host wrappers):
    tar -C "$TILELANG_CACHE_DIR" -cJf attn-cache.txz -T FILE     # here
    tar -C "$TILELANG_CACHE_DIR" -xJf attn-cache.txz             # on the GPU host
"""
from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor

ARCH = "sm_90a"


def _tune_jobs() -> list[tuple]:
    from tilelang_ops.kernels.attention import SEARCH_SPACE, default_scale

    return [
        (kind, d, "bfloat16", c, 1, default_scale(d), cfg)
        for kind in ("fwd", "bwd", "dq")
        for d in (128, 64)
        for c in (False, True)
        for cfg in SEARCH_SPACE[kind]
    ]


def _jobs(quick: bool) -> list[tuple]:
    from tilelang_ops.kernels.attention import default_scale

    jobs = []
    if quick:  # bench_attention: bf16, D 64/128, MHA and GQA 4, causal and not
        combos = [(d, "bfloat16", c, g, default_scale(d)) for d in (64, 128) for c in (False, True) for g in (1, 4)]
    else:
        combos = [
            (d, dt, c, g, default_scale(d))
            for d, dt, c, g in itertools.product((64, 128, 256), ("bfloat16", "float16"), (False, True), (1, 2, 3, 4, 8))
        ]
        # tests with a non-default softmax_scale (opcheck 0.2, SDPA drop-in 0.5), head dim 64, bf16
        combos += [(64, "bfloat16", c, g, s) for s in (0.2, 0.5) for c in (False, True) for g in (1, 2)]
    for d, dt, c, g, s in combos:
        # bwd_small: the whole backward for at most SMALL_BWD_KEYS keys (D 64/128; packed too)
        for kind in ("fwd", "bwd", "bwd_nodq", "bwd_fused", "dq") + (("bwd_fused_packed",) if g == 1 else ()) + (("bwd_small",) if d <= 128 else ()):
            jobs.append((kind, d, dt, c, g, s))  # packed QKV: self-attention, MHA only
    for d, dt in itertools.product((64, 128) if quick else (64, 128, 256), ("bfloat16",) if quick else ("bfloat16", "float16")):
        jobs.append(("prep", d, dt, False, 1, 0.0))
        jobs.append(("prep_nodq", d, dt, False, 1, 0.0))
    for dt in ("bfloat16",) if quick else ("bfloat16", "float16"):
        jobs.append(("cast", 0, dt, False, 1, 0.0))
    # kernels run by config rather than by the op: the async-pipeline GPU tests (forward and
    # backward) and the candidates of benchmarks/sweep_attention.py (and its --bwd)
    from benchmarks.sweep_attention import jobs as sweep_jobs

    by_config = [("fwd", c, s) for c, s in sweep_jobs()] + [("bwd_fused", c, s) for c, s in sweep_jobs(bwd=True)]
    if not quick:
        import tests.test_attention as t

        by_config += [("fwd", c, s) for c, s in t.async_fwd_kernels() + t.d64_causal_default_kernels() + t.lazy_fwd_kernels() + t.persistent_fwd_kernels() + t.dynamic_fwd_kernels()] + t.async_bwd_kernels()
    for kind, cfg, st in by_config:
        job = (kind, st["headdim"], st["dtype"], st["causal"], st["groups"], st["scale"], cfg) + ((st["ctas"],) if "ctas" in st else ())
        if job not in jobs:
            jobs.append(job)
    return _with_buckets(jobs)


def _with_buckets(jobs: list[tuple]) -> list[tuple]:
    """jobs plus, for each default-config forward or backward-main job, the defaults of its shorter
    length buckets (ops.attention.LENGTH_BOUNDS) where they differ from the long one."""
    from tilelang_ops.ops import attention as A

    for kind, d, dt, c, g, s in [j for j in jobs if len(j) == 6 and A._TUNED_AS.get(j[0]) in ("fwd", "bwd")]:
        long = A.untuned_config(kind, d, c, ARCH)
        for bound in A.LENGTH_BOUNDS.get((A._TUNED_AS[kind], c, d), ()):
            job = (kind, d, dt, c, g, s, A.untuned_config(kind, d, c, ARCH, bound))
            if job[6] != long and job not in jobs:
                jobs.append(job)
    return jobs


def _compile(job) -> tuple:
    from tilelang_ops.ops import attention as A

    kind, d, dt, causal, groups, scale = job[:6]
    t0 = time.time()
    # exactly what the op layer compiles for this kernel name: same static args and flags
    config = job[6] if len(job) > 6 else A.untuned_config(kind, d, causal, ARCH)
    try:
        extra = {"ctas": job[7]} if len(job) > 7 else {}  # a persistent kernel's grid (tests' tiny ones)
        k = A.compile_kernel(kind, config, ARCH, dt, **A.kernel_static(kind, d, causal, groups, scale), **extra)
    except Exception as e:  # a search-space config may not fit (shared memory, warp layout)
        return job, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", None
    # the cache entry's directory: its executable.so embeds the cubin, so it alone serves the GPU host
    return job, f"{time.time() - t0:.1f}s", getattr(k, "_tilelang_cache_path", None)


def _fuzz_jobs() -> list[tuple]:
    """test_flash_attn_cuda_fuzz's kernels: the forward with LSE and the fused backward at every
    head dim, dtype, causal and GQA ratio it draws, default scale; its lengths (<= 4097) take the
    shorter length buckets' defaults where they differ."""
    from tilelang_ops.kernels.attention import default_scale

    combos = itertools.product((64, 128, 256), ("bfloat16", "float16"), (False, True), (1, 2, 4, 8))
    return _with_buckets([(kind, d, dt, c, g, default_scale(d)) for d, dt, c, g in combos for kind in ("fwd", "bwd_fused")])


def main(argv=None) -> int:
    import logging

    p = argparse.ArgumentParser()
    p.add_argument("-j", type=int, default=1, help="parallel compiles")
    p.add_argument("--quick", action="store_true", help="only the benchmark's kernels")
    p.add_argument("--tune", action="store_true", help="the tuner's search spaces")
    p.add_argument("--train", action="store_true", help="only examples/train_gpt.py's kernels (head dim 64, bf16, causal)")
    p.add_argument("--fuzz", action="store_true", help="only what test_flash_attn_cuda_fuzz loads: the forward with LSE and the fused backward of every head dim, dtype, causal and GQA ratio (1/2/4/8)")
    p.add_argument("--manifest", help="write the warmed kernels' cache directories to this file (one a line)")
    args = p.parse_args(argv)
    logging.getLogger("TileLang").setLevel(logging.WARNING)
    if args.train:
        from tilelang_ops.kernels.attention import default_scale

        jobs = [(kind, 64, "bfloat16", True, 1, default_scale(64)) for kind in ("fwd", "bwd_fused", "bwd_fused_packed")]
    elif args.fuzz:
        jobs = _fuzz_jobs()
    else:
        jobs = _tune_jobs() if args.tune else _jobs(args.quick)
    t0 = time.time()
    dirs = []
    with ProcessPoolExecutor(args.j) as ex:
        for i, (job, dt, path) in enumerate(ex.map(_compile, jobs), 1):
            print(f"[{i}/{len(jobs)}] {job} {dt}", flush=True)
            if path:
                dirs.append(path)
    if args.manifest:  # paths relative to the cache root: tar -C "$TILELANG_CACHE_DIR" -cJf x.txz -T MANIFEST
        import os

        root = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
        with open(args.manifest, "w") as f:
            f.write("".join(os.path.relpath(d, root) + "\n" for d in sorted(set(dirs))))
        print(f"wrote {len(set(dirs))} cache directories to {args.manifest}")
    print(f"warmed {len(jobs)} kernels for {ARCH} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
