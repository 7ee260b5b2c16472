"""Pre-compile (for sm_90a, on any machine) every GEMM-family kernel the GPU tests, `tileops check`
and benchmarks/bench_gemm.py (table and --tune) will load, into $TILELANG_CACHE_DIR, so the GPU
host loads cubins instead of compiling.

    export TILELANG_CACHE_DIR=$PWD/.tl-cache
    python -m benchmarks.warm_gemm_cache [--no-tune] [--only tests|check|bench|tune|train] [--arch sm_90a]

Configs come from the op layer's own `config_for` (every symbolic-M bucket's, deduplicated), so the
cache keys match what the ops request. benchmarks/sweep_gemm.py has its own `--warm`.
TEST_* lists the static dims tests/test_gemm.py requests on a GPU (recorded by running the tests
with the kernel launch replaced by a shape-checking CPU emulation); update it when the test shapes
change — a missing entry only costs a ~2 s compile on the GPU host, it does not fail.

Only `$TILELANG_CACHE_DIR/0.1.15/linux-x86_64/kernels/` is needed on the GPU host (each entry holds
the host wrapper with the cubin embedded); `cuda-binaries/` is nvcc's own cache. The kernel
entries compress ~15× with xz (many near-identical wrappers).
"""
from __future__ import annotations

import argparse
import time

import torch

# (layout, n, k, rows, dtype, batched, bias, activation, save_preact), after host padding to 8.
TEST_MATMUL = [
    # test_gpt_shape_schedules_poisoned_output: the GPT-shape overrides and a split-K weight gradient
    ('nt', 768, 3072, 0, 'bfloat16', False, True, 'none', False),
    ('nn', 3072, 768, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 768, 2304, 0, 'bfloat16', False, False, 'none', False),
    ('tn', 3072, 0, 768, 'bfloat16', False, False, 'none', False),
    ('nn', 8, 16, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 8, 16, 0, 'float16', False, False, 'none', False),
    ('nn', 72, 200, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 72, 200, 0, 'bfloat16', True, False, 'none', False),
    ('nn', 72, 200, 0, 'float16', False, False, 'none', False),
    ('nn', 128, 64, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 128, 64, 0, 'float16', False, False, 'none', False),
    ('nn', 128, 72, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 200, 72, 0, 'bfloat16', False, False, 'none', False),
    ('nn', 200, 72, 0, 'bfloat16', True, False, 'none', False),
    ('nn', 200, 72, 0, 'float16', False, False, 'none', False),
    ('nn', 200, 72, 0, 'float16', True, False, 'none', False),
    ('nt', 8, 16, 0, 'bfloat16', False, False, 'none', False),
    ('nt', 8, 16, 0, 'float16', False, False, 'none', False),
    ('nt', 64, 128, 0, 'bfloat16', False, True, 'relu', False),
    ('nt', 72, 200, 0, 'bfloat16', False, False, 'none', False),
    ('nt', 72, 200, 0, 'bfloat16', False, True, 'none', False),
    ('nt', 72, 200, 0, 'bfloat16', True, False, 'none', False),
    ('nt', 72, 200, 0, 'float16', False, False, 'none', False),
    ('nt', 72, 200, 0, 'float16', True, False, 'none', False),
    ('nt', 96, 64, 0, 'bfloat16', False, False, 'silu', True),
    ('nt', 128, 64, 0, 'bfloat16', False, False, 'none', False),
    ('nt', 128, 64, 0, 'bfloat16', False, True, 'gelu', True),
    ('nt', 128, 64, 0, 'float16', False, False, 'none', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'gelu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'gelu', True),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'gelu_tanh', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'gelu_tanh', True),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'none', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'relu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'silu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, False, 'silu', True),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'gelu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'gelu', True),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'gelu_tanh', False),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'gelu_tanh', True),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'none', False),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'none', True),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'relu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'relu', True),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'silu', False),
    ('nt', 200, 72, 0, 'bfloat16', False, True, 'silu', True),
    ('nt', 200, 72, 0, 'bfloat16', True, False, 'none', False),
    ('nt', 200, 72, 0, 'float16', False, False, 'gelu_tanh', False),
    ('nt', 200, 72, 0, 'float16', False, False, 'none', False),
    ('nt', 200, 72, 0, 'float16', False, True, 'gelu_tanh', False),
    ('nt', 200, 72, 0, 'float16', False, True, 'gelu_tanh', True),
    ('nt', 200, 72, 0, 'float16', False, True, 'none', False),
    ('nt', 200, 72, 0, 'float16', False, True, 'silu', True),
    ('tn', 8, 0, 16, 'bfloat16', False, False, 'none', False),
    ('tn', 8, 0, 16, 'float16', False, False, 'none', False),
    ('tn', 72, 0, 200, 'bfloat16', False, False, 'none', False),
    ('tn', 72, 0, 200, 'bfloat16', True, False, 'none', False),
    ('tn', 72, 0, 200, 'float16', False, False, 'none', False),
    ('tn', 128, 0, 64, 'bfloat16', False, False, 'none', False),
    ('tn', 128, 0, 64, 'float16', False, False, 'none', False),
    ('tn', 200, 0, 72, 'bfloat16', False, False, 'none', False),
    ('tn', 200, 0, 72, 'bfloat16', True, False, 'none', False),
    ('tn', 200, 0, 72, 'float16', False, False, 'none', False),
    ('tn', 200, 0, 72, 'float16', True, False, 'none', False),
]
TEST_ACT_GRAD = [
    (200, 'bfloat16', 'gelu'),
    (200, 'bfloat16', 'gelu_tanh'),
    (200, 'bfloat16', 'relu'),
    (200, 'bfloat16', 'silu'),
    (200, 'float16', 'gelu_tanh'),
    (200, 'float16', 'silu'),
]

# gemm_act_grad (n, k, dtype, activation): tests/test_gemm.py's GEMM_ACT_GRAD_SHAPES (fused ones)
# and test_mlp_* (hidden 200 over 72)
TEST_GEMM_ACT_GRAD = [(n, k, "bfloat16", act) for n, k in ((128, 64), (200, 72), (1000, 64)) for act in ("relu", "gelu", "gelu_tanh", "silu")]

# bias_grad (n, dtype): tests/test_gemm.py's bias_grad tests (BIAS_GRAD_SHAPES, the fuzz widths,
# opcheck and the strided case at 200) and the Linear backward of every test with a bias and no
# activation (72, 200 and the GPT down-projection's 768).
TEST_BIAS_GRAD = [(n, dt) for n in (8, 72, 128, 200, 384, 768, 2304) for dt in ("bfloat16", "float16")]


def _up(x):
    return -(-x // 8) * 8


def check_kernels():
    """The GEMM-family rows of tilelang_ops.ops.ALL_OPS (`tileops check` on a GPU): the matmul
    statics and the gemm_act_grad (n, k, dtype, activation)s."""
    from tilelang_ops.ops import ALL_OPS

    # case name -> the kernels one (M, K, N) shape of it loads, per dtype string
    matmuls = {
        "gemm": lambda k, n, dt: [("nn", _up(n), _up(k), 0, dt, False, False, "none", False)],
        "linear_gelu_tanh": lambda k, n, dt: [("nt", _up(n), _up(k), 0, dt, False, True, "gelu_tanh", False)],
        # (M, d, hidden): fc1 keeps z, fc2
        "mlp_gelu_tanh": lambda k, n, dt: [("nt", n, k, 0, dt, False, True, "gelu_tanh", True), ("nt", k, n, 0, dt, False, True, "none", False)],
    }
    grad = {"gemm_act_grad_gelu_tanh": "gelu_tanh"}
    out, grads = [], []
    for case in ALL_OPS:
        if case.name not in matmuls and case.name not in grad:
            continue  # not a GEMM-family case (its shapes may not be (M, K, N))
        for dt in case.dtypes:
            dts = str(dt).replace("torch.", "")
            for m, k, n in case.shapes:
                if case.name in matmuls:
                    out += matmuls[case.name](k, n, dts)
                else:
                    grads.append((n, k, dts, grad[case.name]))
    return out, grads


def bench_kernels():
    """What `python -m benchmarks.bench_gemm` (no flags) runs."""
    from benchmarks import bench_gemm as B

    bf = "bfloat16"
    out = [("nn", B.CUBE, B.CUBE, 0, bf, False, False, "none", False)]
    out += [("nn", n, k, 0, bf, False, False, "none", False) for n, k in B.GEMM_NK]
    out += [("nt", n, k, 0, bf, False, True, act, False) for act in ("gelu_tanh", "silu") for _, k, n in B.LINEAR_SHAPES]  # silu: --activation silu
    d, h = B.MLP["d"], B.MLP["hidden"]
    out += [
        ("nt", h, d, 0, bf, False, True, "gelu_tanh", True),  # fc1 forward, z saved
        ("nt", d, h, 0, bf, False, True, "none", False),  # fc2 forward
        ("nn", d, h, 0, bf, False, False, "none", False),  # fc1 dX = dZ @ W1
        ("tn", d, 0, h, bf, False, False, "none", False),  # fc1 dW = dZᵀ @ X
        ("nn", h, d, 0, bf, False, False, "none", False),  # fc2 dX
        ("tn", h, 0, d, bf, False, False, "none", False),  # fc2 dW
    ]
    return out, [(h, bf, "gelu_tanh")], [(d, bf)]  # fc2's bias gradient


def bench_grad_act_kernels():
    """nn.MLP's fused backward GEMM in `bench_gemm`'s MLP row: (n, k, dtype, activation)."""
    from benchmarks import bench_gemm as B

    return [(B.MLP["hidden"], B.MLP["d"], "bfloat16", "gelu_tanh")]


def train_kernels():
    """examples/train_gpt.py's tileops mode at its defaults (GPT-2 small: d=768, hidden 3072): the
    fused up-projection and its backward GEMMs, and act_grad."""
    bf, d, h = "bfloat16", 768, 3072
    mm = [
        ("nt", h, d, 0, bf, False, True, "gelu_tanh", True),  # fc1 forward, z saved
        ("nn", d, h, 0, bf, False, False, "none", False),  # fc1 dX = dZ @ W1
        ("tn", d, 0, h, bf, False, False, "none", False),  # fc1 dW = dZᵀ @ X
    ]
    return mm, [(h, bf, "gelu_tanh")], [(3 * d, bf), (d, bf)]  # bias gradients of the Linears without activation


def tune_kernels():
    """(config, static) pairs `bench_gemm --tune` / `tileops tune --op gemm` time (default preset)."""
    from tilelang_ops.kernels import gemm as K
    from tilelang_ops.ops import gemm as G

    out = []
    for shape in G.TUNABLE.presets["default"]:
        st = G._tune_static(shape)
        for cfg in G._tune_space(shape, torch.bfloat16):
            out.append((cfg, (st["layout"], st["n"], st["k"], st["rows"], "bfloat16", False, False, "none", False)))
    return out


def async_test_kernels():
    """The async-pipeline kernels tests/test_gemm.py calls directly (its ASYNC_CASES)."""
    from tests.test_gemm import ASYNC_CASES, SPLIT_CASES, async_kernel, split_kernel
    from tilelang_ops.kernels import gemm as K

    return [(K.matmul_kernel, *async_kernel(case)) for case in ASYNC_CASES] + [(K.matmul_kernel, *split_kernel(case)) for case in SPLIT_CASES]


def _static(t):
    layout, n, k, rows, dtype, batched, bias, act, save = t
    return dict(layout=layout, n=n, k=k, rows=rows, dtype=dtype, batched=batched, bias=bias, activation=act, save_preact=save)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--only", choices=["tests", "check", "bench", "tune", "train"], action="append")
    p.add_argument("--no-tune", action="store_true")
    args = p.parse_args(argv)
    from tilelang_ops.kernels import gemm as K
    from tilelang_ops.ops import gemm as G

    want = set(args.only or ["tests", "check", "bench"] + ([] if args.no_tune else ["tune"]))
    jobs = []  # (kernel, config, static)
    check_mm, check_grads = check_kernels() if "check" in want else ([], [])
    mm = (TEST_MATMUL if "tests" in want else []) + check_mm
    acts = TEST_ACT_GRAD if "tests" in want else []
    bias = TEST_BIAS_GRAD if "tests" in want else []
    if "bench" in want:
        b_mm, b_act, b_bias = bench_kernels()
        mm, acts, bias = mm + b_mm, acts + b_act, bias + b_bias
    if "train" in want:
        t_mm, t_act, t_bias = train_kernels()
        mm, acts, bias = mm + t_mm, acts + t_act, bias + t_bias
    # the defaults of every board with its own table entries too: one carry serves an H100 and an H200
    boards = [None] + sorted({key[0] for key in K.DEFAULT_OVERRIDES} - {"sm_9"})
    for t in dict.fromkeys(mm):
        s = _static(t)
        # one kernel per distinct config over the three symbolic-M buckets (usually just one)
        for cfg in dict.fromkeys(G.config_for(s["layout"], s["n"], s["k"], getattr(torch, s["dtype"]), args.arch, s["rows"], m=m, batched=s["batched"], board=b) for m in K.M_BUCKET_REP for b in boards):
            jobs.append((K.matmul_kernel, cfg, s))
    for n, dt, act in dict.fromkeys(acts):
        for bias_grad in (True, False):
            jobs.append((K.act_grad_kernel, K.default_act_grad_config(args.arch, n), dict(n=n, dtype=dt, activation=act, bias_grad=bias_grad)))
    for n, dt in dict.fromkeys(bias):
        jobs.append((K.bias_grad_kernel, K.default_bias_grad_config(args.arch, n), dict(n=n, dtype=dt)))
    grads = (TEST_GEMM_ACT_GRAD if "tests" in want else []) + check_grads + (bench_grad_act_kernels() if "bench" in want else [])
    for n, k, dt, act in dict.fromkeys(grads):
        s = dict(layout="nn", n=n, k=k, dtype=dt, grad_act=act)  # as ops.gemm._gemm_act_grad_kernel
        for cfg in dict.fromkeys(K.grad_act_config(G.config_for("nn", n, k, getattr(torch, dt), args.arch, m=m, board=b)) for m in K.M_BUCKET_REP for b in boards):
            jobs.append((K.matmul_kernel, cfg, s))
    if "tests" in want:
        jobs += async_test_kernels()
    if "tune" in want:
        jobs += [(K.matmul_kernel, cfg, _static(t)) for cfg, t in tune_kernels()]
    t0, failed = time.time(), 0
    for i, (kdef, cfg, static) in enumerate(jobs):
        t1 = time.time()
        try:
            kdef.compile(cfg, args.arch, **static)
            status = "ok"
        except Exception as e:  # report and go on: one bad config must not stop the warm-up
            failed += 1
            status = f"FAILED {type(e).__name__}: {str(e)[-200:]}"
        print(f"[{i + 1}/{len(jobs)}] {kdef.name} {static} {cfg}: {status} ({time.time() - t1:.1f} s)", flush=True)
    print(f"{len(jobs)} kernels ({failed} failed) in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
