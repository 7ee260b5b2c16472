"""Compile, for sm_90a on the CPU machine, every kernel `tileops tune --shapes FILE` will time, so
the GPU host loads them from the carried cache instead of compiling them (~10-60 s each there).

    TILELANG_CACHE_DIR=$PWD/.tl-cache python -m benchmarks.warm_tune benchmarks/tune_two_shapes.json

Each op's tune runner is called as `tileops tune` calls it, on meta tensors and with the launcher,
the target and the SM count stood in for: it compiles its config's kernel(s) and launches nothing.
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main(path: str) -> int:
    from tilelang_ops import runtime
    from tilelang_ops.ops import TUNABLES

    runtime.arch_for_device = lambda device: "sm_90a"
    runtime.sm_count = lambda device: 132
    runtime.launcher = lambda compiled: (lambda *args: None)
    torch.cuda.current_device = lambda: 0  # a dynamic walk's launcher names its device (CPU torch has none)
    # the search spaces as a Hopper GPU sees them: softmax's includes its TMA and cluster
    # schedules only where the device reports compute capability 9 (session 49: without this the
    # host compiled ~70 softmax kernels the carry lacked)
    from tilelang_ops.ops import softmax as softmax_ops

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    softmax_ops._sms = lambda device: 132
    meta = torch.device("meta")
    failed = 0
    t0 = time.time()
    for op, shapes in json.load(open(path)).items():
        t = TUNABLES[op]
        dtype = t.dtypes[0]  # what `tileops tune` times without --dtype
        for shape in map(tuple, shapes):
            configs = list(dict.fromkeys([*t.search_space(shape, dtype), t.default(shape, dtype)]))
            for cfg in configs:
                try:
                    t.runner(cfg, shape, dtype, meta)
                except Exception as e:  # noqa: BLE001 — reported; `tune` skips a config that fails to build
                    failed += 1
                    print(f"  {op} {shape} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            print(f"{op} {shape}: {len(configs)} configs ({time.time() - t0:.0f} s)", flush=True)
    print(f"done in {time.time() - t0:.0f} s, {failed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
