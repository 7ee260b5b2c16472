"""Argument validation and input preparation shared by every op.

Validation raises clear Python exceptions, naming the argument, before anything launches.
"""
from __future__ import annotations

import torch

# torch dtype -> TileLang dtype name, for every dtype any kernel takes.
TL_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
INT32_MAX = 2**31 - 1  # kernels index with int32 where the generated code allows it


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when its data pointer is not 16-byte aligned.

    Kernels issue 16-byte vector loads and TMA needs 16-byte aligned bases; a contiguous view with
    an odd storage offset (``x[1:]``) would fault.
    """
    return t if t.data_ptr() % 16 == 0 else t.clone()


def ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, as TileLang kernels take it: `t` itself in the common case."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else aligned16(t.contiguous())


def check_rows(m: int, name: str = "x") -> None:
    """Row-wise kernels (softmax, layer_norm) index rows with int32."""
    if m > INT32_MAX:
        raise ValueError(f"{name}: {m} rows exceed the kernel's int32 row index range ({INT32_MAX}); split the batch")


def check_activation(activation: str) -> None:
    from ..reference import ACTIVATIONS

    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")


def check_tensor(name: str, t, dtypes=None, ndim=None, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported; supported: {supported}")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        want = f"{ndim}-D" if isinstance(ndim, int) else " or ".join(f"{n}-D" for n in ndim)
        raise ValueError(f"{name}: expected {want} tensor, got {t.dim()}-D with shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name}: non-contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()}) is not supported; "
            f"call .contiguous() first"
        )


def check_same(names: tuple[str, str], a: torch.Tensor, b: torch.Tensor, *, device=True, dtype=True, shape=False) -> None:
    n1, n2 = names
    if device and a.device != b.device:
        raise ValueError(f"{n2}: on device {b.device} but {n1} is on {a.device}; all inputs must be on one device")
    if dtype and a.dtype != b.dtype:
        raise TypeError(f"{n2}: dtype {b.dtype} differs from {n1}'s {a.dtype}; pass both in one dtype")
    if shape and a.shape != b.shape:
        raise ValueError(f"{n2}: shape {tuple(b.shape)} differs from {n1}'s {tuple(a.shape)}; broadcasting is not supported")
