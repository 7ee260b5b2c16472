"""torch.compile over a GPT block built from our modules: no graph break, forward and backward,
and at most one recompile across five sequence lengths (symbolic lengths through our fakes).

On the CPU the ops run their reference path; on CUDA (marked gpu) our kernels run inside the
compiled graph. The backend is aot_eager: it traces forward and backward through AOTAutograd
(where our fake and autograd registrations matter) without inductor's C++ build time.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tilelang_ops
from .helpers import DEVICES, rel_err


class Block(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # qkv on the "cublas" backend (an autograd.Function around aten's GEMMs, our bias gradient)
        self.qkv, self.proj = tilelang_ops.nn.Linear(dim, 3 * dim, backend="cublas"), nn.Linear(dim, dim)
        self.up = tilelang_ops.nn.Linear(dim, 4 * dim, activation="gelu_tanh")
        self.down = tilelang_ops.nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, C // self.heads).unbind(2)
        x = x + self.proj(tilelang_ops.flash_attn(q, k, v, causal=True).reshape(B, S, C))
        return x + self.down(self.up(self.ln2(x)))


class _CountingBackend:
    """aot_eager that counts the graphs Dynamo hands it (= compilations)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_five_lengths_compile_at_most_twice_without_graph_breaks(device):
    torch._dynamo.reset()
    dtype = torch.bfloat16
    model = Block().to(device, dtype)
    backend = _CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break would raise
    for seq in (17, 64, 100, 128, 257):
        x = torch.randn(2, seq, 128, device=device, dtype=dtype, requires_grad=True)
        out = compiled(x)
        out.float().square().mean().backward()
        # same weights, eager: the compiled graph computes the same thing
        x_ref = x.detach().clone().requires_grad_()
        ref = model(x_ref)
        assert rel_err(out, ref) < 1e-2, seq
        ref.float().square().mean().backward()
        assert rel_err(x.grad, x_ref.grad) < 2e-2, seq
    # the first length compiles with static shapes, the second marks the length dynamic; the
    # remaining three reuse that graph
    assert backend.graphs <= 2, f"{backend.graphs} compilations for 5 lengths"
    print(f"graphs compiled for 5 lengths: {backend.graphs}")
    torch._dynamo.reset()
