"""Where a training step's GPU time goes: top kernels of examples/train_gpt.py, torch vs tileops.

    python -m benchmarks.profile_train [--steps 2] [--top 12] [--host] [--batch 16] [--seq 1024]

Builds the GPT of examples/train_gpt.py (default size) in the eager `torch` and `tileops` modes,
runs 3 warm-up steps, profiles `--steps` steps with torch.profiler and prints, per mode, the
kernels with the most CUDA time per step (and the step's total), so the gap between the modes
can be read kernel by kernel. JSON to $OUT/profile_train.json.

--host also times each mode's step on the host: the wall time per step (synchronized), the time
the Python step takes to return before the GPU finishes (the host's share: a step whose host time
is close to its wall time is launch-bound, and kernel time alone does not set tokens/s), and a
cProfile of the step's Python functions by own time.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib

import torch

from benchmarks._timing import kernel_ms, table, write_json

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --batch/--seq, passed on to every mode's examples/train_gpt.py arguments
SIZE: tuple[str, ...] = ()


def _step_fn(tg, mode: str, extra=(), clip: bool = False):
    args = tg.parse_args(["--mode", mode, *SIZE, *extra])
    model, step_fn = tg.build(args, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data, _ = tg.load_corpus()
    it = tg.batches(data, args.batch, args.seq, args.seed, pin=True)

    graphs = tg.cudagraphs(args, mode)

    def step():
        x, y = (t.cuda(non_blocking=True) for t in next(it))
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        if clip:  # as examples/train_gpt.py's loop
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def wall_ab(tg, variants, steps: int = 30, rounds: int = 3, freeze: bool = False) -> dict:
    """Median wall ms per step (synchronized over `steps` steps) of each (label, mode, extra args)
    variant, the variants taking turns for `rounds` rounds in one process: same host, same clocks.
    freeze: gc.freeze() after the warm-up, so that Python's cyclic GC stops re-traversing the
    models and compiled graphs built before (the collections a step's own garbage triggers then
    cost what that garbage costs); prints the GC collections per generation during the timing."""
    import gc
    import statistics
    import time

    fns = {label: _step_fn(tg, mode, extra, clip=True) for label, mode, extra in variants}
    for label, f in fns.items():
        t0 = time.perf_counter()
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        print(f"warm-up {label}: {time.perf_counter() - t0:.1f} s", flush=True)  # compiles; a hang shows here
    if freeze:
        gc.collect()
        gc.freeze()
    before = [g["collections"] for g in gc.get_stats()]
    times = {label: [] for label in fns}
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", flush=True)
        for label, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                f()
            torch.cuda.synchronize()
            times[label].append((time.perf_counter() - t0) / steps * 1e3)
    after = [g["collections"] for g in gc.get_stats()]
    print(f"GC collections per generation while timing (freeze={freeze}): {[a - b for a, b in zip(after, before)]}; {len(gc.get_objects())} tracked objects")
    return {label: statistics.median(t) for label, t in times.items()}


def profile_mode(tg, mode: str, steps: int) -> dict[str, float]:
    return kernel_ms(_step_fn(tg, mode), steps)


def api_mode(tg, mode: str, extra=(), steps: int = 3, top: int = 30) -> str:
    """Host-side events of `steps` steps (torch.profiler, CPU + CUDA activities), by self CPU time:
    aten ops, CUDA runtime/driver calls (launches, allocations, synchronizations)."""
    step = _step_fn(tg, mode, extra)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)


def host_mode(tg, mode: str, extra=(), steps: int = 20, top: int = 25) -> dict:
    """Wall ms per step (synchronized), host ms per step (until the step returns), the caching
    allocator's device mallocs / frees / retries and the synchronizations `torch.cuda`'s sync
    debug mode reports per step (a step that waits for the GPU mid-way is neither host- nor
    GPU-bound), and the top Python functions by own time under cProfile."""
    import cProfile
    import io
    import pstats
    import time
    import warnings

    step = _step_fn(tg, mode, extra)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    allocator = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    syncs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(steps):
        t1 = time.perf_counter()
        step()
        host += time.perf_counter() - t1
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {"wall_ms": wall, "host_ms": host / steps * 1e3, "allocator_per_step": allocator, "syncs_per_step": len(syncs), "sync_kinds": sorted(set(syncs)), "cprofile": buf.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--host", action="store_true", help="also the host time per step and a cProfile of it")
    p.add_argument("--api", action="store_true", help="also the host-side profiler events (CUDA API calls, aten ops) by self CPU time")
    p.add_argument("--ab", action="store_true", help="only: wall ms per step of torch and tileops, taking turns")
    p.add_argument("--variant", action="append", default=[], metavar="ARGS",
                   help="with --ab, --host, --api: also each tileops mode with these examples/train_gpt.py arguments (e.g. '--ln=torch'); repeatable")
    p.add_argument("--compile", action="store_true", help="with --ab: also torch-compile and tileops-compile")
    p.add_argument("--freeze", action="store_true", help="with --ab: gc.freeze() after the warm-up (see wall_ab)")
    p.add_argument("--cudagraphs", action="store_true", help="with --ab: also both compiled modes under torch.compile(mode='reduce-overhead')")
    p.add_argument("--no-kernels", action="store_true", help="with --host: skip the kernel-time profile")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (examples/train_gpt.py --batch)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (examples/train_gpt.py --seq)")
    a = p.parse_args()
    global SIZE
    SIZE = ("--batch", str(a.batch), "--seq", str(a.seq))
    tg = _train_gpt()
    out = {}
    extra = [tuple(v.split()) for v in a.variant]  # each tileops mode also with these arguments
    if a.ab:
        variants = [("torch", "torch", ())] + [(" ".join(("tileops", *e)), "tileops", e) for e in [(), *extra]]
        if a.compile:
            variants += [("torch-compile", "torch-compile", ())] + [(" ".join(("tileops-compile", *e)), "tileops-compile", e) for e in [(), *extra]]
        if a.cudagraphs:
            ro = ("--compile-mode", "reduce-overhead")
            variants += [("torch-compile-graphs", "torch-compile", ro)] + [(" ".join(("tileops-compile-graphs", *e)), "tileops-compile", ro + e) for e in [(), *extra]]
        res = wall_ab(tg, variants, freeze=a.freeze)
        base = res["torch"]
        for label, ms in res.items():
            print(f"{label:34s} {ms:6.2f} ms per step  {a.batch * a.seq / ms * 1e3:9,.0f} tokens/s  x torch {base / ms:.3f}")
        write_json("profile_train_ab", [dict(variant=k, ms_per_step=v, batch=a.batch, seq=a.seq, tokens_per_s=a.batch * a.seq / v * 1e3) for k, v in res.items()])
        return
    hosts = {}
    modes = [("torch", ()), ("tileops", ())] + [("tileops", e) for e in extra]
    if a.api:
        for mode, e in modes:
            print(f"\n{' '.join((mode, *e))}: host-side events over 3 steps")
            print(api_mode(tg, mode, e))
            torch.cuda.empty_cache()
    if a.host:
        for mode, e in modes:
            h = host_mode(tg, mode, e)
            hosts[" ".join((mode, *e))] = {k: v for k, v in h.items() if k != "cprofile"}
            print(f"\n{' '.join((mode, *e))}: {h['wall_ms']:.2f} ms per step (synchronized), host returns after {h['host_ms']:.2f} ms; "
                  f"per step: allocator {h['allocator_per_step']}, {h['syncs_per_step']} synchronizations {h['sync_kinds']}")
            print("\n".join(h["cprofile"].splitlines()[:45]))
            torch.cuda.empty_cache()
        write_json("profile_train_host", [dict(variant=k, **v) for k, v in hosts.items()])
        if a.no_kernels:
            return
    for mode in ("torch", "tileops"):
        kernels = profile_mode(tg, mode, a.steps)
        out[mode] = kernels
        total = sum(kernels.values())
        rows = [dict(kernel=k, ms_per_step=v, share=v / total) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[: a.top]]
        print(f"\n{mode}: {total:.2f} ms of kernels per step")
        print(table(rows, ["kernel", "ms_per_step", "share"]))
        torch.cuda.empty_cache()
    write_json("profile_train", [dict(mode=m, batch=a.batch, seq=a.seq, total_ms=sum(k.values()), kernels=k) for m, k in out.items()])


if __name__ == "__main__":
    main()
