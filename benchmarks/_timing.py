"""One timing helper for every benchmark: CUDA events, warm-up, median of many runs.

`bench(fn)` returns the median milliseconds of `fn()` over `rep` timed runs after `warmup` runs,
each run bracketed by its own pair of CUDA events on the current stream. Inputs that fit in L2
(60 MB on H200) are measured from cache: benchmarks size problems well past that.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from tilelang_ops.tuning import in_turns, time_cuda, warm_up


def first_run(fn, label: str, timeout: float = 60.0, sync=None, exit_code: int = 3) -> None:
    """Run fn once and synchronize under a watchdog: a candidate kernel that hangs (a barrier
    that never completes) ends the process, naming it, after `timeout` seconds, instead of holding
    the GPU until the call's time limit (session 22: one hung sweep took 400 s of a 30-minute
    budget). A CUDA synchronize cannot be interrupted, hence the exit; what the sweep wrote before
    stays. sync: torch.cuda.synchronize by default."""
    import threading

    done = threading.Event()

    def watch():
        if not done.wait(timeout):
            print(f"HUNG: {label} did not finish in {timeout:.0f} s; exiting", flush=True)
            os._exit(exit_code)

    threading.Thread(target=watch, daemon=True).start()
    try:
        fn()
        (sync or torch.cuda.synchronize)()
    finally:
        done.set()


# Warm-up per timing, by time: a contender's first ~100 ms run at the clock its predecessor left
# (the H200 is power-capped at 700 W; after a low-power peer the clock starts high), and in
# benchmarks the contenders take turns (`interleaved`), so each timing starts after another's.
WARM_MS = float(os.environ.get("BENCH_WARM_MS", "200"))


def bench(fn, warmup: int = 10, rep: int = 50, flush_l2: bool = False) -> float:
    """The tuner's clock (`tilelang_ops.tuning.time_cuda`) with the benchmarks' defaults: flush_l2
    zeroes 256 MB before each timed run, outside the events; at least WARM_MS of warm-up."""
    return time_cuda(fn, warmup, rep, flush_l2, warm_ms=WARM_MS)


def graph_ms(fn, n: int = 10, rep: int = 10) -> float:
    """GPU ms per fn() with the host taken out: a CUDA graph of `n` back-to-back calls, replayed
    `rep` times between CUDA events (median / n). Where one call's GPU work is shorter than its
    host path (small GEMMs), `bench` measures the host; this measures the kernels."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    warm_up(g.replay, 2, WARM_MS)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) / n


def interleaved(timer, fns, rounds: int = 3, log: list | None = None) -> list[float]:
    """Median over `rounds` of timer(fn) per fn, the fns taking turns within each round, each round
    starting one contender later. The H200's clock falls as it heats: timing one side after the
    other favours whichever runs first (8192³, sixth session: ours 782 TFLOP/s timed first, 678 in
    the graph replays after cuBLAS). log: gets (index into fns, round, time) of every timing in
    the order they ran."""
    return list(in_turns(dict(enumerate(fns)), timer, rounds, log).values())


def named_in_turns(fns: dict, rounds: int = 5, warmup: int = 5, rep: int = 30) -> dict:
    """`interleaved` `bench` over named contenders: name -> (median ms, that contender's ms in
    each round, in the order the rounds ran), for a diagnostic's rows."""
    log = []
    times = interleaved(lambda f: bench(f, warmup=warmup, rep=rep), list(fns.values()), rounds=rounds, log=log)
    return {name: (t, [round(x, 4) for k, _, x in log if k == i]) for i, (name, t) in enumerate(zip(fns, times))}


def host_us(fn, n: int = 2000, warmup: int = 200) -> float:
    """Median host wall time per call in microseconds (launch path, not GPU time); on a machine
    without CUDA (benchmarks.host_standin) nothing to synchronize."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    sync()
    return statistics.median(samples)


def kernel_ms(step, steps: int, warmup: int = 3, name_len: int = 90) -> dict[str, float]:
    """GPU ms per step of every CUDA kernel `step()` launches, by kernel name (torch.profiler),
    after `warmup` unprofiled steps: where a step's GPU time goes."""
    from collections import defaultdict

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name[:name_len]] += ev.time_range.elapsed_us() / 1e3 / steps
    return dict(per_kernel)


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tl = version("tilelang")
    except PackageNotFoundError:
        tl = "absent"
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tilelang": tl,
        "python": platform.python_version(),
    }


def write_json(name: str, rows: list, extra: dict | None = None) -> str:
    """Write results to $OUT (device runs) or ./bench_results/ and return the path."""
    out_dir = os.environ.get("OUT") or "bench_results"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"env": environment(), **(extra or {}), "rows": rows}, f, indent=1)
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
