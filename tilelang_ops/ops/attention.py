"""torch.ops.tileops.flash_attn / flash_attn_with_lse / flash_attn_backward, and the packed-QKV
flash_attn_qkvpacked / _with_lse / _backward.

Layout as flash-attn's `flash_attn_func`: q (B, Sq, H, D), k and v (B, Sk, HK, D), H % HK == 0
(GQA/MQA: query head h reads kv head h // (H // HK); K/V are never repeated in memory).
Causal masks are bottom-right aligned: query i sees key j iff j <= i + Sk - Sq (flash-attn >= 2.1).
A query row that sees no key (causal with Sq > Sk) gets output 0 and lse = -inf.
LSE is fp32, natural log, (B, H, Sq).
Backward: fast (dQ by fp32 atomics) by default; bitwise deterministic under
torch.use_deterministic_algorithms(True) (a separate dQ kernel, see the backward's CUDA impl).

Reading order: validation → kernel resolution → forward op → CUDA impl → fake → backward op →
CUDA impl → fake → autograd → out-only op → the packed-QKV ops.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import reference, runtime, tuning
from .._library import custom_op
from ._checks import INT32_MAX, TL_DTYPE, aligned16, check_same, check_tensor, ready

DTYPES = (torch.float16, torch.bfloat16)
HEADDIMS = (64, 128, 256)
_deterministic = torch.are_deterministic_algorithms_enabled  # one C call per backward


# ------------------------------------------------------------------------------------ validation
def _check_qkv(q, k, v, softmax_scale) -> None:
    # Fast accept (the common call; shapes and device read once: ~1 us), else the full check
    # that names what is wrong.
    qs, ks, dt, dev = q.shape, k.shape, q.dtype, q.device
    if (
        dt in DTYPES and k.dtype is dt and v.dtype is dt and len(qs) == 4 and v.shape == ks and qs[0] == ks[0]
        and qs[3] == ks[3] and qs[3] in HEADDIMS and ks[2] and not qs[2] % ks[2] and softmax_scale is None
        and k.device == dev and v.device == dev
    ):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, DTYPES, ndim=4, contiguous=False)  # non-contiguous: copied on CUDA
    check_same(("q", "k"), q, k)
    check_same(("q", "v"), q, v)
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}; k and v must match (B, Sk, HK, D)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's {q.shape[0]} (layout is (batch, seqlen, nheads, headdim))")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"k: head dim {k.shape[3]} differs from q's {q.shape[3]}")
    if q.shape[3] not in HEADDIMS:
        raise ValueError(f"q: head dim {q.shape[3]} is not supported; supported: {', '.join(map(str, HEADDIMS))}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"q: nheads {q.shape[2]} is not a multiple of k's nheads_kv {k.shape[2]} (GQA needs nheads % nheads_kv == 0)"
        )
    _check_scale(softmax_scale)


def _check_scale(softmax_scale) -> None:
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a finite positive float or None, got {softmax_scale}")


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


# ----------------------------------------------------------------------------- kernel resolution
# (kernel name, dtype, device index, static, length bucket) -> compiled kernel. Resolved once per
# key, so a call is a dict lookup and a launch. Forward and backward-main configs: tuned cache ▸
# default table, one per (headdim, causal, GQA ratio) since one kernel serves every length — but
# where the default table depends on the length (LENGTH_BOUNDS), one per length bucket (and the
# tuned cache keeps an entry per bucket there too: _tune_key).
_kernels: dict[tuple, object] = {}
# kernels.attention.LENGTH_BOUNDS (that module imports tilelang): (kind, causal, headdim) -> the
# bounds of the defaults by length, ascending; the length is the keys, a non-causal forward's rows
LENGTH_BOUNDS = {("fwd", True, 128): (4096, 8192), ("fwd", False, 64): (2048,), ("fwd", False, 128): (1024,), ("bwd", False, 128): (8192,)}


def _length_bucket(kind: Optional[str], causal: bool, headdim: int, n: int) -> Optional[int]:
    """The length standing for n (keys, or a non-causal forward's query rows) in the default
    table: the first bound at or above it, twice the last above them all; None where no default
    of (kind, causal, headdim) depends on the length."""
    bounds = LENGTH_BOUNDS.get((kind, causal, headdim))
    if bounds is None:
        return None
    for b in bounds:
        if n <= b:
            return b
    return 2 * bounds[-1]


def _tune_shape(static: dict, seqlen: Optional[int] = None) -> tuple:
    # (B, S, H, HK, D, causal) at which `tileops tune` / TILEOPS_AUTOTUNE time a static key; its S
    # (the length bucket; 4096 where the default does not depend on it) also picks the default
    return (4, seqlen or 4096, 8 * static["groups"], 8, static["headdim"], int(static["causal"]))


# kernel name -> (KernelDef in kernels/attention.py, static flags the name fixes). The *_nodq
# variants are the deterministic backward's: prep without the fp32 dQ accumulator, the main
# kernel for dK/dV only; "dq" computes dQ per query block without atomics.
_KDEFS = {
    "fwd": ("flash_fwd_kernel", {}),
    "bwd": ("flash_bwd_kernel", {}),
    "bwd_nodq": ("flash_bwd_kernel", {"dq": False}),
    "bwd_fused": ("flash_bwd_fused_kernel", {}),  # prep + bwd + cast in one host call
    "bwd_fused_packed": ("flash_bwd_fused_kernel", {"packed": True}),  # the same, dq/dk/dv strided (qkvpacked)
    "dq": ("flash_bwd_dq_kernel", {}),
    "prep": ("flash_bwd_prep_kernel", {}),
    "prep_nodq": ("flash_bwd_prep_kernel", {"dq": False}),
    "cast": ("cast_f32_kernel", {}),
    "bwd_small": ("flash_bwd_small_kernel", {}),  # at most SMALL_BWD_KEYS keys: the whole backward, one kernel
}
# The backward in one kernel (flash_bwd_small: no scratch, no prep/cast launches) up to this many
# keys, at these head dims (kernels.attention.SMALL_BWD_KEYS / SMALL_BWD_HEADDIMS; that module
# imports tilelang), for small problems only: its plain T.gemm steps run ~1.4x the async main
# kernel's time per step (H200, session 26, benchmarks.diag_single_pass), so it wins on the GPU
# too only while each CTA walks at most SMALL_BWD_STEPS query blocks and the CTAs (batch x kv
# heads) fit two waves; beyond that the three-kernel backward's GPU time is less.
SMALL_BWD_KEYS = 128
SMALL_BWD_HEADDIMS = (64, 128)
SMALL_BWD_STEPS = 2
_SMALL_BWD_QUERIES = 64  # kernels.attention.SmallBwdConfig.block_n


def _small_bwd(B: int, Sq: int, Sk: int, HK: int, groups: int, D: int, device) -> bool:
    """Whether the backward of this problem (no dlse) is flash_bwd_small's."""
    return (
        Sk <= SMALL_BWD_KEYS and D in SMALL_BWD_HEADDIMS and groups * -(-Sq // _SMALL_BWD_QUERIES) <= SMALL_BWD_STEPS
        and B * HK <= 2 * runtime.sm_count(device)
    )
# Kernels with every static arg, and the tuned-config entry each resolves its config from
# (dK/dV-only uses the main backward's: same tiles, minus the dQ work).
_TUNED_AS = {"fwd": "fwd", "bwd": "bwd", "bwd_nodq": "bwd", "bwd_fused": "bwd", "bwd_fused_packed": "bwd", "dq": "dq"}


def kernel_static(name: str, headdim: int, causal: bool, groups: int, softmax_scale: Optional[float]) -> dict:
    """The static args kernel `name` takes: every one for the main kernels (softmax_scale None:
    1/sqrt(headdim)), headdim for the preprocess, none for the cast."""
    if name in _TUNED_AS or name == "bwd_small":
        from ..kernels import attention as K

        scale = K.default_scale(headdim) if softmax_scale is None else float(softmax_scale)
        return dict(headdim=headdim, causal=causal, groups=groups, scale=scale)
    return dict(headdim=headdim) if name != "cast" else {}


def untuned_config(name: str, headdim: int = 0, causal: bool = False, arch: Optional[str] = None, seqlen: Optional[int] = None):
    """Kernel `name`'s config without a tuned entry: the default table of kernels/attention.py for
    the main kernels (by headdim, causal, arch, and for the forward the sequence length: None = long),
    the fixed configs of the preprocess (by head dim) and the cast."""
    from ..kernels import attention as K

    if name in _TUNED_AS:
        return K.default_config(headdim, causal, arch, _TUNED_AS[name], seqlen)
    if name == "bwd_small":
        return K.SmallBwdConfig()
    return K.prep_config(headdim) if name != "cast" else K.CastConfig()


def compile_kernel(name: str, config, arch: str, dtype: str, **static):
    """Kernel `name` (see _KDEFS) compiled for `arch` and the TileLang dtype `dtype`; the
    cache-warming script calls this too, on a machine without a GPU."""
    from ..kernels import attention as K

    attr, flags = _KDEFS[name]
    return getattr(K, attr).compile(config, arch, dtype=dtype, **static, **flags)


def _compile(name: str, config, dtype: torch.dtype, device: torch.device, **static):
    return compile_kernel(name, config, runtime.arch_for_device(device), TL_DTYPE[dtype], **static)


def _kernel(name: str, dtype: torch.dtype, device: torch.device, headdim: int = 0, causal: bool = False, groups: int = 1, softmax_scale: Optional[float] = None, seqlen: Optional[int] = None):
    """Launcher for kernel `name`: "fwd"/"bwd"/"bwd_nodq"/"dq" (every static arg), "prep"/"prep_nodq"
    (headdim), "cast" (none). Keyed by the call's own arguments (positional, softmax_scale as
    given): a hit costs no math. seqlen: the call's length bucket (_length_bucket; None where the
    default does not depend on the length)."""
    key = (name, dtype, device.index, headdim, causal, groups, softmax_scale, seqlen)
    k = _kernels.get(key)
    if k is None:
        static = kernel_static(name, headdim, causal, groups, softmax_scale)
        if name in _TUNED_AS:
            config = tuning.resolve_config(TUNABLES[_TUNED_AS[name]], _tune_shape(static, seqlen), dtype, device)
        else:
            config = untuned_config(name, headdim)  # the preprocess (by head dim) and the cast: fixed configs
        if getattr(config, "persistent", False):
            static["ctas"] = runtime.sm_count(device)  # one CTA per SM
        k = _kernels[key] = _with_tile_counter(runtime.launcher(_compile(name, config, dtype, device, **static)), config, device)
    return k


# Dynamic walks' tile counters, one per (device, stream): every launch leaves its counter at 0 and
# launches on one stream run in order, so a counter is read by one launch at a time.
_tile_counters = {}


def _with_tile_counter(launch, config, device):
    """`launch` itself, or for a dynamic walk (FwdConfig.dynamic) a launcher that passes its tile
    counter as the last argument: an int32[1] that the kernel finds at 0 and leaves at 0. Eager
    calls share their stream's counter (a lookup, no memset); a call under CUDA graph capture gets
    a zeroed counter of its own, since a replay may run beside eager launches on any stream."""
    if not getattr(config, "dynamic", False):
        return launch
    device = torch.device(device)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", dev)

    def run(*args):
        if torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda.is_current_stream_capturing, less a Python call
            counter = torch.zeros(1, dtype=torch.int32, device=device)
        else:
            key = (dev, torch._C._cuda_getCurrentRawStream(dev))
            counter = _tile_counters.get(key)
            if counter is None:
                counter = _tile_counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
        launch(*args, counter)

    return run


def fwd_config_launcher(config, device, arch: str = "sm_90a", **static):
    """The forward kernel at `config` (`static`: flash_fwd_kernel's arguments, dtype included)
    launched as the op launches it, with its tile counter when the walk is dynamic and, for a
    persistent config, one CTA per SM of `device` unless `static` names the grid (`ctas`): for the
    tests, sweeps and sanitizer runs that check or time one config directly."""
    from ..kernels import attention as K

    if getattr(config, "persistent", False) and "ctas" not in static:
        static["ctas"] = runtime.sm_count(torch.device(device))
    return _with_tile_counter(runtime.launcher(K.flash_fwd_kernel.compile(config, arch, **static)), config, device)


def _tune_key(kind):
    def key(shape, dtype, device):
        # A tuned config is stored per length bucket where the default depends on the length
        # (LENGTH_BOUNDS: "len<=4096", "len>8192", ...), so tuning one length leaves the others'
        # defaults alone; one entry for every length elsewhere.
        B, S, H, HK, D, causal = shape
        b = _length_bucket(kind, bool(causal), D, S)
        last = LENGTH_BOUNDS[kind, bool(causal), D][-1] if b is not None else 0
        return {"headdim": D, "causal": bool(causal), "groups": H // HK}, "any" if b is None else f"len<={b}" if b <= last else f"len>{last}"

    return key


def _tune_default(kind):
    def default(shape, dtype):
        return untuned_config(kind, shape[4], bool(shape[5]), runtime.default_arch(), shape[1])

    return default


def _tune_space(kind):
    def space(shape, dtype):
        from ..kernels import attention as K

        return K.SEARCH_SPACE[kind]

    return space


def _tune_inputs(shape, dtype, device):
    B, S, H, HK, D, causal = shape
    q = torch.randn(B, S, H, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, S, HK, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, dict(headdim=D, causal=bool(causal), groups=H // HK, scale=1.0 / math.sqrt(D))


def _fwd_runner(config, shape, dtype, device):
    q, k, v, static = _tune_inputs(shape, dtype, device)
    kern = _with_tile_counter(_compile("fwd", config, dtype, device, **static), config, device)  # timed as the op runs it
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=device)
    return lambda: kern(q, k, v, out, lse)


def lse_rows(sq: int) -> int:
    """Rows of the preprocess's lse2/Delta buffers, (B, H, lse_rows(Sq)) fp32: Sq padded to a
    multiple of 4, since TMA needs 16-byte global strides (the padding is written as 0)."""
    return (sq + 3) // 4 * 4


def _bwd_inputs(shape, dtype, device, prep: str):
    """q, k, v, static, dout and the prep kernel's delta/lse2 (and zeroed dQ accumulator when
    prep == "prep") for timing a backward kernel alone."""
    q, k, v, static = _tune_inputs(shape, dtype, device)
    out, lse = torch.ops.tileops.flash_attn_with_lse(q, k, v, static["causal"])
    dout = torch.randn_like(out)
    B, S, H, D = q.shape
    delta = torch.empty(B, H, lse_rows(S), dtype=torch.float32, device=device)
    lse2 = torch.empty_like(delta)
    extra = (torch.empty(q.shape, dtype=torch.float32, device=device),) if prep == "prep" else ()
    _kernel(prep, dtype, device, D)(out, dout, lse, delta, lse2, *extra)
    return (q, k, v, dout, lse2, delta, *extra), static


def _bwd_runner(config, shape, dtype, device):
    args, static = _bwd_inputs(shape, dtype, device, "prep")  # (..., dq_acc zeroed by prep)
    kern = _compile("bwd", config, dtype, device, **static)
    dk, dv = torch.empty_like(args[1]), torch.empty_like(args[2])
    return lambda: kern(*args, dk, dv)


def _dq_runner(config, shape, dtype, device):
    args, static = _bwd_inputs(shape, dtype, device, "prep_nodq")
    kern = _compile("dq", config, dtype, device, **static)
    dq = torch.empty_like(args[0])
    return lambda: kern(*args, dq)


_PRESETS = {"default": [(8, 4096, 32, 32, 128, c) for c in (0, 1)] + [(16, 2048, 32, 32, 64, c) for c in (0, 1)]}
TUNABLES = {
    "fwd": tuning.Tunable("flash_attn", _PRESETS, DTYPES[1:], _tune_key("fwd"), _tune_space("fwd"), _tune_default("fwd"), _fwd_runner),
    "bwd": tuning.Tunable("flash_attn_backward", _PRESETS, DTYPES[1:], _tune_key("bwd"), _tune_space("bwd"), _tune_default("bwd"), _bwd_runner),
    # the deterministic backward's dQ kernel (torch.use_deterministic_algorithms(True))
    "dq": tuning.Tunable("flash_attn_backward_dq", _PRESETS, DTYPES[1:], _tune_key("dq"), _tune_space("dq"), _tune_default("dq"), _dq_runner),
}


def _qkv(t: torch.Tensor) -> torch.Tensor:
    """q, k or v as the kernels take it: any strides TMA can describe, as is (a view unbound from a
    packed QKV projection, SDPA's transposed layout: no copy); otherwise a compact copy.
    TMA needs the last dim contiguous, a 16-byte aligned base and every other stride a positive
    multiple of 16 bytes (8 fp16/bf16 elements); the kernels read strides as int32."""
    if t.is_contiguous() and not t.data_ptr() & 15 and t.stride(0) <= INT32_MAX:  # the common call
        return t
    s = t.stride()
    if s[3] == 1 and t.data_ptr() % 16 == 0 and all(0 < x <= INT32_MAX and x % 8 == 0 for x in s[:3]):
        return t
    return aligned16(t.contiguous())  # the copy (tests spy on aligned16 to see that none happens)


def _qkv3(q, k, v) -> tuple:
    """`_qkv` of each, with one test for the common call: all contiguous and 16-byte aligned,
    and int32 strides (a contiguous tensor's largest stride is below its numel)."""
    if (
        q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 and max(q.numel(), k.numel()) <= INT32_MAX
    ):
        return q, k, v
    return _qkv(q), _qkv(k), _qkv(v)


# ------------------------------------------------------------------------------------- forward
@custom_op("flash_attn_with_lse")
def flash_attn_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, softmax_scale: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_qkv(q, k, v, softmax_scale)
    out, lse = reference.flash_attn(q, k, v, causal, _scale(q, softmax_scale))
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _flash_fwd(q, k, v, causal, softmax_scale):
    """(out, lse); inference callers drop the lse (a scratch buffer, see _fwd_launch)."""
    _check_qkv(q, k, v, softmax_scale)
    return _fwd_launch(*_qkv3(q, k, v), causal, softmax_scale)


def _fwd_launch(q, k, v, causal, softmax_scale):
    """_flash_fwd over checked, kernel-ready q, k, v."""
    B, Sq, H, D = q.shape
    Sk, HK = k.shape[1], k.shape[2]
    # Allocation by integer sizes: parsing a torch.Size or tuple argument costs ~1 µs more per call.
    out = q.new_empty(B, Sq, H, D)
    # Inference writes the LSE too, into a scratch buffer: one compiled forward per key serves
    # training and inference (flash_fwd_kernel's docstring: why not its lse=False variant).
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0 or out.numel() == 0:  # nothing to attend to
        return out.zero_(), lse.fill_(float("-inf"))
    bucket = _length_bucket("fwd", causal, D, Sk if causal else Sq)
    _kernel("fwd", q.dtype, q.device, D, causal, H // HK, softmax_scale, bucket)(q, k, v, out, lse)
    return out, lse


@flash_attn_with_lse.register_kernel("cuda")
def _(q, k, v, causal=False, softmax_scale=None):
    return _flash_fwd(q, k, v, causal, softmax_scale)


@flash_attn_with_lse.register_fake
def _(q, k, v, causal=False, softmax_scale=None):
    _check_qkv(q, k, v, softmax_scale)
    B, Sq, H, D = q.shape
    return q.new_empty((B, Sq, H, D)), q.new_empty((B, H, Sq), dtype=torch.float32)


# ------------------------------------------------------------------------------------ backward
def _check_bwd(dout, q, k, v, out, lse, softmax_scale, dlse) -> None:
    _check_qkv(q, k, v, softmax_scale)
    _check_grad_args(dout, q, out, lse, dlse)


def _check_grad_args(dout, q, out, lse, dlse) -> None:
    """A backward's dout and out (q's dtype, shape and device), lse and dlse ((B, H, Sq) float32),
    q itself already checked."""
    qs, dt, dev = q.shape, q.dtype, q.device
    if (  # fast accept (what autograd passes), else the full check that names what is wrong
        dlse is None and dout.dtype is dt and out.dtype is dt and lse.dtype is torch.float32
        and dout.shape == qs and out.shape == qs and lse.shape == (qs[0], qs[2], qs[1])
        and dout.device == dev and out.device == dev and lse.device == dev
    ):
        return
    check_tensor("dout", dout, DTYPES, ndim=4, contiguous=False)
    check_tensor("out", out, DTYPES, ndim=4, contiguous=False)
    check_same(("q", "dout"), q, dout, shape=True)
    check_same(("q", "out"), q, out, shape=True)
    B, Sq, H, _ = q.shape
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is None:
            continue
        check_tensor(name, t, (torch.float32,), ndim=3, contiguous=False)
        check_same(("q", name), q, t, dtype=False)
        if tuple(t.shape) != (B, H, Sq):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != (batch, nheads, seqlen_q) = {(B, H, Sq)}")


@custom_op("flash_attn_backward")
def flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attn_with_lse: (dq, dk, dv) from dout (and dlse, the gradient of lse).

    On CUDA, with torch.are_deterministic_algorithms_enabled(), dq, dk and dv are bitwise identical
    run to run (same inputs, same device); by default dq is accumulated with fp32 atomics and may
    differ in the last bits (dk, dv are deterministic either way)."""
    _check_bwd(dout, q, k, v, out, lse, softmax_scale, dlse)
    grads = reference.flash_attn_backward(dout, q, k, v, out, lse, causal, _scale(q, softmax_scale), dlse)
    return tuple(g.contiguous() for g in grads)


@flash_attn_backward.register_kernel("cuda")
def _flash_bwd_cuda(dout, q, k, v, out, lse, causal=False, softmax_scale=None, dlse=None):
    _check_bwd(dout, q, k, v, out, lse, softmax_scale, dlse)
    B, Sq, H, D = q.shape
    _, Sk, HK, _ = k.shape
    dk, dv = k.new_empty(B, Sk, HK, D), k.new_empty(B, Sk, HK, D)  # every row written by the kernel
    if q.numel() == 0 or Sk == 0:
        return q.new_zeros(q.shape), dk.zero_(), dv.zero_()
    dev, dtype, groups = q.device, q.dtype, H // HK
    dout = ready(dout)
    q, k, v, out, lse = *_qkv3(q, k, v), ready(out), ready(lse)
    dq = q.new_empty(B, Sq, H, D)
    if dlse is None and _small_bwd(B, Sq, Sk, HK, groups, D, dev):  # one kernel, deterministic
        _kernel("bwd_small", dtype, dev, D, causal, groups, softmax_scale)(q, k, v, out, dout, lse, dq, dk, dv)
        return dq, dk, dv
    # The flag is read when the backward runs (it is not in the schema): eager calls and
    # torch.compile'd graphs follow the flag in force then; a captured CUDA graph keeps its path.
    # Deterministic: dK/dV from the main kernel without its dQ atomics (a GQA group already sums
    # inside one CTA), dQ from its own kernel, one CTA per query block summing its key blocks in a
    # fixed order; no fp32 dQ buffer and no cast, S and dP computed twice.
    det = _deterministic()
    if not det and dlse is None:  # the common call: preprocess, main kernel and dQ cast in one host call
        _bwd_fused("bwd_fused", dout, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv)
        return dq, dk, dv
    delta, lse2, dq_acc = _bwd_scratch(q, dq_acc=not det)
    bucket = _length_bucket("bwd", causal, D, Sk)  # the main kernel's default by length
    if det:
        _kernel("prep_nodq", dtype, dev, D)(out, dout, lse, delta, lse2)
    else:
        _kernel("prep", dtype, dev, D)(out, dout, lse, delta, lse2, dq_acc)
    if dlse is not None:  # d lse_i / d s_ij = P_ij, so dlse folds into Delta: dS = P (dP - (Delta - dlse))
        delta[:, :, :Sq].sub_(dlse)
    if det:
        _kernel("bwd_nodq", dtype, dev, D, causal, groups, softmax_scale, bucket)(q, k, v, dout, lse2, delta, dk, dv)
        _kernel("dq", dtype, dev, D, causal, groups, softmax_scale)(q, k, v, dout, lse2, delta, dq)
    else:
        _kernel("bwd", dtype, dev, D, causal, groups, softmax_scale, bucket)(q, k, v, dout, lse2, delta, dq_acc, dk, dv)
        _kernel("cast", dtype, dev)(dq_acc.view(-1), dq.view(-1))
    return dq, dk, dv


def _bwd_scratch(q: torch.Tensor, dq_acc: bool) -> tuple:
    """(Delta, lse2, the fp32 dQ accumulator or None): the backward's fp32 scratch as views of one
    allocation (a CUDA allocation costs a few us of host time, a view ~1). The accumulator (the
    reduce-add target, zeroed by the preprocess) first, then Delta and lse2, each
    (B, H, lse_rows(Sq)): every part a multiple of 4 floats, so each view is 16-byte aligned (TMA)."""
    B, Sq, H, D = q.shape
    rows = lse_rows(Sq)
    n_acc, n_row = (B * Sq * H * D if dq_acc else 0), B * H * rows
    work = torch.empty(n_acc + 2 * n_row, dtype=torch.float32, device=q.device)
    acc = work.as_strided((B, Sq, H, D), (Sq * H * D, H * D, D, 1)) if dq_acc else None
    delta = work.as_strided((B, H, rows), (H * rows, rows, 1), n_acc)
    lse2 = work.as_strided((B, H, rows), (H * rows, rows, 1), n_acc + n_row)
    return delta, lse2, acc


def _bwd_fused(name, dout, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv) -> None:
    """The default backward's one host call (kernel `name`: "bwd_fused", or "bwd_fused_packed":
    dq the packed (B, S, 3, H, D) gradient, dk/dv its slices), over kernel-ready inputs."""
    _, _, H, D = q.shape
    _, Sk, HK, _ = k.shape
    delta, lse2, dq_acc = _bwd_scratch(q, dq_acc=True)
    kern = _kernel(name, q.dtype, q.device, D, causal, H // HK, softmax_scale, _length_bucket("bwd", causal, D, Sk))
    kern(q, k, v, out, dout, lse, delta, lse2, dq_acc, dq, dk, dv)


@flash_attn_backward.register_fake
def _(dout, q, k, v, out, lse, causal=False, softmax_scale=None, dlse=None):
    _check_bwd(dout, q, k, v, out, lse, softmax_scale, dlse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------------------------ autograd
def _setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv = flash_attn_backward.from_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, dlse)
    return dq, dk, dv, None, None


flash_attn_with_lse.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- out-only op
# Its own op (not a composite that calls flash_attn_with_lse through the dispatcher again): one
# dispatch per inference call. With autograd recording, it runs flash_attn_with_lse, whose
# autograd saves the lse the backward needs; torch.compile traces it the same way.
@custom_op("flash_attn")
def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, softmax_scale: Optional[float] = None) -> torch.Tensor:
    _check_qkv(q, k, v, softmax_scale)
    return reference.flash_attn(q, k, v, causal, _scale(q, softmax_scale))[0].to(q.dtype).contiguous()


@flash_attn.register_kernel("cuda")
def _(q, k, v, causal=False, softmax_scale=None):
    # No gradient will be taken here (autograd routes those calls to flash_attn_with_lse): the
    # LSE goes to a scratch buffer (_fwd_launch).
    return _flash_fwd(q, k, v, causal, softmax_scale)[0]


@flash_attn.register_fake
def _(q, k, v, causal=False, softmax_scale=None):
    _check_qkv(q, k, v, softmax_scale)
    return q.new_empty(q.shape)


flash_attn.register_autograd_via(flash_attn_with_lse, 0)  # out of (out, lse)


# ------------------------------------------------------------------------------- packed QKV
# flash-attn's `flash_attn_qkvpacked_func` layout: one qkv (B, S, 3, H, D) in and, for the
# backward, one gradient out. The forward reads the three slices in place (strided views, the
# same kernels); the backward writes dq, dk and dv into the slices of one (B, S, 3, H, D) tensor.
# With q, k, v unbound from one QKV projection and passed to flash_attn, autograd stacks the
# three gradients afterwards (a copy of the whole gradient: 0.9 ms per step of GPT-2 small at
# 32 x 1024 tokens, docs/benchmarks.md); here there is nothing to stack. Self-attention only
# (Sq = Sk, nheads_kv = nheads), as flash-attn's.
def _packed_qkv(qkv) -> tuple:
    """qkv's three slices, kernel-ready. A contiguous, 16-byte aligned qkv with int32 strides has
    slices TMA reads as they are (strides and offsets multiples of D): one test instead of
    `_qkv`'s stride checks per slice (~3 µs each on the CPU machine)."""
    if qkv.is_contiguous() and not qkv.data_ptr() & 15 and qkv.numel() <= INT32_MAX:
        return qkv.unbind(2)
    return tuple(_qkv(t) for t in qkv.unbind(2))


def _check_qkvpacked(qkv, softmax_scale) -> None:
    s = qkv.shape
    if len(s) == 5 and qkv.dtype in DTYPES and s[2] == 3 and s[4] in HEADDIMS and softmax_scale is None:
        return  # fast accept; otherwise the full check that names what is wrong
    check_tensor("qkv", qkv, DTYPES, ndim=5, contiguous=False)
    if s[2] != 3:
        raise ValueError(f"qkv: shape {tuple(s)} needs 3 at dim 2: (batch, seqlen, 3, nheads, headdim)")
    if s[4] not in HEADDIMS:
        raise ValueError(f"qkv: head dim {s[4]} is not supported; supported: {', '.join(map(str, HEADDIMS))}")
    _check_scale(softmax_scale)


@custom_op("flash_attn_qkvpacked_with_lse")
def flash_attn_qkvpacked_with_lse(qkv: torch.Tensor, causal: bool = False, softmax_scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_qkvpacked(qkv, softmax_scale)
    q, k, v = qkv.unbind(2)
    out, lse = reference.flash_attn(q, k, v, causal, _scale(q, softmax_scale))
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


@flash_attn_qkvpacked_with_lse.register_kernel("cuda")
def _(qkv, causal=False, softmax_scale=None):
    _check_qkvpacked(qkv, softmax_scale)
    return _fwd_launch(*_packed_qkv(qkv), causal, softmax_scale)


@flash_attn_qkvpacked_with_lse.register_fake
def _(qkv, causal=False, softmax_scale=None):
    _check_qkvpacked(qkv, softmax_scale)
    B, S, _, H, D = qkv.shape
    return qkv.new_empty((B, S, H, D)), qkv.new_empty((B, H, S), dtype=torch.float32)


@custom_op("flash_attn_qkvpacked_backward")
def flash_attn_qkvpacked_backward(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    dlse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of flash_attn_qkvpacked_with_lse: dqkv (B, S, 3, H, D), determinism as
    flash_attn_backward's."""
    _check_qkvpacked(qkv, softmax_scale)
    q, k, v = qkv.unbind(2)
    _check_grad_args(dout, q, out, lse, dlse)
    return torch.stack(reference.flash_attn_backward(dout, q, k, v, out, lse, causal, _scale(q, softmax_scale), dlse), dim=2)


@flash_attn_qkvpacked_backward.register_kernel("cuda")
def _packed_bwd_cuda(dout, qkv, out, lse, causal=False, softmax_scale=None, dlse=None):
    _check_qkvpacked(qkv, softmax_scale)
    q, k, v = _packed_qkv(qkv)  # kernel-ready slices (copies only for a qkv TMA cannot read)
    _check_grad_args(dout, q, out, lse, dlse)  # q, k, v: slices of the checked qkv
    B, S, _, H, D = qkv.shape
    # The packed kernel needs int32 strides for the (B, S, 3, H, D) gradient; the deterministic
    # backward and a gradient through lse take flash_attn_backward's paths, then one stack.
    if dlse is not None or _deterministic() or qkv.numel() == 0 or S * 3 * H * D > INT32_MAX:
        return torch.stack(_flash_bwd_cuda(dout, q, k, v, out, lse, causal, softmax_scale, dlse), dim=2)
    dqkv = qkv.new_empty(B, S, 3, H, D)
    if _small_bwd(B, S, S, H, 1, D, qkv.device):  # one kernel, writing the three slices
        _kernel("bwd_small", q.dtype, q.device, D, causal, 1, softmax_scale)(q, k, v, ready(out), ready(dout), ready(lse), *dqkv.unbind(2))
        return dqkv
    # the kernel writes dq through the whole (B, S, 3, H, D) tensor (slice 0), dk and dv through their slices
    _bwd_fused("bwd_fused_packed", ready(dout), q, k, v, ready(out), ready(lse), causal, softmax_scale, dqkv, *dqkv.unbind(2)[1:])
    return dqkv


@flash_attn_qkvpacked_backward.register_fake
def _(dout, qkv, out, lse, causal=False, softmax_scale=None, dlse=None):
    _check_qkvpacked(qkv, softmax_scale)
    return qkv.new_empty(qkv.shape)


def _setup_packed(ctx, inputs, output):
    qkv, causal, softmax_scale = inputs
    ctx.save_for_backward(qkv, *output)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale


def _backward_packed(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    return flash_attn_qkvpacked_backward.from_backward(dout, qkv, out, lse, ctx.causal, ctx.softmax_scale, dlse), None, None


flash_attn_qkvpacked_with_lse.register_autograd(_backward_packed, setup_context=_setup_packed)


@custom_op("flash_attn_qkvpacked")
def flash_attn_qkvpacked(qkv: torch.Tensor, causal: bool = False, softmax_scale: Optional[float] = None) -> torch.Tensor:
    _check_qkvpacked(qkv, softmax_scale)
    q, k, v = qkv.unbind(2)
    return reference.flash_attn(q, k, v, causal, _scale(q, softmax_scale))[0].to(q.dtype).contiguous()


@flash_attn_qkvpacked.register_kernel("cuda")
def _(qkv, causal=False, softmax_scale=None):
    _check_qkvpacked(qkv, softmax_scale)
    return _fwd_launch(*_packed_qkv(qkv), causal, softmax_scale)[0]  # no grad here: the LSE is scratch


@flash_attn_qkvpacked.register_fake
def _(qkv, causal=False, softmax_scale=None):
    _check_qkvpacked(qkv, softmax_scale)
    B, S, _, H, D = qkv.shape
    return qkv.new_empty((B, S, H, D))


flash_attn_qkvpacked.register_autograd_via(flash_attn_qkvpacked_with_lse, 0)
