"""torch.ops.tileops.add: the smallest real op, carried through every layer of the library.

Reading order: validation → kernel resolution → op (CPU reference) → CUDA impl → fake → autograd →
public function.
"""
from __future__ import annotations

import torch

from .. import reference, runtime, tuning
from .._library import custom_op
from ._checks import INT32_MAX, TL_DTYPE, aligned16, check_same, check_tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_add(a, b) -> None:
    if (
        a.dtype in DTYPES and b.dtype is a.dtype and a.shape == b.shape and a.device == b.device
        and a.is_contiguous() and b.is_contiguous() and a.numel() <= INT32_MAX
    ):
        return  # fast accept; otherwise the full check names what is wrong
    check_tensor("a", a, DTYPES)
    check_tensor("b", b, DTYPES)
    check_same(("a", "b"), a, b, shape=True)
    if a.numel() > INT32_MAX:
        raise ValueError(f"a: {a.numel()} elements exceed the kernel's int32 index range ({INT32_MAX})")


# (dtype, device index, bucket) -> compiled kernel. Resolved once, so a call is a dict lookup and a launch.
_kernels: dict[tuple, object] = {}

# Two tuning buckets: up to 2^22 elements a call is short enough (tens of µs) for the last wave and
# the launch to weigh, beyond it the kernel is a steady DRAM stream. A config tuned at one length
# then never overwrites the other's.
SHORT = 1 << 22


def _bucket(n: int) -> str:
    return "n<=4M" if n <= SHORT else "n>4M"


def _compile_add(config, dtype: torch.dtype, device: torch.device):
    from ..kernels import elementwise as K

    return K.add_kernel.compile(config, runtime.arch_for_device(device), dtype=TL_DTYPE[dtype])


def _add_kernel(dtype: torch.dtype, device: torch.device, n: int):
    key = (dtype, device.index, _bucket(n))
    k = _kernels.get(key)
    if k is None:
        config = tuning.resolve_config(TUNABLE, (n,), dtype, device)
        k = _kernels[key] = runtime.launcher(_compile_add(config, dtype, device))
    return k


def _add_runner(config, shape, dtype, device):
    kern = _compile_add(config, dtype, device)
    a, b = torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)
    out = torch.empty_like(a)
    return lambda: kern(a, b, out)


def _add_default(shape, dtype):
    from ..kernels import elementwise as K

    return K.default_config(TL_DTYPE[dtype])


def _add_space(shape, dtype):
    from ..kernels import elementwise as K

    return K.SEARCH_SPACE


TUNABLE = tuning.Tunable(
    op="add",
    presets={"default": [(1 << 22,), (1 << 26,)]},
    dtypes=DTYPES,
    key=lambda shape, dtype, device: ({}, _bucket(shape[0])),
    search_space=_add_space,
    default=_add_default,
    runner=_add_runner,
)


@custom_op("add")
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_add(a, b)
    return reference.add(a, b)


@add.register_kernel("cuda")
def _(a, b):
    _check_add(a, b)
    out = torch.empty_like(a)
    if a.numel() == 0:
        return out
    if a.dim() == 1:  # skip three view() calls (~1 µs each) on the common flat case
        _add_kernel(a.dtype, a.device, a.numel())(aligned16(a), aligned16(b), out)
    else:
        _add_kernel(a.dtype, a.device, a.numel())(aligned16(a).view(-1), aligned16(b).view(-1), out.view(-1))
    return out


@add.register_fake
def _(a, b):
    _check_add(a, b)
    return torch.empty_like(a)


def _add_backward(ctx, grad):
    return grad, grad


add.register_autograd(_add_backward)
