"""Op layer: schemas, validation, CUDA/CPU impls, fakes and autograd. No TileLang syntax here.

`ALL_OPS` lists, per op, how `tileops check` exercises it: a few shapes, the dtypes, an input
maker and the reference. A new op adds one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import reference
from . import elementwise


@dataclass(frozen=True)
class OpCase:
    name: str
    op: Callable
    make_inputs: Callable[[tuple, torch.dtype, torch.device], tuple]
    reference: Callable
    shapes: tuple
    dtypes: tuple
    atol: dict
    rtol: dict


def _two_randn(shape, dtype, device):
    return (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))


ALL_OPS = [
    OpCase(
        "add",
        torch.ops.tileops.add,
        _two_randn,
        lambda a, b: a.double() + b.double(),
        shapes=((1,), (17,), (1000, 4097), (8, 1024, 1024)),
        dtypes=elementwise.DTYPES,
        atol=reference.ELEMENTWISE_ATOL,
        rtol=reference.ELEMENTWISE_RTOL,
    ),
]


# What `tileops tune` can tune, by op name.
TUNABLES = {t.op: t for t in [elementwise.TUNABLE]}

# Kernel families whose REPRESENTATIVE lists `tileops export` / `tileops check` compile.
KERNEL_FAMILIES = ["elementwise"]


def all_kernels():
    """(KernelDef, config, static) for every shipped kernel at its representative configs."""
    import importlib

    return [entry for fam in KERNEL_FAMILIES for entry in importlib.import_module(f"tilelang_ops.kernels.{fam}").REPRESENTATIVE]
