"""Where the `tma` softmax forward loses to a copy at 8M elements: the same kernel with its
per-sub-chunk reductions left out (`tma_fwd(..., probe="copy")`: the same bulk loads, cluster
exchange and output pass; wrong results) next to the real kernel and `out.copy_(x)`.

    python -m benchmarks.sweep_softmax --warm          # CPU machine: also compiles these probes
    python -m benchmarks.probe_softmax                 # H200: < 1 min

probe ≈ tma: the compute is hidden and the read-all-then-write-all structure is what costs;
probe ≪ tma: the reductions themselves (exps, CTA barriers) are on the critical path.
Each contender timed in turns (`_timing.interleaved`), L2 flushed before every run.

    python -m benchmarks.probe_softmax --clock         # H200: where a tmaw/tmas CTA spends its time

--clock runs the `tmas` configs of CLOCKED with clock64() stamps (thread 0 of each CTA,
`tma_fwd(..., probe="clock")`) and prints, per phase, the median and the 90th percentile over
CTAs in microseconds at 1.98 GHz: each sub-chunk's wait (its landing after the previous one was reduced)
and reduction, the CTA/cluster combine and the output pass, after an L2 flush.
"""
from __future__ import annotations

SHAPES = [(256, 32768), (128, 65536), (32, 262144), (4096, 32768)]


def probes() -> list[tuple]:
    """(m, n, config, static) of every probe kernel: the forward default at each shape if it is of
    the tma family, as a `tma` config (tmaw/tmas have no probe variant: the same loads, so the
    same structural floor)."""
    import dataclasses

    from tilelang_ops.kernels import softmax as K

    out = []
    for m, n in SHAPES:
        cfg = K.default_config(n, "bfloat16", "softmax", False, m)
        if cfg.schedule in K.TMA_SCHEDULES:
            cfg = dataclasses.replace(cfg, schedule="tma")
            out.append((m, n, cfg, {"n": n, "dtype": "bfloat16", "kind": "softmax", "probe": "copy"}))
    return out


CLOCKED = [  # (m, n, (schedule, block_m, threads, chunk, min_blocks, stages))
    (128, 65536, ("tmas", 1, 256, 65536, 0, 4)),
    (128, 65536, ("tmas", 1, 512, 65536, 0, 4)),
    (256, 32768, ("tmas", 1, 256, 32768, 0, 4)),
    (32, 262144, ("tmas", 1, 128, 32768, 0, 8)),
]


def clocked() -> list[tuple]:
    """(m, n, config, static) of the clock-stamped kernels."""
    from tilelang_ops.kernels import softmax as K

    return [(m, n, K.SoftmaxConfig(*f), {"n": n, "dtype": "bfloat16", "kind": "softmax", "probe": "clock"}) for m, n, f in CLOCKED]


def clock_main() -> None:
    import torch

    from tilelang_ops import runtime
    from tilelang_ops.kernels import softmax as K

    from ._timing import bench, table, write_json

    dev = torch.device("cuda", torch.cuda.current_device())
    arch = runtime.arch_for_device(dev)
    mhz = 1980  # H200 boost clock: stamps are SM cycles
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # zeroed: flushes the L2
    rows = []
    for m, n, cfg, st in clocked():
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16) * 3
        out = torch.empty_like(x)
        nc = n // cfg.chunk
        stamps = torch.zeros(m * nc, 2 * cfg.stages + 3, device=dev, dtype=torch.int64)
        kern = runtime.launcher(K.tma_fwd.compile(cfg, arch, **st))
        ms = bench(lambda: kern(x, out, stamps), flush_l2=True)
        torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=2e-3, rtol=2e-2)
        samples = []
        for _ in range(20):
            scratch.zero_()
            kern(x, out, stamps)
            torch.cuda.synchronize()
            samples.append(stamps.diff(dim=1).double() / mhz)  # us per phase
        d = torch.cat(samples)
        row = {"shape": f"{m}x{n}", "config": runtime.config_str(cfg), "kernel us": 1e3 * ms, "clock MHz": mhz}
        names = [f"{'wait' if k % 2 == 0 else 'reduce'}{k // 2}" for k in range(2 * cfg.stages)] + ["combine", "output"]
        for k, name in enumerate(names):
            row[name] = f"{d[:, k].median():.2f}/{d[:, k].quantile(0.9):.2f}"
        row["total"] = f"{d.sum(1).median():.2f}/{d.sum(1).quantile(0.9):.2f}"
        rows.append(row)
        print(table([row], list(row)), flush=True)
    print(f"wrote {write_json('probe_softmax_clock', rows)}")


def main() -> None:
    import torch

    from tilelang_ops import runtime
    from tilelang_ops.kernels import softmax as K
    from tilelang_ops.ops import softmax as ops

    from ._timing import bench, interleaved, table, write_json

    dev = torch.device("cuda", torch.cuda.current_device())
    arch = runtime.arch_for_device(dev)
    rows = []
    for m, n, cfg, st in probes():
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16) * 3
        out = torch.empty_like(x)
        probe = runtime.launcher(K.tma_fwd.compile(cfg, arch, **st))
        kernels = ops._compile(cfg, "softmax", False, n, x.dtype, dev)
        timer = lambda fn: bench(fn, flush_l2=True)  # noqa: E731
        copy_ms, probe_ms, tma_ms = interleaved(timer, [lambda: out.copy_(x), lambda: probe(x, out), lambda: ops._run(cfg, kernels, False, x, None, out)])
        nbytes = 2 * x.numel() * x.element_size()
        rows.append({"shape": f"{m}x{n}", "config": runtime.config_str(cfg), "copy us": 1e3 * copy_ms, "probe us": 1e3 * probe_ms,
                     "tma us": 1e3 * tma_ms, "probe % copy": 100 * copy_ms / probe_ms, "tma % copy": 100 * copy_ms / tma_ms,
                     "copy TB/s": nbytes / copy_ms / 1e9})
    path = write_json("probe_softmax", rows)
    print(f"wrote {path}")
    print(table(rows, ["shape", "config", "copy us", "probe us", "tma us", "probe % copy", "tma % copy", "copy TB/s"]))


if __name__ == "__main__":
    import sys

    clock_main() if "--clock" in sys.argv else main()
