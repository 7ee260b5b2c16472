"""Targets, compilation and kernel caches. Knows TileLang, not torch.library.

A kernel is identified by (family, config, static args, target). Compiled kernels live in a
thread-safe in-memory dict for the life of the process; TileLang's own disk cache
(`TILELANG_CACHE_DIR`, default `~/.tilelang/cache`) keys on the printed TIR, target and flags, so
a second process loads the cubin and host wrapper instead of running nvcc again.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any, Callable

_LOCK = threading.Lock()
_COMPILED: dict[tuple, Any] = {}
_ARCH_BY_DEVICE: dict[int, str] = {}
_SMS_BY_DEVICE: dict[int, int] = {}
_NAME_BY_DEVICE: dict[int, str] = {}


def _tilelang():
    # Imported lazily: it costs ~2 s and is not needed on the CPU path or for fake tensors.
    import tilelang

    return tilelang


_POSTPROC = "tilelang_callback_cuda_postproc"  # TileLang's process-wide hook on generated CUDA


def _compile_rewritten(tl, rewrite: Callable[[str], str], **kwargs):
    """tl.compile with `rewrite` applied to the generated CUDA source (after any hook the user
    installed), the previous hook restored afterwards (a pass-through if there was none)."""
    import tvm_ffi

    prev = tvm_ffi.get_global_func(_POSTPROC, allow_missing=True)
    tl.register_cuda_postproc(lambda code, target: rewrite(prev(code, target) if prev is not None else code))
    try:
        return tl.compile(**kwargs)
    finally:
        tl.register_cuda_postproc(prev if prev is not None else (lambda code, target: code))


_TID_GE = r"(\d+) <= \(\(int\)threadIdx\.x\)"
_TID_LT = r"\(\(int\)threadIdx\.x\) < (\d+)"
_WS_TEST = re.compile(f"{_TID_GE}|{_TID_LT}")
_WS_IF = re.compile(f"^  if \\((?:{_TID_GE}|{_TID_LT}|\\({_TID_GE}\\) && \\({_TID_LT}\\))\\) \\{{$", re.M)
UNIFORM_WS_FLAG = "-DTILEOPS_UNIFORM_WS"  # in the compile flags: a cache key of its own


def uniform_warpgroups(code: str) -> str:
    """Warp-specialized CUDA source with its role branches on a warp-uniform index.

    TileLang branches warpgroup roles on threadIdx.x (`if (256 <= ((int)threadIdx.x))`), which
    ptxas cannot prove uniform within a warp: everything under the branch (wgmma descriptors,
    stage indices, loop counters) is computed per thread in vector registers and each descriptor
    moved to uniform registers by R2UR before every wgmma. With the warp index broadcast from
    lane 0 (`__shfl_sync`, as CUTLASS's canonical_warp_idx_sync), the branches are uniform and
    ptxas keeps that arithmetic on the uniform datapath. Only thresholds that are multiples of 32
    (warp boundaries) are rewritten, so each test keeps its value; `threadIdx.x >> 5` and `>> 7`
    (the warp and the warpgroup) become the broadcast index too."""
    # a source may hold several kernels: each its own index, declared before its first role branch
    return _each_kernel(code, _uniform_kernel)


def _each_kernel(code: str, rewrite: Callable[[str], str]) -> str:
    """`rewrite` applied to each `__global__` function of a source on its own (one source may hold
    several kernels: a backward's preprocess, main kernel and cast)."""
    return "".join(rewrite(p) for p in re.split(r'(?m)^(?=extern "C" __global__)', code))


def _uniform_kernel(code: str) -> str:
    first = _WS_IF.search(code)
    if first is None:
        return code
    head, body = code[: first.start()], code[first.start():]

    def branch(m):
        line = m.group(0)
        if any(int(t.group(1) or t.group(2)) % 32 for t in _WS_TEST.finditer(line)):
            return line  # a threshold inside a warp: the test is not warp-uniform
        return _WS_TEST.sub(lambda t: f"{int(t.group(1)) // 32} <= tl_warp" if t.group(1) else f"tl_warp < {int(t.group(2)) // 32}", line)

    body = _WS_IF.sub(branch, body).replace("(((int)threadIdx.x) >> 7)", "(tl_warp >> 2)").replace("(((int)threadIdx.x) >> 5)", "tl_warp")
    return head + "  const int tl_warp = __shfl_sync(0xffffffffu, ((int)threadIdx.x) >> 5, 0);\n" + body


# TileLang's reduce (T.reduce_max / T.reduce_sum over a fragment's rows) folds each thread's
# values of a row in one serial, unrolled loop: `acc = max(acc, x[f(rv)])` / `acc = (acc + x[f(rv)])`.
_SERIAL_REDUCE = re.compile(
    r"(?P<ind>[ ]*)#pragma unroll\n(?P=ind)for \(int (?P<rv>rv\w*) = 0; (?P=rv) < (?P<n>\d+); \+\+(?P=rv)\) \{\n"
    r"[ ]*(?P<acc>\w+\[\w+\]) = (?:max\((?P=acc), (?P<max>.+)\)|\((?P=acc) \+ (?P<sum>.+)\));\n"
    r"(?P=ind)\}\n"
)


def tree_reductions(code: str, ways: int) -> str:
    """CUDA source whose per-thread row reductions run as `ways` interleaved chains.

    The serial loop is one dependence chain (in the attention forward at 128 keys, 32 FMNMX or
    FADD per row and step, each waiting for the last); split over `ways` accumulators (element
    rv into chain rv % ways) and combined pairwise at the end, it has the same instruction count
    and a chain ~ways times shorter. A sum's rounding order changes (fp32; a max is exact).
    Loops of fewer than 2 * ways elements stay as they are."""
    assert ways >= 2 and ways & (ways - 1) == 0, "ways: a power of two >= 2"

    def split(m):
        n, rv, acc, ind = int(m.group("n")), m.group("rv"), m.group("acc"), m.group("ind")
        if n < 2 * ways:
            return m.group(0)
        is_max = m.group("max") is not None
        expr = m.group("max") if is_max else m.group("sum")
        op = (lambda a, b: f"max({a}, {b})") if is_max else (lambda a, b: f"({a} + {b})")
        # chain k starts from element k (chain 0 from acc as well): no identity to fold in
        first = [re.sub(rf"\b{rv}\b", str(k), expr) for k in range(ways)]
        init = ", ".join([op(acc, first[0])] + first[1:])
        parts = [f"tl_acc[{k}]" for k in range(ways)]
        while len(parts) > 1:  # pairwise: chain k with chain k + half
            half = len(parts) // 2
            parts = [op(parts[k], parts[k + half]) for k in range(half)]
        return (
            f"{ind}{{  // tileops: {ways} chains (runtime.tree_reductions)\n"
            f"{ind}  float tl_acc[{ways}] = {{{init}}};\n"
            f"{ind}  #pragma unroll\n"
            f"{ind}  for (int {rv} = {ways}; {rv} < {n}; ++{rv}) {{\n"
            f"{ind}    tl_acc[{rv} % {ways}] = {op(f'tl_acc[{rv} % {ways}]', expr)};\n"
            f"{ind}  }}\n"
            f"{ind}  {acc} = {parts[0]};\n"
            f"{ind}}}\n"
        )

    return _SERIAL_REDUCE.sub(split, code)


_SUM_ALLREDUCE = re.compile(r"^\s*(\w+)\[\w+\] = tl::AllReduce<tl::SumOp\b")
_DYN_SHMEM = "extern __shared__ __align__(1024) uchar buf_dyn_shmem[];"


def pin_wgmma_waits(code: str) -> str:
    """CUDA source in which a `wgmma.wait_group 0` that follows a softmax stays after it.

    The async attention forward issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j
    only, computes step j's softmax while P V runs, and then waits for everything. ptxas's
    scheduler may hoist that last wait (and the mbarrier arrive after it) from after the softmax
    to the top of its basic block, where the warpgroup then idles until P V is done and the
    overlap is gone: the D=64 causal default's SASS has `WARPGROUP.DEPBAR.LE gsb0, 0x0` before its
    66 exps (the D=128 causal 128 x 176 one too; the 128 x 128 one not). Nothing in the softmax
    depends on the wait, so nothing stops the move. A shared-memory store of the row sums just
    before the wait does: memory operations keep their order with the wait, and the store needs
    every exponential. Volatile, or nvcc deletes it (the scratch array `tl_pin` is never read);
    each thread stores to its own word (4 bytes a thread), so no two threads touch one address."""
    return _each_kernel(code, _pin_kernel)


def _pin_kernel(code: str) -> str:
    if _DYN_SHMEM not in code:
        return code
    lines = code.split("\n")
    out, pinned, sums = [], False, None
    for line in lines:
        m = _SUM_ALLREDUCE.match(line)
        if m:
            sums = m.group(1)
        if line.strip() == "tl::wait_wgmma<0>();" and sums is not None:
            size = re.search(rf"\bfloat {sums}\[(\d+)\];", code)
            n = int(size.group(1)) if size else 1
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}((volatile float*)tl_pin)[threadIdx.x] = {' + '.join(f'{sums}[{k}]' for k in range(n))};  // tileops: keeps the wait here (runtime.pin_wgmma_waits)")
            pinned = True
        if "tl::wait_wgmma<" in line:
            sums = None
        out.append(line)
    if not pinned:
        return code
    threads = re.search(r"__launch_bounds__\((\d+)", code)
    decl = f"  __shared__ float tl_pin[{threads.group(1) if threads else 1024}];"
    return "\n".join(out).replace(_DYN_SHMEM, _DYN_SHMEM + "\n" + decl, 1)


def arch_for_capability(major: int, minor: int) -> str:
    """CUDA arch string TileLang should target. Hopper needs the `a` suffix for wgmma/setmaxnreg."""
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def _device_index(device) -> int:
    """CUDA device index of an index or torch.device (no index: the current device)."""
    if isinstance(device, int):
        return device
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def arch_for_device(device) -> str:
    """Arch of a CUDA device (index or torch.device), cached per device index."""
    index = _device_index(device)
    arch = _ARCH_BY_DEVICE.get(index)
    if arch is None:
        import torch

        arch = _ARCH_BY_DEVICE[index] = arch_for_capability(*torch.cuda.get_device_capability(index))
    return arch


def default_arch() -> str:
    """The current CUDA device's arch, or sm_90a (the target) on a machine without one: what the
    tuner's search spaces and default tables are built for."""
    import torch

    return arch_for_device(torch.cuda.current_device()) if torch.cuda.is_available() else "sm_90a"


def device_name(device) -> str:
    """torch's name of a CUDA device (index or torch.device), cached per index: the key of the
    per-board default tables (an H100 SXM and an H200 share sm_90a and 132 SMs, not their winners)."""
    index = _device_index(device)
    name = _NAME_BY_DEVICE.get(index)
    if name is None:
        import torch

        name = _NAME_BY_DEVICE[index] = torch.cuda.get_device_name(index)
    return name


def default_board() -> str | None:
    """The current CUDA device's name, or None on a machine without one."""
    import torch

    return device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None


def on_device(device):
    """A context in which `device` (a CUDA index, torch.device or "cuda:1") is the current device:
    the default tables read the current device's board, arch and SM count, and must answer for the
    call's device on a host with two kinds of GPU. No index (or no CUDA): the current device, unchanged."""
    import contextlib

    import torch

    index = device if isinstance(device, int) else torch.device(device).index
    return torch.cuda.device(index) if index is not None and torch.cuda.is_available() else contextlib.nullcontext()


def sm_of(arch: str) -> int:
    """The SM number of an arch string: "sm_90a" -> 90, "sm_100a" -> 100."""
    return int("".join(ch for ch in arch[3:] if ch.isdigit()))


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (index or torch.device), cached per index: the
    grid of the persistent GEMM."""
    index = _device_index(device)
    n = _SMS_BY_DEVICE.get(index)
    if n is None:
        import torch

        n = _SMS_BY_DEVICE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


# Hopper warp specialization: a 128-thread TMA producer warpgroup beside the consumers.
# Pass configs of a hand-synchronized producer/consumer pipeline (mbarriers and named barriers
# order its threads): TileLang's storage-sync pass would add CTA-wide __syncthreads inside the
# producer/consumer branches, which deadlock (the producer never reaches the consumers' barrier),
# and the buffer-init check cannot see T.tma_copy's writes to the stages.
HAND_SYNC_PASS_CONFIGS = {"tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True}
PRODUCER_REGS = 24  # setmaxnreg of the producer warpgroup (TileLang's own choice)
# A persistent kernel's grid by default (its `ctas` static; ops pass the device's SM count): one
# CTA per SM of an H100 SXM / H200.
PERSISTENT_CTAS = 132


def warpgroup_regs(threads: int, min_blocks: int = 1) -> int:
    """Consumer registers per thread for setmaxnreg when `min_blocks` CTAs of `threads` consumers
    plus the 128-thread producer share an SM: ptxas gives each thread 64K / (CTA threads ×
    min_blocks) registers at launch (in steps of 8), and the producer's 24 plus the consumers'
    budget must fit in that CTA allocation, or setmaxnreg.inc waits forever (threads=256,
    min_blocks=2: 80 at launch, 104 for the consumers)."""
    total = threads + 128
    launch = min(65536 // (total * min_blocks), 255) // 8 * 8
    return min((launch * total - PRODUCER_REGS * 128) // threads // 8 * 8, 240)


def config_str(config) -> str:
    """Canonical name of a config dataclass: `block1024_threads256`. Names kernels in every cache.
    A field added later with `metadata={"omit_default": True}` is named only when it differs from
    its default, so the kernels that existed before it keep their names."""
    return "_".join(
        f"{f.name.replace('_', '')}{getattr(config, f.name)}"
        for f in dataclasses.fields(config)
        if not (f.metadata.get("omit_default") and getattr(config, f.name) == f.default)
    )


def source_rewrites(config) -> list:
    """(rewrite of the generated CUDA, compile flag naming it) pairs a config asks for:
    `uniform_ws` (uniform_warpgroups), `pin_waits` (pin_wgmma_waits), `tree_reduce` = ways
    (tree_reductions), applied in that order."""
    out = []
    if getattr(config, "uniform_ws", False):
        out.append((uniform_warpgroups, UNIFORM_WS_FLAG))
    if getattr(config, "pin_waits", False):
        out.append((pin_wgmma_waits, "-DTILEOPS_PIN_WAITS"))
    ways = getattr(config, "tree_reduce", 0)
    if ways:
        out.append((lambda code: tree_reductions(code, ways), f"-DTILEOPS_TREE_REDUCE={ways}"))
    return out


@dataclasses.dataclass(frozen=True)
class KernelDef:
    """A TileLang kernel family member: `build(config, **static) -> PrimFunc`."""

    family: str
    name: str
    build: Callable[..., Any]
    pass_configs: tuple[tuple[str, Any], ...] = ()
    min_sm: int = 0  # e.g. 90: uses Hopper-only features (thread-block clusters); no sm_80 build
    # (config, **static) -> extra pass configs, for a schedule whose needs depend on the shape
    static_pass_configs: Callable[..., dict] | None = None

    def compile(self, config, arch: str, **static):
        """Compiled kernel for (config, static, arch); compiles at most once per process."""
        key = (self.family, self.name, config, tuple(sorted(static.items())), arch)
        kernel = _COMPILED.get(key)
        if kernel is not None:
            return kernel
        with _LOCK:  # one compile per key even when threads race
            kernel = _COMPILED.get(key)
            if kernel is None:
                args = dict(func=self.build(config, **static), target={"kind": "cuda", "arch": arch},
                            pass_configs=self.pass_configs_for(config, **static) or None)
                rewrites = source_rewrites(config)
                if rewrites:
                    # the flags give the rewritten kernel a disk-cache key of its own
                    def rewrite(code):
                        for fn, _ in rewrites:
                            code = fn(code)
                        return code

                    kernel = _compile_rewritten(_tilelang(), rewrite, compile_flags=[flag for _, flag in rewrites], **args)
                else:
                    kernel = _tilelang().compile(**args)
                _COMPILED[key] = kernel
        return kernel

    def pass_configs_for(self, config, **static) -> dict:
        """The family's pass configs plus what the schedule itself needs (a config dataclass may
        define `pass_configs()`: e.g. a hand-synchronized pipeline turns TileLang's sync pass off)
        and what the shape needs (`static_pass_configs`)."""
        extra = getattr(config, "pass_configs", None)
        shaped = self.static_pass_configs(config, **static) if self.static_pass_configs else {}
        return {**dict(self.pass_configs), **(extra() if extra else {}), **shaped}

    def min_sm_for(self, config) -> int:
        """Oldest SM the kernel builds for with this config: the family's floor, raised by a
        config whose schedule is newer (a config dataclass may define `min_sm`)."""
        return max(self.min_sm, getattr(config, "min_sm", 0))

    def source(self, config, arch: str, **static) -> str:
        return self.compile(config, arch, **static).get_kernel_source()


def kernel(family: str, name: str | None = None, pass_configs=None, min_sm: int = 0, static_pass_configs=None):
    """Decorator turning a PrimFunc builder into a KernelDef.

    Kernels take every buffer, outputs included, as parameters (no TileLang `out_idx`): the op
    allocates outputs, so a test can hand a kernel a poisoned buffer and `launcher` applies.
    """

    def wrap(build):
        return KernelDef(family, name or build.__name__, build, tuple(sorted((pass_configs or {}).items())), min_sm, static_pass_configs)

    return wrap


def launcher(compiled) -> Callable[..., None]:
    """The compiled host function of a kernel: call it with every buffer, outputs included.

    `JITKernel.__call__` works out devices and output shapes in Python on every call before it
    reaches this function; the function itself (tvm_ffi, C) checks the dtype, shape, strides and
    device of each argument, takes torch's current stream and launches. Ops keep it in their
    per-key caches so a call pays only the C part.
    """
    ex = compiled.adapter._get_executable()
    # A fresh compile gives a runtime Module; a disk-cache load gives an Executable whose
    # jit() links (once) and returns that Module.
    return recordable((ex.jit() if hasattr(ex, "jit") else ex).main)


def recordable(fn) -> Callable[..., None]:
    """`fn` (a tvm_ffi Function: a kernel's host function) as ops call it: seen by the C++ call
    path's recorder while it records a call (fastpath.py), else called as it is."""
    from . import fastpath

    def launch(*args):
        # The C++ call path's recorder sees every launch of the call it records (fastpath.py).
        rec = fastpath._recording
        if rec is not None:
            rec.launch(fn, args)
        return fn(*args)

    return launch


def compiled_count() -> int:
    return len(_COMPILED)


def tilelang_version() -> str:
    from importlib.metadata import version

    return version("tilelang")
