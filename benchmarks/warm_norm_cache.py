"""Pre-compile, on a machine without a GPU, every LayerNorm kernel the GPU tests and bench_norm use.

    TILELANG_CACHE_DIR=/work/main/.tl-cache python -m benchmarks.warm_norm_cache [-j 2] [--sweep]

The device-parametrized tests of tests/test_norm.py run on "cuda" too on the GPU host; the kernels
they need are found by running those tests here on the CPU with the reference recording each
call's (n, x dtype, weight dtype, output dtype). Added to them: the GPU-only test cases, the
benchmark's cases and, with --sweep, bench_norm's sweep configs. Compiled for sm_90a with the
op's own static args, so the GPU host's first call is a disk-cache load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ARCH = "sm_90a"
_RECORDER = '''
import json, os, atexit
from tilelang_ops import reference as R
seen = set()
fwd0, bwd0 = R.layer_norm, R.layer_norm_backward
def fwd(x, w, b, eps, od=None):
    t = w if w is not None else b
    seen.add(("fwd", x.shape[-1], str(x.dtype), str(t.dtype if t is not None else x.dtype), str(od or x.dtype), float(eps)))
    return fwd0(x, w, b, eps, od)
def bwd(dy, x, w, mean, rstd):
    seen.add(("bwd", x.shape[-1], str(x.dtype), str(w.dtype if w is not None else x.dtype), str(dy.dtype), 0.0))
    return bwd0(dy, x, w, mean, rstd)
R.layer_norm, R.layer_norm_backward = fwd, bwd
afwd0, abwd0 = R.add_layer_norm, R.add_layer_norm_backward
def afwd(x, r, w, b, eps, od=None):
    t = w if w is not None else b
    seen.add(("fwd", x.shape[-1], str(x.dtype), str(t.dtype if t is not None else x.dtype), str(od or x.dtype), float(eps), str(r.dtype), False))
    return afwd0(x, r, w, b, eps, od)
def abwd(dy, dh, h, w, mean, rstd, rdtype):
    seen.add(("bwd", h.shape[-1], str(h.dtype), str(w.dtype if w is not None else h.dtype), str(dy.dtype), 0.0, str(rdtype), dh is not None))
    return abwd0(dy, dh, h, w, mean, rstd, rdtype)
R.add_layer_norm, R.add_layer_norm_backward = afwd, abwd
atexit.register(lambda: json.dump(sorted(seen), open(os.environ["NORM_RECORD"], "w")))
'''


def _recorded() -> list[tuple]:
    """(direction, n, x dtype, weight dtype, output/dy dtype, eps[, residual dtype, dh]) of every op
    call the CPU tests make (add_layer_norm's calls carry the last two)."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "norm_recorder.py"), "w") as f:
            f.write(_RECORDER)
        env = {**os.environ, "NORM_RECORD": os.path.join(d, "seen.json"), "PYTHONPATH": d + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "norm_recorder", "-p", "no:cacheprovider", "tests/test_norm.py", "tests/test_add_norm.py"],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        return [tuple(j) for j in json.load(open(env["NORM_RECORD"]))]


def _short(dtype: str) -> str:
    return dtype.replace("torch.", "")


def _jobs(sweep: bool) -> list[tuple]:
    import torch

    from benchmarks import bench_norm
    from tests.test_norm import DTYPES, FUZZ_N, GPU_CASES

    from tests.test_add_norm import COMBOS, FUZZ_N as ADD_FUZZ_N, GPU_SHAPES

    jobs = {(d, n, _short(a), _short(b), _short(c), e, *([_short(rest[0]), rest[1]] if rest else ["", False]))
            for d, n, a, b, c, e, *rest in _recorded() if n > 0}
    # add_layer_norm's GPU-only cases and the values its hypothesis test may draw there
    for xd, rd, wd, od in COMBOS:
        names = [_short(str(t)) for t in (xd, wd, od or xd, rd)]
        for n in {s[-1] for s in GPU_SHAPES} | set(ADD_FUZZ_N):
            jobs.add(("fwd", n, names[0], names[1], names[2], 1e-5, names[3], False))
            if n in {s[-1] for s in GPU_SHAPES}:
                jobs |= {("bwd", n, names[0], names[1], names[2], 0.0, names[3], dh) for dh in (True, False)}
    extra = [(s[-1], dt, wdt, od or dt) for s, dt, wdt, od in GPU_CASES]
    extra += [(n, dt, dt, od) for _, n, dt, od in bench_norm.CASES]
    extra += [(n, dt, dt, dt) for n in FUZZ_N for dt in DTYPES]  # hypothesis draws others on the GPU than here
    extra += [(768, torch.float32, torch.float32, torch.bfloat16), (512, torch.float32, torch.float32, torch.float32)]  # other GPU tests
    extra += [(320, torch.float32, torch.float32, torch.float32)]
    extra += [(1024, torch.bfloat16, torch.bfloat16, torch.bfloat16)]  # benchmarks.overhead
    for n, dt, wdt, od in extra:
        jobs.add(("fwd", n, _short(str(dt)), _short(str(wdt)), _short(str(od)), 1e-5, "", False))
        jobs.add(("bwd", n, _short(str(dt)), _short(str(wdt)), _short(str(od)), 0.0, "", False))
    out = [(j, None) for j in sorted(jobs)]
    if sweep:
        for m, n, dt, od in bench_norm.SWEEP_CASES:
            a, o = _short(str(dt)), _short(str(od))
            for direction, cfg in bench_norm.sweep_jobs(n, a):
                out.append(((direction, n, a, a, o, 1e-5 if direction == "fwd" else 0.0, "", False), cfg))
    return out


def _compile(job) -> str:
    from tilelang_ops.ops import norm as N

    (direction, n, dt, wdt, od, eps, rdt, dh), cfg = job
    static = dict(dtype=dt, wdtype=wdt, odtype=od, eps=eps) if direction == "fwd" else dict(dtype=dt, wdtype=wdt, dydtype=od)
    if rdt:  # add_layer_norm's kernels: the op's static args (ops.norm._fwd_kernel / _bwd_kernel)
        static.update(rdtype=rdt, **({} if direction == "fwd" else {"dh": dh}))
    try:
        N.compile_kernel(direction, n, ARCH, cfg, **static)
    except Exception as e:  # noqa: BLE001 (report it; the other kernels still warm)
        return f"FAILED {direction} n={n} {dt}/{wdt}/{od} {cfg}: {str(e).splitlines()[0][:200]}"
    return f"{direction} n={n} {dt}/{wdt}/{od}" + (f" +residual {rdt}{' dh' if dh else ''}" if rdt else "")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-j", type=int, default=2)
    p.add_argument("--sweep", action="store_true", help="also bench_norm --sweep's configs")
    args = p.parse_args(argv)
    t0 = time.time()
    jobs = _jobs(args.sweep)
    print(f"{len(jobs)} norm kernels", flush=True)
    with ProcessPoolExecutor(args.j) as ex:
        for i, name in enumerate(ex.map(_compile, jobs)):
            print(f"  [{i + 1}/{len(jobs)}] {name} ({time.time() - t0:.0f} s)", flush=True)
    print(f"warmed {len(jobs)} norm kernels in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
