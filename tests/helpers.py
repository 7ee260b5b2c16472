"""Test helpers: poisoned outputs and error measures shared by every op's tests."""
from __future__ import annotations

import contextlib
import os
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none here: GPU tests run on the H200 host)")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@contextlib.contextmanager
def poisoned_cuda_allocation(nbytes: int):
    """Make the next CUDA allocation of `nbytes` reuse a block filled with NaN bytes (0xFF).

    The caching allocator hands a freed block back to the next request of the same size, so an
    op output that the kernel fails to write keeps NaNs and fails the comparison. Yields the
    poisoned pointer so a test can assert the poison actually reached the output.
    """
    torch.cuda.synchronize()
    # no other free block of this size in the cache: the allocator's best fit would tie (a test's
    # earlier tensors of the same size) and could hand the output an unpoisoned one
    torch.cuda.empty_cache()
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xFF)  # 0xFF.. is NaN in every float type
    ptr = buf.data_ptr()
    del buf
    yield ptr


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN propagates, so NaN never passes)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class RecordOps(TorchDispatchMode):
    """Records the name of every op dispatched while active (``"tileops.add.default"``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def tileops(self) -> list[str]:
        """Our ops among them, by short name (``"flash_attn_with_lse"``): proof a path ran them."""
        return [name.split(".")[1] for name in self.ops if name.startswith("tileops.")]


ROOT = pathlib.Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a child Python that imports this checkout. ROOT goes in front of the
    PYTHONPATH already set, which stays: the GPU host's bundle makes tilelang importable there."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)
