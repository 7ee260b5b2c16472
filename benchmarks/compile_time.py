"""Cold vs warm start: time for a fresh process to reach its first call of an op, per op family.

Each measurement runs in a new Python process with `TILELANG_CACHE_DIR` pointing at a fresh
directory: first cold (nvcc runs), then again with the cache the first process filled (warm: the
kernels load from disk). The clock covers the op's whole first call from Python — config
resolution, compile or load, the host function, the launch and a synchronize — then a second call
of the same op (steady state). The backward row is one forward with grad and `backward()`.
`import torch`, `import tilelang_ops` and `import tilelang` (which the first call of a process
would otherwise pay: the kernel modules import it lazily, `import tilelang_ops` does not) are
timed on columns of their own, before the call.

    python -m benchmarks.compile_time [--op flash_attn ...]   # a GPU host: every op by default

Without a GPU the ops run as `benchmarks.host_standin` does (the CUDA path on CPU tensors, kernels
compiled for sm_90a, launches no-ops): the first call is then config resolution plus compile or
load, the part that a warm disk cache removes. Writes $OUT/compile_time.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# op name -> the statement its first call times (inputs are built before the clock starts)
OPS = {
    "add": "torch.ops.tileops.add(a, a)",
    "softmax": "torch.ops.tileops.softmax(x, -1)",
    "linear gelu_tanh": "torch.ops.tileops.linear(x, w, b, 'gelu_tanh')",
    "layer_norm": "torch.ops.tileops.layer_norm(x, b, b)",
    "flash_attn": "torch.ops.tileops.flash_attn(q, q, q, True)",
    "flash_attn fwd+bwd": "torch.ops.tileops.flash_attn(qg, q, q, True).sum().backward()",
}

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
t0 = time.perf_counter()
import tilelang_ops
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
import tilelang  # what the first call would import (the kernels' modules import it lazily)
t_tilelang = time.perf_counter() - t0
stmt = sys.argv[1]
gpu = torch.cuda.is_available()
if not gpu:
    from benchmarks import host_standin
    host_standin.install_standin(compile_kernels=True)
dev = "cuda" if gpu else "cpu"
bf = torch.bfloat16
a = torch.randn(1 << 20, device=dev, dtype=bf)
x = torch.randn(256, 1024, device=dev, dtype=bf)
w = torch.randn(1024, 1024, device=dev, dtype=bf)
b = torch.randn(1024, device=dev, dtype=bf)
q = torch.randn(2, 1024, 8, 128, device=dev, dtype=bf)
qg = q.clone().requires_grad_()
sync = torch.cuda.synchronize if gpu else (lambda: None)
times = []
for _ in range(2):
    t1 = time.perf_counter()
    exec(stmt)
    sync()
    times.append(time.perf_counter() - t1)
print(json.dumps({"import_torch_s": t_torch, "import_s": t_import, "import_tilelang_s": t_tilelang, "first_call_s": times[0], "second_call_s": times[1]}))
"""


def run_child(cache_dir: str, stmt: str) -> dict:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache_dir)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", CHILD, stmt], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:160] if out.stderr.strip() else f"rc={out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", action="append", choices=list(OPS), help="only these ops (repeatable; default: all)")
    args = parser.parse_args(argv)
    import torch

    from benchmarks._timing import table, write_json

    rows = []
    for name in args.op or list(OPS):
        with tempfile.TemporaryDirectory() as d:
            for run in ("cold", "warm"):  # warm: a new process on the cache the cold one filled
                rows.append(dict(op=name, run=run, **run_child(d, OPS[name])))
                print(table(rows[-1:], ["op", "run", "import_torch_s", "import_s", "import_tilelang_s", "first_call_s", "second_call_s", "error"]), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU: compile or load only (sm_90a), no launch"
    write_json("compile_time", rows, {"device": device})
    print(f"device: {device}")
    print(table(rows, ["op", "run", "import_torch_s", "import_s", "import_tilelang_s", "first_call_s", "second_call_s", "error"]))


if __name__ == "__main__":
    main()
