"""Compile, for sm_90a on the CPU machine, every kernel `tileops tune --shapes FILE` will time, so
the GPU host loads them from the carried cache instead of compiling them (~10-60 s each there).

    TILELANG_CACHE_DIR=$PWD/.tl-cache python -m benchmarks.warm_tune benchmarks/tune_two_shapes.json

Each op's tune runner is called as `tileops tune` calls it, on meta tensors under
`host_standin.install_standin` (the target, the SM count and the launcher stood in for): it
compiles its config's kernel(s) and launches nothing.
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main(path: str) -> int:
    from benchmarks.host_standin import install_standin
    from tilelang_ops.ops import TUNABLES

    install_standin(compile_kernels=True)  # sm_90a, 132 SMs, no-op launches; search spaces as on Hopper
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
