"""Every op family once on small, ragged CUDA inputs, forward and backward, for NVIDIA's
compute-sanitizer (memcheck: out-of-bounds and misaligned accesses; racecheck: shared-memory
hazards; synccheck: barrier misuse; initcheck: reads of unwritten global memory), and a repeat
runner that hunts an intermittent wrong result or hang.

    compute-sanitizer --tool memcheck python -m benchmarks.sanitize [--only NAME ...]
    python -m benchmarks.sanitize --repeat 200 --only fwd_cfg     # no sanitizer: the flake hunt
    python -m benchmarks.sanitize --warm                          # compile its kernels here, no GPU

Each case runs the public op (its launch path included) and compares every output and gradient
with the same op's CPU path (PyTorch, fp32 math) on the same inputs: relative error (‖a − b‖ /
‖b‖) ≤ 2e-2 in bf16, looser than the unit tests' (their business is tolerance; here a wrong
or unwritten tile is what must show: NaN-poisoned outputs in the kernel-level cases).
`fwd_cfg` cases launch forward kernels at non-default configs directly (the persistent walks over
a grid of a few CTAs; the three-consumer-warpgroup D=64 walk that failed once in session 35).
Prints one line per case and `sanitize: N cases, M failed`; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import tilelang_ops  # noqa: F401  (registers the ops)
from tilelang_ops import functional as F
from tilelang_ops import reference

BF = torch.bfloat16
TOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _op_case(fn, *shapes, dtype=BF, grad=True):
    """fn on CUDA copies of fresh inputs against fn on the CPU ones: outputs and input grads."""

    def run():
        xs = [torch.randn(s, dtype=dtype) for s in shapes]
        outs = []
        for dev in ("cuda", "cpu"):
            ins = [x.to(dev).requires_grad_(grad) for x in xs]
            out = fn(*ins)
            out = out if isinstance(out, tuple) else (out,)
            res = list(out)
            if grad:
                torch.manual_seed(1)
                cot = [torch.randn(o.shape, dtype=o.dtype).to(dev) for o in out]
                res += torch.autograd.grad(out, ins, cot)
            outs.append(res)
        return max(_rel(a, b) for a, b in zip(*outs))

    return run


def _fwd_cfg_case(cfg, shape, causal, ctas=None):
    """A forward kernel at `cfg` launched directly on NaN-poisoned out and lse, against the fp64
    reference. run.kernel: its (config, static args), which --warm compiles."""
    from tilelang_ops.kernels import attention as K

    B, Sq, Sk, H, HK, D = shape
    static = dict(headdim=D, dtype="bfloat16", causal=causal, groups=H // HK, scale=K.default_scale(D))
    if ctas is not None:
        static["ctas"] = ctas

    def run():
        from tilelang_ops.ops.attention import fwd_config_launcher

        kern = fwd_config_launcher(cfg, "cuda", **static)  # a dynamic walk with its tile counter, as the op
        q, k, v = (torch.randn(B, s, h, D, dtype=BF, device="cuda") for s, h in ((Sq, H), (Sk, HK), (Sk, HK)))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, H, Sq), float("nan"), device="cuda")
        kern(q, k, v, out, lse)
        ref, ref_lse = reference.flash_attn(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal, static["scale"], torch.float64)
        seen = torch.isfinite(ref_lse)
        if not torch.equal(torch.isfinite(lse.cpu()), seen):
            return float("inf")
        return max(_rel(out, ref), (lse.cpu()[seen].double() - ref_lse[seen]).abs().max().item() if seen.any() else 0.0)

    run.kernel = (cfg, static)
    return run


def cases():
    """(group, name, run): group selects with --only."""
    acts = ("none", "relu", "gelu", "gelu_tanh", "silu")
    yield "add", "add 4097", _op_case(F.add, (4097,), (4097,))
    yield "softmax", "softmax 17x1000", _op_case(F.softmax, (17, 1000))
    yield "softmax", "log_softmax 3x4097", _op_case(F.log_softmax, (3, 4097))
    yield "norm", "layer_norm 17x1000", _op_case(lambda x, w, b: F.layer_norm(x, (1000,), w, b), (17, 1000), (1000,), (1000,))
    yield "norm", "layer_norm 300x4096 (multi-kernel backward)", _op_case(lambda x, w, b: F.layer_norm(x, (4096,), w, b), (300, 4096), (4096,), (4096,))
    yield "norm", "add_layer_norm 17x1000", _op_case(lambda x, r, w, b: F.add_layer_norm(x, r, (1000,), w, b), (17, 1000), (17, 1000), (1000,), (1000,))
    yield "gemm", "gemm 17x33 @ 33x1000", _op_case(F.gemm, (17, 40), (40, 1000))
    yield "gemm", "gemm 3x100x64 @ 3x64x72", _op_case(F.gemm, (3, 100, 64), (3, 64, 72))
    yield "gemm", "gemm 1000x4096 @ 4096x1000", _op_case(F.gemm, (1000, 4096), (4096, 1000), grad=False)
    for act in acts:
        yield "linear", f"linear {act} 17x64 -> 1000", _op_case(lambda x, w, b, a=act: F.linear(x, w, b, activation=a), (17, 64), (1000, 64), (1000,))
    yield "linear", "linear gelu_tanh 1000x512 -> 3000", _op_case(lambda x, w, b: F.linear(x, w, b, activation="gelu_tanh"), (1000, 512), (3000, 512), (3000,))
    for D in (64, 128, 256):
        for causal in (False, True):
            for shape in ((2, 17, 33, 4, 2), (1, 300, 1000, 4, 4), (2, 1000, 300, 4, 1)):
                B, Sq, Sk, H, HK = shape
                name = f"flash_attn D={D} {'causal' if causal else 'full'} {B}x{Sq}x{Sk}x{H}/{HK}"
                yield "attention", name, _op_case(lambda q, k, v, c=causal: F.flash_attn(q, k, v, causal=c), (B, Sq, H, D), (B, Sk, HK, D), (B, Sk, HK, D))
    from tilelang_ops.kernels.attention import FwdConfig, fwd_default_config

    flaky = FwdConfig(192, 128, 2, 384, "async", post_mask=True, persistent=True)
    d64 = fwd_default_config(64, True)  # the causal D=64 default: the same persistent walk, two consumer warpgroups
    for causal in (False, True):
        c = "causal" if causal else "full"
        yield "fwd_cfg", f"D=64 192x128 3-WG persistent {c} 2x17x33x4/2", _fwd_cfg_case(flaky, (2, 17, 33, 4, 2, 64), causal)
        yield "fwd_cfg", f"D=64 192x128 3-WG persistent {c} 2x1000x1000x8/2", _fwd_cfg_case(flaky, (2, 1000, 1000, 8, 2, 64), causal)
        yield "fwd_cfg", f"D=64 192x128 3-WG persistent {c} 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(flaky, (3, 1000, 1000, 4, 2, 64), causal, ctas=5)
        yield "fwd_cfg", f"D=64 128x128 persistent (causal default) {c} 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(d64, (3, 1000, 1000, 4, 2, 64), causal, ctas=5)
    # the non-causal D=128 default up to SHORT_ROWS[128] query rows: 128 x 128 persistent, lazy rescaling
    d128 = fwd_default_config(128, False, seqlen=1)
    yield "fwd_cfg", "D=128 128x128 persistent (short non-causal default) full 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(d128, (3, 1000, 1000, 4, 2, 128), False, ctas=5)
    # the causal D=128 default up to PERSISTENT_CAUSAL_KEYS keys: 128 x 128 persistent, warp-uniform roles
    d128c = fwd_default_config(128, True, seqlen=1)
    yield "fwd_cfg", "D=128 128x128 persistent uniform (short causal default) causal 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(d128c, (3, 1000, 1000, 4, 2, 128), True, ctas=5)
    # the O store's wait deferred to the next tile (FwdConfig.late_store_wait)
    late = dataclasses.replace(d64, late_store_wait=True)
    yield "fwd_cfg", "D=64 128x128 persistent late store wait causal 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(late, (3, 1000, 1000, 4, 2, 64), True, ctas=5)
    # the full wgmma wait pinned after the softmax (a per-thread shared store: FwdConfig.pin_waits),
    # with the row reductions as chains (FwdConfig.tree_reduce)
    pinned = dataclasses.replace(d64, pin_waits=True, tree_reduce=4)
    yield "fwd_cfg", "D=64 128x128 persistent pinned tree4 causal 3x1000x1000x4/2 ctas=5", _fwd_cfg_case(pinned, (3, 1000, 1000, 4, 2, 64), True, ctas=5)


def warm() -> int:
    """Compile every kernel the cases launch (sm_90a), launching none: the ops' CUDA paths run on
    CPU tensors with no-op launches (benchmarks.host_standin)."""
    from benchmarks.host_standin import install_standin
    from tilelang_ops.kernels import attention as K

    install_standin(compile_kernels=True)
    for group, name, run in cases():
        print("warm", name, flush=True)
        if group == "fwd_cfg":
            cfg, static = run.kernel
            K.flash_fwd_kernel.compile(cfg, "sm_90a", **static)
            continue
        try:
            _warm_op(run)
        except Exception as e:  # noqa: BLE001  (garbage outputs of the stand-in may fail the compare)
            print("  (compare skipped:", type(e).__name__, str(e)[:80], ")")
    return 0


def _warm_op(run) -> None:
    # With the stand-in, "cuda" tensors cannot be made: run the case with both sides on the CPU,
    # where the stand-in sends the ops to their CUDA paths (compiling, not launching).
    orig = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: self if a and a[0] == "cuda" else orig(self, *a, **k)
    try:
        run()
    finally:
        torch.Tensor.to = orig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", help="case group (add, softmax, norm, gemm, linear, attention, fwd_cfg); repeatable")
    p.add_argument("--repeat", type=int, default=1, help="run each case this many times (fresh inputs each)")
    p.add_argument("--warm", action="store_true", help="compile the kernels (sm_90a) on this machine; launch nothing")
    args = p.parse_args(argv)
    if args.warm:
        return warm()
    from benchmarks._timing import first_run

    n = failed = 0
    for group, name, run in cases():
        if args.only and group not in args.only:
            continue
        worst = 0.0
        bad = 0
        for _ in range(args.repeat):
            box = []
            first_run(lambda: box.append(run()), name, timeout=300.0)
            worst = max(worst, box[0])
            bad += not box[0] <= TOL
        n += 1
        failed += bad > 0
        print(f"{'FAIL' if bad else 'ok  '} {name}: worst rel err {worst:.2e}" + (f" ({bad} of {args.repeat} runs over {TOL})" if bad else ""), flush=True)
    print(f"sanitize: {n} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
