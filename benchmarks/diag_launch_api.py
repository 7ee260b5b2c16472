"""Where a TileLang launch's host time goes: the CUDA runtime and driver API calls (CUPTI, through
torch.profiler) inside the compiled host functions of a few ops, per call of the host function,
beside its wall time.

    python -m benchmarks.diag_launch_api [--calls 300]

The host function of an op (recorded from one call, as `benchmarks.overhead` does), and the
PyTorch peer's whole call, are called `--calls` times under the profiler; each CPU-side API event name gets its count per call and mean
µs. What the API calls do not cover is TileLang's and tvm_ffi's own C (argument checks, the
launch wrapper, descriptor encoding) and the Python → tvm_ffi crossing.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from benchmarks import overhead
from benchmarks._timing import host_us, write_json

ROWS = ("add", "gemm", "flash_attn", "flash_attn_backward", "layer_norm_backward")


def _launches(op, args):
    rec = overhead._Recorder()
    overhead._clear_op_caches()
    overhead.runtime.launcher = rec
    try:
        op.op(*args)
        torch.cuda.synchronize()
    finally:
        overhead.runtime.launcher = rec.real
        overhead._clear_op_caches()
    return rec.calls


def _runs():
    """(name, the host function(s) or the peer as one callable, host functions per call): ours, then torch's peer."""
    for name, op, args, peer in overhead.cases():
        if name not in ROWS:
            continue
        args = args() if callable(args) else args
        launches = _launches(op, args)
        yield name, (lambda launches=launches: [fn(*a) for fn, a in launches]), len(launches)
        if peer is not None:
            yield f"{name} (torch)", peer, 1


def main(calls: int) -> None:
    rows = []
    for name, run, n_functions in _runs():
        run()
        torch.cuda.synchronize()
        wall = host_us(run)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
        api = defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu"):
                api[e.name].append(e.cpu_time_total)  # µs
        row = {"op": name, "host_functions": n_functions, "wall_us": wall,
               "api": {k: {"per_call": len(v) / calls, "mean_us": statistics.fmean(v)} for k, v in sorted(api.items())}}
        row["api_us_per_call"] = sum(d["per_call"] * d["mean_us"] for d in row["api"].values())
        rows.append(row)
        print(f"{name}: {n_functions} call(s), {wall:.1f} µs wall; API {row['api_us_per_call']:.1f} µs per call")
        for k, d in row["api"].items():
            print(f"    {k:36s} {d['per_call']:5.2f} per call  {d['mean_us']:6.2f} µs each")
    write_json("launch_api", rows, {"calls": calls})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    main(p.parse_args().calls)
