"""Cold vs warm compile: time for a fresh process to get a kernel ready and to launch it once.

Runs each measurement in a new Python process with `TILELANG_CACHE_DIR` pointing at a fresh
directory: first cold (nvcc runs), then again with the cache the first process filled.
`python -m benchmarks.compile_time [--arch sm_90a]` (without a GPU: compile only, no launch).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from tilelang_ops.kernels import elementwise as K
t_import = time.perf_counter() - t0
arch = sys.argv[1]
cfg = K.default_config("bfloat16")
t1 = time.perf_counter()
kernel = K.add_kernel.compile(cfg, arch, dtype="bfloat16")
t_compile = time.perf_counter() - t1
t_launch = None
if torch.cuda.is_available():
    a = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    t2 = time.perf_counter()
    kernel(a, a, out)
    torch.cuda.synchronize()
    t_launch = time.perf_counter() - t2
print(json.dumps({"import_s": t_import, "compile_or_load_s": t_compile, "first_launch_s": t_launch,
                  "to_first_launch_s": t_compile + (t_launch or 0.0)}))
"""


def run_child(cache_dir: str, arch: str) -> dict:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD, arch], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default=None, help="default: the GPU's arch, else sm_90a")
    args = parser.parse_args()
    import torch

    from tilelang_ops.runtime import arch_for_device

    arch = args.arch or (arch_for_device(0) if torch.cuda.is_available() else "sm_90a")
    with tempfile.TemporaryDirectory() as d:
        cold = run_child(d, arch)
        warm = run_child(d, arch)
    rows = [dict(run="cold (empty cache)", **cold), dict(run="warm (disk cache, new process)", **warm)]
    from benchmarks._timing import table, write_json

    write_json("compile_time", rows, {"kernel": "elementwise.add bf16", "arch": arch})
    print(table(rows, ["run", "import_s", "compile_or_load_s", "first_launch_s", "to_first_launch_s"]))


if __name__ == "__main__":
    main()
