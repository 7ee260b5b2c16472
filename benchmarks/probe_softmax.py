"""Where the `tma` softmax forward loses to a copy at 8M elements: the same kernel with its
per-sub-chunk reductions left out (`tma_fwd(..., probe="copy")`: the same bulk loads, cluster
exchange and output pass; wrong results) next to the real kernel and `out.copy_(x)`.

    python -m benchmarks.sweep_softmax --warm          # CPU machine: also compiles these probes
    python -m benchmarks.probe_softmax                 # H200: < 1 min

probe ≈ tma: the compute is hidden and the read-all-then-write-all structure is what costs;
probe ≪ tma: the reductions themselves (exps, CTA barriers) are on the critical path.
Each contender timed in turns (`_timing.interleaved`), L2 flushed before every run.
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
    main()
