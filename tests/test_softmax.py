"""torch.ops.tileops.softmax / log_softmax (+ backward ops): reference, edge values, opcheck, fake,
torch.compile, bad input, and on the GPU every kernel schedule (short rows packed per CTA, a row in
registers, split long rows) with poisoned outputs and gradients.

Tolerances (vs a float64 reference, max |err| <= atol + rtol * |ref|), from reference.py:
fp32 1e-5 / 1e-4, fp16 2e-3 / 2e-3, bf16 1.6e-2 / 1.6e-2 (one rounding of the output dominates;
fp32's rtol covers the long-row sum, ~sqrt(N) * 2^-24);
log_softmax's fp32 atol is 5e-5 (x - logsumexp cancels; PyTorch's own fp32 kernel needs it).
Gradients are judged by relative Frobenius error: fp32 1e-4, fp16 5e-3, bf16 3e-2 (y is rounded
to the input dtype before the backward, as in PyTorch).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

import tilelang_ops
from tilelang_ops.reference import LOG_SOFTMAX_ATOL, LOG_SOFTMAX_RTOL, SOFTMAX_ATOL, SOFTMAX_RTOL

from .helpers import DEVICES, poisoned_cuda_allocation, rel_err, requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = {"softmax": (torch.ops.tileops.softmax, torch.softmax), "log_softmax": (torch.ops.tileops.log_softmax, torch.log_softmax)}
GRAD_RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

SHAPES_DIMS = [
    ((1, 1), -1),  # one element: one row of one
    ((17, 1000), -1),  # short rows, several per CTA, M not a multiple of the CTA's rows
    ((17, 1000), 0),  # reduce over the first dim: moved last and back
    ((4, 4097), -1),  # odd N: scalar accesses, padded register row
    ((3, 5, 7), 0),
    ((3, 5, 7), 1),  # middle dim of an n-D tensor
    ((3, 5, 7), 2),
]


def _ref(name, x, dim):
    return OPS[name][1](x.double(), dim)


def _close(out, ref, dtype, name="softmax"):
    atol, rtol = (SOFTMAX_ATOL, SOFTMAX_RTOL) if name == "softmax" else (LOG_SOFTMAX_ATOL, LOG_SOFTMAX_RTOL)
    torch.testing.assert_close(out.double(), ref, atol=atol[dtype], rtol=rtol[dtype], equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape,dim", SHAPES_DIMS, ids=[f"{'x'.join(map(str, s))}-dim{d}" for s, d in SHAPES_DIMS])
def test_matches_reference(device, dtype, name, shape, dim):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    out = OPS[name][0](x, dim)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device and out.is_contiguous()
    _close(out, _ref(name, x, dim), dtype, name)


def _edge_rows(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows of length n with every edge value PyTorch defines: -inf, all -inf, +inf, NaN, +-1e4."""
    rows = torch.randn(8, n, device=device)
    rows[0, n // 2] = float("-inf")  # one -inf: that entry is 0 / -inf
    rows[1] = float("-inf")  # all -inf: NaN row
    rows[2, n - 1] = float("inf")  # +inf: NaN row
    rows[3, 0] = float("nan")  # NaN: NaN row
    rows[4, ::2] = 1e4  # huge values: exp underflows for the rest
    rows[5, 1::2] = -1e4
    rows[6, :] = 0.0  # uniform
    rows[7, -1] = 1e4 if n > 1 else rows[7, -1]
    return rows.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("n", [1, 2, 128, 1000, 4097])
def test_edge_values_like_pytorch(device, dtype, name, n):
    x = _edge_rows(n, dtype, device)
    out = OPS[name][0](x, -1)
    expected = OPS[name][1](x.float(), -1).to(dtype)  # PyTorch's own semantics at fp32
    assert torch.equal(torch.isnan(out), torch.isnan(expected)), "NaN pattern differs from PyTorch"
    _close(out, expected.double(), dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dim", [((0, 5), -1), ((5, 0), -1), ((0,), 0), ((2, 0, 3), 2), ((2, 0, 3), 1)])
def test_empty_returns_empty(device, shape, dim):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
    for name in OPS:
        out = OPS[name][0](x, dim)
        assert out.shape == x.shape and out.dtype == x.dtype
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_tensor(device):
    x = torch.tensor(2.5, device=device)
    assert torch.ops.tileops.softmax(x, 0).item() == 1.0
    assert torch.ops.tileops.log_softmax(x, -1).item() == 0.0


# Row lengths drawn from a fixed set: on CUDA each distinct N compiles a kernel.
_FUZZ_N = [1, 3, 8, 17, 64, 100, 256, 1000, 2048, 4097]


@given(
    lead=st.lists(st.integers(0, 9), min_size=0, max_size=2),
    n=st.sampled_from(_FUZZ_N),
    pos=st.integers(0, 2),
    dtype=st.sampled_from(DTYPES),
    name=st.sampled_from(sorted(OPS)),
    device=st.sampled_from(DEVICES),
)
def test_fuzz_shapes_dims_dtypes(lead, n, pos, dtype, name, device):
    shape = list(lead)
    pos = min(pos, len(shape))
    shape.insert(pos, n)  # the reduced dim at any position
    x = (torch.randn(shape, device=device) * 4).to(dtype)
    dim = pos - len(shape) if pos % 2 else pos  # exercise negative dims too
    _close(OPS[name][0](x, dim), _ref(name, x, dim), dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    for shape, dim in [((17,), 0), ((33, 65), -1), ((4, 6, 5), 1)]:
        x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
        opcheck(torch.ops.tileops.softmax.default, (x, dim))
        opcheck(torch.ops.tileops.log_softmax.default, (x, dim))
        y = torch.softmax(x.detach().float(), dim).to(dtype)
        g = torch.randn(shape, dtype=dtype, device=device)
        opcheck(torch.ops.tileops.softmax_backward.default, (g, y, dim))
        opcheck(torch.ops.tileops.log_softmax_backward.default, (g, y.float().log().to(dtype), dim))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 3, 5, dtype=torch.bfloat16)
        for out in (
            torch.ops.tileops.softmax(x, 1),
            torch.ops.tileops.log_softmax(x.transpose(0, 2)),  # non-contiguous in, contiguous out
            torch.ops.tileops.softmax_backward(x, x, -1),
            torch.ops.tileops.log_softmax_backward(x, x, 0),
        ):
            assert out.dtype == torch.bfloat16 and out.is_contiguous()
        assert out.shape == (7, 3, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_backward_matches_autograd(device, name):
    x = torch.randn(6, 300, device=device, dtype=torch.float64 if device == "cpu" else torch.float32, requires_grad=True)
    g = torch.randn_like(x)
    OPS[name][0](x.float() if device == "cpu" else x, -1).backward(g.float() if device == "cpu" else g)
    xr = x.detach().double().requires_grad_()
    OPS[name][1](xr, -1).backward(g.double())
    assert rel_err(x.grad, xr.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_torch_compile_fullgraph_no_graph_break(device, name):
    import torch._dynamo

    torch._dynamo.reset()
    op = OPS[name][0]

    def f(x):
        return (op(x * 2, -1) * op(x, 0)).sum()

    x = torch.randn(16, 40, device=device, requires_grad=True)
    explain = torch._dynamo.explain(f)(x)
    assert explain.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x)
    out.backward()
    xr = x.detach().double().requires_grad_()
    ref = OPS[name][1]
    (ref(xr * 2, -1) * ref(xr, 0)).sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-4
    torch.testing.assert_close(out.double(), (ref(xr * 2, -1) * ref(xr, 0)).sum(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_nn_modules(device):
    x = torch.randn(4, 9, 33, device=device)
    for dim in (0, 1, -1):
        _close(tilelang_ops.nn.Softmax(dim)(x), torch.nn.Softmax(dim)(x.double()), torch.float32)
        _close(tilelang_ops.nn.LogSoftmax(dim)(x), torch.nn.LogSoftmax(dim)(x.double()), torch.float32, "log_softmax")
    assert isinstance(tilelang_ops.nn.Softmax(1), torch.nn.Softmax)
    with pytest.raises(ValueError, match="dim: None"):
        tilelang_ops.nn.Softmax(None)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input_is_copied(device):
    x = torch.randn(40, 64, device=device).t()  # (64, 40), stride (1, 64)
    _close(torch.ops.tileops.softmax(x, -1), _ref("softmax", x, -1), torch.float32)
    _close(torch.ops.tileops.log_softmax(x[:, ::3], 0), _ref("log_softmax", x[:, ::3], 0), torch.float32, "log_softmax")


@pytest.mark.parametrize(
    "n,m,kind,backward,schedule",
    [
        (128, 65536, "softmax", False, "rows"),  # short rows, many per CTA
        (8192, 8, "softmax", True, "rows"),  # mid rows stay in registers at any M
        (32768, 4096, "softmax", False, "rows"),  # register row, >= 2 rows per SM
        (32768, 256, "softmax", False, "split"),  # register-sized but too few rows
        (32768, 4096, "softmax", True, "loop"),  # backward: two fp32 rows do not fit registers
        (65536, 128, "log_softmax", False, "split"),
        (262144, 100000, "softmax", False, "loop"),
    ],
)
def test_schedule_choice(n, m, kind, backward, schedule):
    """The heuristic; MEASURED / MEASURED_LOG (bf16/fp16 on 132-SM Hopper) may override it."""
    from tilelang_ops.kernels import softmax as K

    for dtype in ("bfloat16", "float32", "float16"):
        cfg = K.heuristic_config(n, dtype, kind, backward, m, sms=132)
        assert cfg.schedule == schedule
        assert K.fits(cfg, n, dtype, kind, backward), cfg  # defaults are inside the tuner's filter
        if dtype == "float32":
            assert K.default_config(n, dtype, kind, backward, m, sms=132) == cfg  # the tables never apply
    assert K.default_config(n, "bfloat16", kind, backward, m, sms=108) == K.heuristic_config(n, "bfloat16", kind, backward, m, sms=108)


@pytest.mark.parametrize("n", [1500, 4096, 6000, 8192, 12288, 16384])
def test_log_softmax_forward_rows_take_softmax_threads(n):
    """A register row gets as many threads in log_softmax's forward as in softmax's (twice as many
    measured slower, session 52); the backwards keep half a forward's values per thread."""
    from tilelang_ops.kernels import softmax as K

    for m in (K.bucket_rows("some"), K.bucket_rows("many")):
        log, soft = (K.heuristic_config(n, "bfloat16", kind, False, m, sms=132) for kind in ("log_softmax", "softmax"))
        assert log.schedule == soft.schedule == "rows" and log.threads == soft.threads, (log, soft)
        assert K.fits(log, n, "bfloat16", "log_softmax", False)
        bwd = K.heuristic_config(n, "bfloat16", "log_softmax", True, m, sms=132)
        assert bwd.threads == min(2 * log.threads, K._MAX_THREADS) or n <= 2048, bwd


def test_unaligned_rows_load_whole_vectors():
    """At a row length that breaks 16-byte alignment (GPT-2's 50257 columns) the loop and split
    schedules still move the row's body in 16-byte vectors, forward and backward (uint4 /
    float4 accesses in the pass that writes the output; before, every access was one element).
    Aligned lengths keep TileLang's bounds guards, which keep a masked load inside its branch."""
    import re

    from tilelang_ops.kernels import softmax as K

    loop = K.SoftmaxConfig("loop", threads=512, chunk=8192)
    split = K.SoftmaxConfig("split", threads=256, chunk=8192)
    for dtype, vec in (("bfloat16", "uint4"), ("float32", "float4")):
        st = {"n": 50257, "dtype": dtype, "kind": "softmax"}
        fwd = K.loop_fwd.source(loop, "sm_90a", **st)
        bwd = K.loop_bwd.source(loop, "sm_90a", **st)
        split_fwd = K.split_apply.source(split, "sm_90a", **st, backward=False)
        split_bwd = K.split_apply.source(split, "sm_90a", **st, backward=True)
        for src, bufs in ((fwd, ("X", "Y")), (bwd, ("DY", "Yt", "DX")), (split_fwd, ("A", "O")), (split_bwd, ("A", "B", "O"))):
            for buf in bufs:
                assert re.search(rf"\*\({vec}\*\)\({buf} \+", src), (dtype, buf)
        for kd in (K.loop_fwd, K.split_stats):
            assert kd.pass_configs_for(loop, **st) == {"tl.disable_safe_memory_legalize": True}
            assert kd.pass_configs_for(loop, **{**st, "n": 50256}) == {}


def test_stash_keeps_what_fits_shared_memory():
    """stash holds a whole row up to STASH_SMEM_MAX, else its first chunks that fit; the rest of
    the row is re-read like the loop's."""
    from tilelang_ops.kernels import softmax as K

    cfg = K.SoftmaxConfig("stash", 1, 512, 8192)
    assert K._stash_chunks(cfg, 50257, "bfloat16") == 7  # the whole row, ragged last chunk
    assert K._stash_chunks(cfg, 151936, "bfloat16") == 12  # 12 of 19 chunks: 192 KB
    assert K._stash_chunks(cfg, 65536, "float32") == 6  # 6 of 8 chunks: 192 KB
    for n, dtype in ((151936, "bfloat16"), (262144, "float16"), (65536, "float32")):
        assert K._stash_chunks(cfg, n, dtype) * cfg.chunk * K._ESIZE[dtype] <= K.STASH_SMEM_MAX
        assert K.fits(cfg, n, dtype) and not K.fits(cfg, n, dtype, backward=True)


def test_long_rows_over_many_rows():
    """Rows too long for registers, >= LOOP_ROWS_PER_SM rows per SM: the loop schedule, 512
    threads; backward in 16-bit on a 132-SM Hopper the cluster split where 16-byte vectors fit."""
    from tilelang_ops.kernels import softmax as K

    m = K.bucket_rows("many")
    loop = K.SoftmaxConfig("loop", threads=512, chunk=8192)
    for kind in K.KINDS:
        for n in (32000, 128256, 151936, 262144):
            assert K.default_config(n, "bfloat16", kind, True, m, sms=132) == K.LONG_BWD
            assert K.default_config(n, "float16", kind, True, m, sms=132) == K.LONG_BWD
            assert K.fits(K.LONG_BWD, n, "bfloat16", kind, True)
        # odd rows (no 16-byte vectors), > 8 chunks of 32768, float32, another GPU: the loop
        for n, dtype, sms in ((50257, "bfloat16", 132), (262144 + 8, "bfloat16", 132), (128256, "float32", 132), (128256, "bfloat16", 108)):
            cfg = K.default_config(n, dtype, kind, True, m, sms=sms)
            assert cfg == loop, (n, dtype, sms)
        assert K.default_config(128256, "bfloat16", kind, True, K.bucket_rows("some"), sms=132).schedule == "split"
        # forward (16-bit, 132 SMs): the row in shared memory while two fit per SM; one CTA per
        # SM stashing the first 192 KB of a row of 200-400 KB; else the loop
        for n, dtype in ((50257, "bfloat16"), (50257, "float16"), (57344, "bfloat16")):
            assert K.default_config(n, dtype, kind, False, m, sms=132) == K.LONG_FWD, (n, dtype)
        for n in (102400 + 8, 128256, 151936, 204800):
            assert K.default_config(n, "bfloat16", kind, False, m, sms=132) == K.WIDE_FWD, n
        for n, dtype, sms in (
            (57344 + 8, "bfloat16", 132),
            (65536 + 8, "bfloat16", 132),
            (102400, "bfloat16", 132),
            (204800 + 8, "bfloat16", 132),
            (50257, "float32", 132),
            (50257, "bfloat16", 108),
        ):
            assert K.default_config(n, dtype, kind, False, m, sms=sms) == loop, (n, dtype, sms)
        assert K.default_config(50257, "bfloat16", kind, False, K.bucket_rows("some"), sms=132).schedule == "split"
    # forward register rows: softmax's up to 32768 (bar the measured 32000), log_softmax's (values
    # and exps) up to 16384
    assert K.default_config(30000, "bfloat16", "softmax", False, m, sms=132) == K.SoftmaxConfig("rows", 1, 1024)
    assert K.default_config(20000, "bfloat16", "log_softmax", False, m, sms=132) == K.LONG_FWD


def test_measured_table_is_sane():
    from tilelang_ops.kernels import softmax as K

    assert set(K.TABLES) == set(K.KINDS)
    for kind, table in K.TABLES.items():
        for (direction, n, bucket), cfg in table.items():
            assert direction in ("fwd", "bwd") and bucket in ("few", "some", "many"), (direction, bucket)
            assert cfg.schedule in K.SCHEDULES, cfg
            for dtype in ("bfloat16", "float16"):
                assert K.fits(cfg, n, dtype, kind, direction == "bwd"), (kind, direction, n, cfg)
                m = K.bucket_rows(bucket)
                assert K.m_bucket(m) == bucket
                assert K.default_config(n, dtype, kind, direction == "bwd", m, sms=132) == cfg


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_run_hands_each_schedule_its_kernels_arguments(backward):
    # ops._run decides from the config which buffers each launch gets (the partials only for the
    # split and cluster schedules); every launch must match its kernel's parameters. No GPU: the
    # kernels are their PrimFuncs, launching checks the argument count and ranks.
    from tilelang_ops.kernels import softmax as K
    from tilelang_ops.ops import softmax as ops

    n = 32768
    configs = [K.SoftmaxConfig("rows", 1, 1024), K.SoftmaxConfig("loop", 1, 256, 8192), K.SoftmaxConfig("split", 1, 256, 4096),
               K.SoftmaxConfig("csplit", 1, 256, 8192), K.SoftmaxConfig("csplitd", 1, 256, 8192)]
    if not backward:
        configs += [K.SoftmaxConfig(s, 1, 256, n, 0, 4) for s in K.TMA_SCHEDULES] + [K.SoftmaxConfig("stash", 1, 256, 8192)]
    assert {c.schedule for c in configs} == set(K.SCHEDULES) - (set() if not backward else set(K.FWD_ONLY))
    for cfg in configs:
        launched = []

        def launcher(func):
            def launch(*args):
                assert len(args) == len(func.params), (cfg.schedule, len(args), len(func.params))
                for p, a in zip(func.params, args):
                    assert len(func.buffer_map[p].shape) == a.dim(), (cfg.schedule, func.buffer_map[p].name)
                launched.append(cfg.schedule)

            return launch

        kernels = tuple(launcher(kd.build(c, **st)) for kd, c, st in K.schedule_kernels(cfg, n, "bfloat16", "softmax", backward))
        x = torch.randn(4, n, dtype=torch.bfloat16)
        ops._run(cfg, kernels, backward, x, x.clone() if backward else None, torch.empty_like(x))
        assert len(launched) == len(kernels), cfg


def test_tma_fits_only_whole_chunks():
    from tilelang_ops.kernels import softmax as K

    cfg = K.SoftmaxConfig("tma", 1, 256, 32768, 0, 4)
    assert K.fits(cfg, 32768, "bfloat16") and K.fits(cfg, 262144, "bfloat16")  # one CTA / a cluster of 8
    assert not K.fits(cfg, 30001, "bfloat16")  # ragged row: no equal 16-byte bulk copies
    assert not K.fits(cfg, 32768 * 9, "bfloat16")  # more than 8 chunks per row: no cluster
    assert not K.fits(cfg, 32768, "bfloat16", backward=True)  # forward only
    assert not K.fits(K.SoftmaxConfig("tma", 1, 256, 131072, 0, 4), 131072, "bfloat16")  # 256 KB chunk
    assert not K.fits(K.SoftmaxConfig("tma", 1, 256, 32768, 0, 3), 32768, "bfloat16")  # uneven sub-chunks


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["tma", "tmaw", "tmas"])
@pytest.mark.parametrize("n", [32768, 262144])
def test_tma_source_cannot_hang(n, schedule):
    """The tma schedule's mbarriers complete only when every thread has arrived and the bulk
    copies' bytes have landed: T.tma_copy adds the expected bytes but does not arrive (without
    the arrives the kernel hung on the GPU, session 7). Checked in the generated code."""
    from tilelang_ops.kernels import softmax as K

    cfg = dataclasses.replace(K.SoftmaxConfig("tma", 1, 256, 32768, 0, 4), schedule=schedule)
    src = K.tma_fwd.source(cfg, "sm_90a", n=n, dtype="bfloat16", kind="softmax")
    assert src.count(f".init({cfg.threads})") == cfg.stages  # arrive count = the CTA's threads
    issue, arrive, wait = src.index("tma_load("), src.index(".arrive()"), src.index(".wait(0)")
    assert src.index("expect_transaction(") < issue < arrive < wait  # bytes expected before the load
    assert ("cluster_arrive_relaxed" in src) == (n > cfg.chunk)  # partials through DSMEM only in a cluster


def test_sweep_candidates_fit():
    from benchmarks.sweep_softmax import plan
    from tilelang_ops.kernels import softmax as K

    rows = plan()
    assert len(rows) <= 70
    for m, n, bwd, cfg, _ in rows:
        assert K.fits(cfg, n, "bfloat16", "softmax", bwd), (m, n, bwd, cfg)


def test_tunables_have_candidates():
    from tilelang_ops.ops.softmax import TUNABLES

    for name, t in TUNABLES.items():
        for shape in t.presets["default"]:
            assert len(t.search_space(shape, torch.bfloat16)) >= 4, (name, shape)
            assert t.default(shape, torch.float32).schedule in ("rows", "loop", "split")


def test_hopper_search_space_holds_the_measured_defaults():
    """`tileops tune` on an sm_90 GPU can reach every measured default (clusters, bulk copies);
    on older GPUs it offers none of them (they need sm_90)."""
    from tilelang_ops.kernels import softmax as K

    for kind, table in K.TABLES.items():
        for (direction, n, _), cfg in table.items():
            space = K.search_space(n, "bfloat16", kind, direction == "bwd", 90)
            assert cfg in space, (kind, direction, n, cfg)
            assert all(c.schedule in ("rows", "loop", "split") for c in K.search_space(n, "bfloat16", kind, direction == "bwd", 80))
        # the long-row defaults no table names, at lengths they serve
        for cfg, n, bwd in ((K.LONG_BWD, 128256, True), (K.LONG_FWD, 50257, False), (K.WIDE_FWD, 151936, False)):
            assert cfg == K.default_config(n, "bfloat16", kind, bwd, K.bucket_rows("many"))
            assert cfg in K.search_space(n, "bfloat16", kind, bwd, 90), (kind, cfg, n)


BAD_INPUTS = [
    ("integer dtype", lambda d: (torch.ones(4, 3, dtype=torch.int32, device=d), -1), TypeError, "x: dtype int32"),
    ("float64", lambda d: (torch.ones(4, dtype=torch.float64, device=d), -1), TypeError, "supported: float32, float16, bfloat16"),
    ("dim too large", lambda d: (torch.ones(4, 3, device=d), 2), IndexError, r"dim: 2 is out of range .* \[-2, 1\]"),
    ("dim too small", lambda d: (torch.ones(4, 3, device=d), -3), IndexError, "dim: -3 is out of range"),
    # rejected by the dispatcher's schema check before our code runs; its message names the argument
    ("not a tensor", lambda d: ([1.0, 2.0], -1), RuntimeError, "argument 'x'"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(device, name, case):
    _, make, exc, msg = case
    with pytest.raises(exc, match=msg):
        OPS[name][0](*make(device))


BAD_BACKWARD = [
    ("dtype mix", lambda d: (torch.ones(4, 3, device=d), torch.ones(4, 3, dtype=torch.bfloat16, device=d), -1), TypeError, "y: dtype"),
    ("shape mismatch", lambda d: (torch.ones(4, 3, device=d), torch.ones(4, 2, device=d), -1), ValueError, "y: shape"),
    ("integer grad", lambda d: (torch.ones(4, dtype=torch.int64, device=d), torch.ones(4, device=d), 0), TypeError, "grad: dtype int64"),
    ("dim out of range", lambda d: (torch.ones(4, 3, device=d), torch.ones(4, 3, device=d), 5), IndexError, "dim: 5"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
@pytest.mark.parametrize("case", BAD_BACKWARD, ids=[c[0] for c in BAD_BACKWARD])
def test_bad_backward_input(device, op, case):
    _, make, exc, msg = case
    with pytest.raises(exc, match=msg):
        getattr(torch.ops.tileops, op)(*make(device))


# ------------------------------------------------------------------------------------ GPU only
# (M, N) per kernel schedule for bf16 (see kernels/softmax.py default_config):
# test_cuda_loop_path_many_long_rows: lengths past the register rows, at many rows (and the
# register rows' last lengths, and an odd one)
LONG_ROWS_N = [20000, 32000, 40000, 50257, 65536, 128256]
GPU_SHAPES = [
    (1, 1),  # one element
    (1000, 7),  # tiny odd rows, 32 rows per CTA, scalar accesses
    (1000, 128),  # short rows: 8 lanes per row, 16 rows per CTA, M % 16 != 0
    (37, 1000),  # short rows, padded to the lane count
    (5, 4097),  # odd N: scalar accesses, padded register row
    (33, 8192),  # one row per CTA in registers
    (300, 16384),  # a register row of 512 threads; M >= 2 rows per SM
    (3, 32768),  # register-sized row but too few rows to fill the SMs: split instead
    (2, 65536),  # split: stats + apply, 8 chunks per row
    (3, 100003),  # split with a ragged, odd last chunk
    (2, 262144),  # split: 32 chunks per row
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
def test_cuda_poisoned_output(dtype, name, shape):
    x = (torch.randn(shape, device="cuda") * 4).to(dtype)
    with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
        out = OPS[name][0](x, -1)
    assert out.data_ptr() == ptr, "poison did not reach the output; the test would not catch unwritten elements"
    assert torch.isfinite(out).all()
    _close(out, _ref(name, x, -1), dtype, name)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("n", LONG_ROWS_N)
def test_cuda_loop_path_many_long_rows(dtype, name, n):
    """M >= 4 rows per SM: rows too long for registers take the loop schedule (one CTA walks its
    row twice) forward, and in bf16 on a 132-SM Hopper stash (LONG_FWD / WIDE_FWD: rows of up to
    112 KB and of 200-400 KB) or a measured config forward and the cluster split (LONG_BWD)
    backward unless the length is odd; softmax's forward keeps rows up to 32768 in registers.
    Checks that the default config served each direction."""
    from tilelang_ops.kernels import softmax as K

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = K.bucket_rows("many", sms)
    x = (torch.randn(m, n, device="cuda") * 4).to(dtype).requires_grad_()
    x.data[0, : n // 2] = float("-inf")  # -inf-only first chunks: the running sum must stay 0, not NaN
    x.data[1] = float("-inf")  # all -inf row: NaN like PyTorch
    with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
        out = OPS[name][0](x, -1)
    assert out.data_ptr() == ptr
    expected = OPS[name][1](x.detach().float(), -1)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    _close(out, expected.double(), dtype, name)
    g = torch.randn_like(out)
    keep = slice(2, None)  # gradients of the finite rows
    out.backward(g)
    xr = x.detach()[keep].double().requires_grad_()
    OPS[name][1](xr, -1).backward(g[keep].double())
    assert rel_err(x.grad[keep], xr.grad) < GRAD_RTOL[dtype]
    for op, backward in ((name, False), (name + "_backward", True)):
        served = _served(op, dtype, n)
        assert K.default_config(n, str(dtype).replace("torch.", ""), name, backward, m, sms) in served, (op, served)


# Row lengths that break 16-byte alignment (odd, 2 and 4 mod 8), past the register rows of both
# kinds' forward and backward: the loop (many rows) and split (few) schedules, every row at
# another offset within 16 bytes.
UNALIGNED_N = [40001, 50257, 50258, 50260]


def _edge_slots(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols): one element per row among the first and last 8 of the row, the slot and the
    row's offset within 16 bytes (rows r, r + 8, ... share it at odd n) varying independently."""
    rows = torch.arange(m, device=device)
    slot = (rows // 8) % 16
    return rows, torch.where(slot < 8, slot, n - 16 + slot)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("n", UNALIGNED_N)
@pytest.mark.parametrize("schedule", ["loop", "split"])
def test_cuda_unaligned_rows(dtype, name, n, schedule):
    """loop (its forward stash in 16-bit) and split at lengths that break 16-byte alignment load
    an aligned body of whole vectors and each row's head and tail (< 16 bytes each) one element
    at a time. Each row gets one dominant value among its first or last 8 elements: a row whose
    ends missed the max, the sum or the dot is wrong by orders of magnitude (random values alone
    would hide one missing element of 50000 inside the tolerance), and poison catches an
    unwritten end."""
    from tilelang_ops.kernels import softmax as K

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # loop: >= LOOP_ROWS_PER_SM rows per SM; split: fewer than 2 (the most of them)
    m = K.bucket_rows("many", sms) if schedule == "loop" else 2 * sms - 1
    rows, cols = _edge_slots(m, n, "cuda")
    x = torch.randn(m, n, device="cuda") * 2
    x[rows, cols] = 30.0
    x = x.to(dtype)
    with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
        out = OPS[name][0](x, -1)
    assert out.data_ptr() == ptr, "forward: the poison did not reach the output"
    _close(out, _ref(name, x, -1), dtype, name)
    # the backward op alone, with y and dy dominated by the same element: softmax's dot y . dy
    # and log_softmax's sum of dy are mostly that element's term
    p = torch.rand(m, n, device="cuda") * 1e-4
    p[rows, cols] = 0.5
    y = (p.log() if name == "log_softmax" else p).to(dtype)
    dy = torch.randn(m, n, device="cuda")
    dy[rows, cols] = 1000.0
    dy = dy.to(dtype)
    with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
        dx = getattr(torch.ops.tileops, f"{name}_backward")(dy, y, -1)
    assert dx.data_ptr() == ptr, "backward: the poison did not reach the output"
    ref = getattr(tilelang_ops.reference, f"{name}_backward")(dy.double(), y.double(), -1)
    err = rel_err(dx, ref)
    assert err < GRAD_RTOL[dtype], f"backward: relative error {err:.3g}, NaN {dx.isnan().sum().item()}"
    for op, backward in ((name, False), (name + "_backward", True)):
        cfg = K.default_config(n, str(dtype).replace("torch.", ""), name, backward, m, sms)
        # the loop's forward gives way to stash (the same walk) where the row fits shared memory
        assert cfg.schedule == schedule or (cfg == K.LONG_FWD and schedule == "loop"), (op, cfg)
        served = _served(op, dtype, n, K.m_bucket(m, sms))
        assert served == [cfg], (op, served)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("n", [7, 128, 1000, 4097, 8192, 65536, 100003])
def test_cuda_edge_values_every_path(name, n):
    x = _edge_rows(n, torch.bfloat16, "cuda")
    out = OPS[name][0](x, -1)
    expected = OPS[name][1](x.float(), -1).to(torch.bfloat16)
    assert torch.equal(torch.isnan(out), torch.isnan(expected)), "NaN pattern differs from PyTorch"
    _close(out, expected.double(), torch.bfloat16, name)
    # a -inf-only chunk inside a finite row must not poison the split path's partial sums
    y = torch.randn(2, n, device="cuda")
    y[:, : n // 2] = float("-inf")
    _close(OPS[name][0](y, -1), _ref(name, y, -1), torch.float32, name)


# Schedules that are not (yet) defaults, run directly: (config, n, backward). The bf16 ones at the
# sweep's n are warm in the kernel cache (benchmarks/sweep_softmax.py --warm compiles this list).
def _cfg(*a):
    from tilelang_ops.kernels.softmax import SoftmaxConfig

    return SoftmaxConfig(*a)


EXTRA_SCHEDULES = [
    (("rows", 4, 128, 0, 12), 1024, False),  # register cap through min_blocks (spills)
    (("split", 1, 256, 4096, 8), 32768, False),
    (("split", 1, 256, 4096, 8), 32768, True),
    (("csplit", 1, 256, 8192, 0), 32768, False),
    (("csplit", 1, 256, 8192, 0), 32768, True),
    (("csplit", 1, 256, 8192, 0), 30001, False),  # ragged last chunk, scalar accesses
    (("csplit", 1, 1024, 32768, 0), 262144, False),
    (("csplit", 1, 512, 8192, 0), 32768, False),  # 4 CTAs per cluster, 2 slices per thread
    (("loop", 1, 256, 8192, 0), 30001, False),  # per-thread running max/sum, ragged last chunk
    (("loop", 1, 512, 8192, 4), 32768, True),
    # partials exchanged through DSMEM instead of global memory
    (("csplitd", 1, 128, 4096, 0), 32768, False),
    (("csplitd", 1, 128, 4096, 0), 32768, True),
    (("csplitd", 1, 256, 8192, 0), 30001, False),  # ragged last chunk
    (("csplitd", 1, 256, 8192, 0), 30001, True),
    (("csplitd", 1, 512, 32768, 0), 262144, True),
    (("csplit", 1, 512, 16384, 0), 131072, False),  # the 131072 forward's default until session 9
    # chunk in shared memory by bulk copies, reduced sub-chunk by sub-chunk as it lands
    (("tma", 1, 256, 32768, 0, 4), 32768, False),  # a CTA per row
    (("tma", 1, 512, 65536, 0, 8), 65536, False),
    (("tma", 1, 256, 16384, 0, 2), 32768, False),  # a cluster of 2 per row, DSMEM partials
    (("tma", 1, 256, 32768, 0, 4), 262144, False),  # a cluster of 8
    (("tma", 1, 128, 1024, 0, 1), 2048, False),  # one slice per sub-chunk
    # the same with warp-level statistics (no CTA barrier per sub-chunk)
    (("tmaw", 1, 128, 32768, 0, 4), 32768, False),  # the 256x32768 candidate
    (("tmaw", 1, 512, 65536, 0, 4), 65536, False),  # the 128x65536 candidate
    (("tmaw", 1, 256, 32768, 0, 4), 32768, False),
    (("tmaw", 1, 256, 16384, 0, 2), 32768, False),  # a cluster of 2 per row, DSMEM partials
    (("tmaw", 1, 256, 32768, 0, 4), 262144, False),  # a cluster of 8
    (("tmaw", 1, 128, 32768, 0, 4), 262144, False),  # 4 warps per CTA, a cluster of 8
    # the same with half the sub-chunks in flight, the next issued as one lands
    (("tmas", 1, 256, 32768, 0, 4), 32768, False),
    (("tmas", 1, 512, 65536, 0, 4), 65536, False),
    (("tmas", 1, 128, 32768, 0, 8), 32768, False),
    (("tmas", 1, 256, 16384, 0, 2), 32768, False),  # a cluster of 2, one sub-chunk ahead
    (("tmas", 1, 128, 32768, 0, 4), 262144, False),  # a cluster of 8
    # the defaults chosen from the last sweep of the eighth session (their GPU run: the sweep's
    # check against torch on random rows; these cases add the edge rows), and the ninth's
    (("tmas", 1, 128, 32768, 0, 8), 131072, False),  # a cluster of 4
    (("tmas", 1, 256, 32768, 0, 8), 32768, False),
    (("tmas", 1, 256, 65536, 0, 4), 65536, False),
    (("tmas", 1, 128, 32768, 0, 8), 262144, False),
    (("tmaw", 1, 128, 1024, 0, 1), 2048, False),  # one slice per sub-chunk
    # what `tileops tune` stored for log_softmax at 256x32768 (session 49, H100: 1.48x and 1.28x
    # over its row-length heuristic)
    (("tmas", 1, 128, 32768, 0, 4), 32768, False),
    (("rows", 1, 1024, 0, 0), 32768, True),
    # log_softmax candidates at the lengths session 51's first sweep left out (sweep_softmax --kind log_softmax)
    (("tmas", 1, 256, 32768, 0, 4), 131072, False),
    (("tmas", 1, 128, 65536, 0, 8), 131072, False),
    (("csplit", 1, 512, 16384, 0), 131072, True),
    (("csplit", 1, 512, 32768, 0), 131072, True),
    (("csplit", 1, 512, 32768, 0), 262144, True),
    # loop with the row kept in shared memory for its second pass; unaligned and ragged rows
    (("stash", 1, 512, 8192, 0), 50257, False),
    (("stash", 1, 256, 8192, 0), 30001, False),
    (("stash", 1, 1024, 16384, 0), 32000, False),
    # rows longer than shared memory: the first 12 chunks stashed, the other 4 / 7 re-read from L2
    (("stash", 1, 512, 8192, 0), 128257, False),  # unaligned, ragged last chunk
    (("stash", 1, 1024, 8192, 0), 151936, False),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("case", EXTRA_SCHEDULES, ids=["-".join(map(str, c[0][:1] + c[0][2:])) + f"-n{c[1]}-{'bwd' if c[2] else 'fwd'}" for c in EXTRA_SCHEDULES])
def test_cuda_extra_schedules(name, case):
    from tilelang_ops.ops import softmax as ops

    fields, n, backward = case
    cfg, dtype = _cfg(*fields), torch.bfloat16
    kernels = ops._compile(cfg, name, backward, n, dtype, torch.device("cuda", torch.cuda.current_device()))
    for m in (1, 3, 37):
        x = _edge_rows(n, dtype, "cuda")[:m] if m <= 8 else (torch.randn(m, n, device="cuda") * 4).to(dtype)
        if m == 37:
            x[5, : n // 2] = float("-inf")  # -inf-only chunks inside a finite row
        y = OPS[name][1](x.float(), -1).to(dtype)
        if not backward:
            out = torch.full_like(x, float("nan"))
            res = ops._run(cfg, kernels, False, x.contiguous(), None, out)
            expected = OPS[name][1](x.float(), -1)
            assert torch.equal(torch.isnan(res), torch.isnan(expected)), (m, "NaN pattern differs from PyTorch")
            _close(res, expected.double(), dtype, name)
        else:
            keep = torch.isfinite(y).all(-1)
            g = torch.randn_like(x)
            dx = ops._run(cfg, kernels, True, g, y, torch.full_like(x, float("nan")))
            ref = getattr(tilelang_ops.reference, f"{name}_backward")(g.double(), y.double(), -1)
            assert rel_err(dx[keep], ref[keep]) < GRAD_RTOL[dtype]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape", [(1000, 128), (37, 1000), (5, 4097), (33, 8192), (300, 16384), (3, 32768), (2, 262144)])
def test_cuda_gradients(dtype, name, shape):
    x = (torch.randn(shape, device="cuda") * 2).to(dtype).requires_grad_()
    g = torch.randn(shape, device="cuda").to(dtype)
    OPS[name][0](x, -1).backward(g)
    xr = x.detach().double().requires_grad_()
    OPS[name][1](xr, -1).backward(g.double())
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    assert rel_err(x.grad, xr.grad) < GRAD_RTOL[dtype]
    # and the backward op alone against the reference formula, from the same y
    y = OPS[name][0](x.detach(), -1)
    bwd = getattr(torch.ops.tileops, f"{name}_backward")
    ref = getattr(tilelang_ops.reference, f"{name}_backward")
    with poisoned_cuda_allocation(y.numel() * y.element_size()):
        dx = bwd(g, y, -1)
    assert rel_err(dx, ref(g.double(), y.double(), -1)) < GRAD_RTOL[dtype]


def _served(op: str, dtype: torch.dtype, n: int, bucket: str = "") -> list:
    """The configs that served `op` at rows of n in `dtype` in this process (tuning.SERVED), in
    one M bucket ("few", "some", "many") or all of them."""
    from tilelang_ops import tuning

    dname = str(dtype).replace("torch.", "")
    want = f"|{dname}|n={n}|{bucket}" + ("|" if bucket else "")
    return [cfg for (o, key), cfg in tuning.SERVED.items() if o == op and want in key]


def _measured_cases():
    from tilelang_ops.kernels import softmax as K

    return [(kind, d, n, b) for kind, table in K.TABLES.items() for (d, n, b) in table]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", _measured_cases(), ids=lambda c: "-".join(map(str, c)))
def test_cuda_measured_defaults_through_the_op(dtype, case):
    """Every MEASURED / MEASURED_LOG entry, reached through the op at a row count of its bucket
    (on a 132-SM Hopper; elsewhere the heuristic serves): poisoned output, the reference."""
    from tilelang_ops.kernels import softmax as K

    kind, direction, n, bucket = case
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = K.bucket_rows(bucket, sms)
    x = (torch.randn(m, n, device="cuda") * 4).to(dtype)
    y = OPS[kind][0](x, -1)
    if direction == "fwd":
        with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
            out = OPS[kind][0](x, -1)
        assert out.data_ptr() == ptr
        _close(out, _ref(kind, x, -1), dtype, kind)
    else:
        g = torch.randn(m, n, device="cuda").to(dtype)
        with poisoned_cuda_allocation(x.numel() * x.element_size()) as ptr:
            out = getattr(torch.ops.tileops, f"{kind}_backward")(g, y, -1)
        assert out.data_ptr() == ptr
        ref = getattr(tilelang_ops.reference, f"{kind}_backward")(g.double(), y.double(), -1)
        assert torch.isfinite(out).all() and rel_err(out, ref) < GRAD_RTOL[dtype]
    served = _served(kind + ("_backward" if direction == "bwd" else ""), dtype, n)
    if sms == K.H200_SMS:
        assert K.TABLES[kind][(direction, n, bucket)] in served, served


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", OPS)
def test_cuda_other_dims_and_views(name):
    x = torch.randn(6, 300, 10, device="cuda", dtype=torch.bfloat16)
    for dim in (0, 1, 2, -2):
        _close(OPS[name][0](x, dim), _ref(name, x, dim), torch.bfloat16, name)
    base = torch.randn(64 * 1000 + 1, device="cuda", dtype=torch.bfloat16)
    v = base[1:].view(64, 1000)  # contiguous but 2 bytes off a 16-byte boundary
    _close(OPS[name][0](v, -1), _ref(name, v, -1), torch.bfloat16, name)
    t = torch.randn(300, 64, device="cuda").t()  # non-contiguous
    _close(OPS[name][0](t, -1), _ref(name, t, -1), torch.float32, name)


@pytest.mark.gpu
@requires_cuda
def test_cuda_new_batch_size_does_not_recompile():
    from tilelang_ops import runtime

    torch.ops.tileops.softmax(torch.randn(5, 2048, device="cuda"), -1)
    before = runtime.compiled_count()
    for m in (1, 7, 100, 3000):
        x = torch.randn(m, 2048, device="cuda")
        _close(torch.ops.tileops.softmax(x, -1), _ref("softmax", x, -1), torch.float32)
    assert runtime.compiled_count() == before


@pytest.mark.gpu
@requires_cuda
def test_cuda_mixed_devices_backward():
    with pytest.raises(ValueError, match="y: on device cpu"):
        torch.ops.tileops.softmax_backward(torch.ones(4, 3, device="cuda"), torch.ones(4, 3), -1)
    with pytest.raises(ValueError, match="y: on device cpu"):
        torch.ops.tileops.log_softmax_backward(torch.ones(4, 3, device="cuda"), torch.ones(4, 3), -1)


@pytest.mark.gpu
@requires_cuda
def test_cuda_runs_on_current_stream_and_in_cuda_graph():
    x = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
    torch.ops.tileops.softmax(x, -1)  # compile + warm outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.ops.tileops.softmax(x, -1)
    torch.cuda.current_stream().wait_stream(s)
    _close(out, _ref("softmax", x, -1), torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = torch.ops.tileops.softmax(x, -1)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    _close(captured, _ref("softmax", x, -1), torch.bfloat16)
