"""Diagnostic (GPU): each GEMM run back to back for a few seconds while `nvidia-smi` samples the SM
clock and the board power every 100 ms, so a kernel's speed can be split into clock and work per
clock. Under Nsight Compute (clocks locked) our 8192 x 4096 x 14336 kernels took the cycles
cuBLAS's did (session 33); at the board's 700 W limit they run 4-7% slower: this says whether the
difference is the clock the power budget leaves each kernel.

    python -m benchmarks.diag_gemm_power [--seconds S] [--shape M N K ...]

Prints, per contender and shape: TFLOP/s over the phase, mean SM clock (MHz) and power (W) of the
samples inside it, and TFLOP/s per GHz (work per clock); JSON under $OUT.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import torch

from benchmarks._timing import table, write_json
from benchmarks.diag_gemm_ncu import contenders


def _run_for(fn, seconds: float) -> int:
    """fn back to back, 10 calls between synchronizations, for `seconds`; the calls made."""
    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    return calls


def _phase(fn, seconds: float) -> tuple[float, float, float, int]:
    """(t0, t1, ms per call, calls): fn back to back for `seconds` after a 1 s warm-up."""
    _run_for(fn, 1.0)
    t0 = time.time()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls = _run_for(fn, seconds)
    stop.record()
    torch.cuda.synchronize()
    return t0, time.time(), start.elapsed_time(stop) / calls, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--shape", type=int, nargs=3, action="append", metavar=("M", "N", "K"))
    ap.add_argument("--rounds", type=int, default=2, help="every contender this many times, in turns")
    args = ap.parse_args(argv)

    shapes = args.shape or [(8192, 4096, 14336), (8192, 8192, 8192)]
    log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100", "-f", log])
    phases = []
    try:
        for m, n, k in shapes:
            fns = contenders(m, n, k, nn=True, linear=False)
            for f in fns.values():
                f()
            torch.cuda.synchronize()
            for r in range(args.rounds):
                for name, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
                    t0, t1, ms, calls = _phase(f, args.seconds)
                    phases.append(dict(shape=f"{m}x{n}x{k}", what=name, round=r, t0=t0, t1=t1, ms=ms, calls=calls, tflops=2 * m * n * k / ms / 1e9))
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(log):
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
            samples.append((ts, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    rows = []
    for p in phases:
        inside = [s for s in samples if p["t0"] + 0.2 <= s[0] <= p["t1"]]
        mhz = sum(s[1] for s in inside) / len(inside) if inside else float("nan")
        watts = sum(s[2] for s in inside) / len(inside) if inside else float("nan")
        rows.append(dict(shape=p["shape"], what=p["what"], round=p["round"], tflops=round(p["tflops"], 1), sm_mhz=round(mhz),
                         watts=round(watts), tflops_per_ghz=round(p["tflops"] / (mhz / 1000), 1), samples=len(inside)))
    out = write_json("diag_gemm_power", rows)
    print(f"wrote {out}")
    print(table(rows, ["shape", "what", "round", "tflops", "sm_mhz", "watts", "tflops_per_ghz", "samples"]))
    os.unlink(log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
