"""Targets, compilation and kernel caches. Knows TileLang, not torch.library.

A kernel is identified by (family, config, static args, target). Compiled kernels live in a
thread-safe in-memory dict for the life of the process; TileLang's own disk cache
(`TILELANG_CACHE_DIR`, default `~/.tilelang/cache`) keys on the printed TIR, target and flags, so
a second process loads the cubin and host wrapper instead of running nvcc again.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

_LOCK = threading.Lock()
_COMPILED: dict[tuple, Any] = {}
_ARCH_BY_DEVICE: dict[int, str] = {}
_SMS_BY_DEVICE: dict[int, int] = {}


def _tilelang():
    # Imported lazily: it costs ~2 s and is not needed on the CPU path or for fake tensors.
    import tilelang

    return tilelang


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


@dataclasses.dataclass(frozen=True)
class KernelDef:
    """A TileLang kernel family member: `build(config, **static) -> PrimFunc`."""

    family: str
    name: str
    build: Callable[..., Any]
    pass_configs: tuple[tuple[str, Any], ...] = ()
    min_sm: int = 0  # e.g. 90: uses Hopper-only features (thread-block clusters); no sm_80 build

    def compile(self, config, arch: str, **static):
        """Compiled kernel for (config, static, arch); compiles at most once per process."""
        key = (self.family, self.name, config, tuple(sorted(static.items())), arch)
        kernel = _COMPILED.get(key)
        if kernel is not None:
            return kernel
        with _LOCK:  # one compile per key even when threads race
            kernel = _COMPILED.get(key)
            if kernel is None:
                kernel = _tilelang().compile(
                    self.build(config, **static),
                    target={"kind": "cuda", "arch": arch},
                    pass_configs=self.pass_configs_for(config) or None,
                )
                _COMPILED[key] = kernel
        return kernel

    def pass_configs_for(self, config) -> dict:
        """The family's pass configs plus what the schedule itself needs (a config dataclass may
        define `pass_configs()`: e.g. a hand-synchronized pipeline turns TileLang's sync pass off)."""
        extra = getattr(config, "pass_configs", None)
        return {**dict(self.pass_configs), **(extra() if extra else {})}

    def min_sm_for(self, config) -> int:
        """Oldest SM the kernel builds for with this config: the family's floor, raised by a
        config whose schedule is newer (a config dataclass may define `min_sm`)."""
        return max(self.min_sm, getattr(config, "min_sm", 0))

    def source(self, config, arch: str, **static) -> str:
        return self.compile(config, arch, **static).get_kernel_source()


def kernel(family: str, name: str | None = None, pass_configs=None, min_sm: int = 0):
    """Decorator turning a PrimFunc builder into a KernelDef.

    Kernels take every buffer, outputs included, as parameters (no TileLang `out_idx`): the op
    allocates outputs, so a test can hand a kernel a poisoned buffer and `launcher` applies.
    """

    def wrap(build):
        return KernelDef(family, name or build.__name__, build, tuple(sorted((pass_configs or {}).items())), min_sm)

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
    return (ex.jit() if hasattr(ex, "jit") else ex).main


def compiled_count() -> int:
    return len(_COMPILED)


def tilelang_version() -> str:
    from importlib.metadata import version

    return version("tilelang")
