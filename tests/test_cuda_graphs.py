"""Every op in ALL_OPS is capturable: a CUDA graph replay on refreshed inputs matches eager."""
from __future__ import annotations

import pytest
import torch

from tilelang_ops.ops import ALL_OPS

from .helpers import requires_cuda


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ALL_OPS, ids=[c.name for c in ALL_OPS])
def test_graph_capture_and_replay_match_eager(case):
    shape = case.shapes[min(1, len(case.shapes) - 1)]  # a non-trivial but small shape
    dtype = case.dtypes[-1]
    inputs = case.make_inputs(shape, dtype, torch.device("cuda"))
    case.op(*inputs)  # compile and warm outside capture (the first call builds host state)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        case.op(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.op(*inputs)
    fresh = case.make_inputs(shape, dtype, torch.device("cuda"))
    for dst, src in zip(inputs, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    expected = case.op(*inputs)
    outs = captured if isinstance(captured, tuple) else (captured,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    for o, e in zip(outs, exps):
        torch.testing.assert_close(o, e, atol=0, rtol=0, equal_nan=True)  # same kernel, same inputs: same bits


@pytest.mark.gpu
@requires_cuda
def test_torch_compile_reduce_overhead_over_our_modules():
    """mode="reduce-overhead" (CUDA graphs via cudagraph trees) over a model built from our modules."""
    import tilelang_ops

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        tilelang_ops.nn.Linear(256, 512, activation="gelu_tanh"),
        tilelang_ops.nn.Linear(512, 256),
        tilelang_ops.nn.Softmax(-1),
    ).to("cuda", torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # warm-up runs, then graph replays
            x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
            out = compiled(x)
            torch.testing.assert_close(out.float(), model(x).float(), atol=2e-2, rtol=2e-2)
