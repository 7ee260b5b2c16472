"""Where a training step's GPU time goes: top kernels of examples/train_gpt.py, torch vs tileops.

    python -m benchmarks.profile_train [--steps 2] [--top 12] [--host]

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


def _step_fn(tg, mode: str):
    args = tg.parse_args(["--mode", mode])
    model, step_fn = tg.build(args, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data, _ = tg.load_corpus()
    it = tg.batches(data, args.batch, args.seq, args.seed)

    def step():
        x, y = (t.cuda(non_blocking=True) for t in next(it))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_mode(tg, mode: str, steps: int) -> dict[str, float]:
    return kernel_ms(_step_fn(tg, mode), steps)


def host_mode(tg, mode: str, steps: int = 20, top: int = 25) -> dict:
    """Wall ms per step (synchronized), host ms per step (until the step returns), and the top
    Python functions by own time under cProfile."""
    import cProfile
    import io
    import pstats
    import time

    step = _step_fn(tg, mode)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
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
    return {"wall_ms": wall, "host_ms": host / steps * 1e3, "cprofile": buf.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--host", action="store_true", help="also the host time per step and a cProfile of it")
    a = p.parse_args()
    tg = _train_gpt()
    out = {}
    if a.host:
        for mode in ("torch", "tileops"):
            h = host_mode(tg, mode)
            print(f"\n{mode}: {h['wall_ms']:.2f} ms per step (synchronized), host returns after {h['host_ms']:.2f} ms")
            print("\n".join(h["cprofile"].splitlines()[:45]))
            torch.cuda.empty_cache()
    for mode in ("torch", "tileops"):
        kernels = profile_mode(tg, mode, a.steps)
        out[mode] = kernels
        total = sum(kernels.values())
        rows = [dict(kernel=k, ms_per_step=v, share=v / total) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[: a.top]]
        print(f"\n{mode}: {total:.2f} ms of kernels per step")
        print(table(rows, ["kernel", "ms_per_step", "share"]))
        torch.cuda.empty_cache()
    write_json("profile_train", [dict(mode=m, total_ms=sum(k.values()), kernels=k) for m, k in out.items()])


if __name__ == "__main__":
    main()
