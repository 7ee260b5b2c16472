"""tilelang_ops.patch / unpatch: what is replaced and what is left alone (and why), outputs and
gradients unchanged, state_dict keys and values unchanged and round-tripping, originals restored.

On the CPU, float32 runs PyTorch math end to end (our ops' float32 paths are the reference or
torch itself), so patched outputs must equal the originals to float32 tolerance. bfloat16 runs
the tileops ops' CPU reference (checked by counting tileops calls) and is judged against
PyTorch's own bfloat16 error vs float32, at most 2x (STYLE 9). The GPU test runs the TileLang
kernels the same way.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tilelang_ops
from tilelang_ops import nn as tnn
from tilelang_ops.patching import MultiheadAttention as PatchedMHA

from .helpers import RecordOps, rel_err, requires_cuda

E, HEADS = 128, 2  # head dim 64: served by the attention kernel


class Block(torch.nn.Module):
    """A pre-norm transformer block with every kind of module patch() looks at."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(E)
        self.attn = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(E, 2 * E), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(2 * E, E))
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.drop(self.mlp(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.seq_first = torch.nn.MultiheadAttention(E, HEADS)  # batch_first=False: left alone
        self.gate, self.act = torch.nn.Linear(E, E), torch.nn.SiLU()
        self.probs = torch.nn.Softmax(dim=-1)
        self.logp = torch.nn.LogSoftmax(dim=-1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = x + self.seq_first(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), need_weights=False)[0].transpose(0, 1)
        x = self.act(self.gate(x))
        return self.probs(x), self.logp(x)


def _model(dtype=torch.float32, device="cpu"):
    return Model().to(device=device, dtype=dtype).eval()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_patch_replaces_what_is_supported_and_reports_the_rest():
    model = _model()
    report = tilelang_ops.patch(model)
    assert [(n, new) for n, _, new in report.replaced] == [
        ("blocks.0.attn", "tilelang_ops.patching.MultiheadAttention"),
        ("blocks.0.mlp.0", "tilelang_ops.nn.Linear(activation='gelu_tanh')"),
        ("blocks.1.attn", "tilelang_ops.patching.MultiheadAttention"),
        ("blocks.1.mlp.0", "tilelang_ops.nn.Linear(activation='gelu_tanh')"),
        ("gate", "tilelang_ops.nn.Linear(activation='silu')"),
        ("probs", "tilelang_ops.nn.Softmax"),
        ("logp", "tilelang_ops.nn.LogSoftmax"),
    ]
    skipped = dict(report.skipped)
    assert "batch_first=False" in skipped["seq_first"]
    assert "seq_first.out_proj" not in skipped  # part of the attention, not a Linear of its own
    assert "nn.LayerNorm" in skipped["blocks.0.norm"] and "nn.Dropout" in skipped["blocks.1.drop"]
    assert "without a fusable activation" in skipped["blocks.0.mlp.2"]
    assert type(model.blocks[0].mlp[0]) is tnn.Linear and type(model.blocks[0].mlp[1]) is torch.nn.Identity
    assert type(model.blocks[1].attn) is PatchedMHA and type(model.seq_first) is torch.nn.MultiheadAttention
    text = str(report)
    assert "replaced 7 module(s)" in text and "left alone: no tilelang_ops equivalent (nn.LayerNorm)" in text


def test_outputs_weights_state_dict_unchanged_and_unpatch_restores():
    model = _model()
    x = torch.randn(2, 9, E)
    ref = model(x)
    sd = _state(model)
    originals = dict(model.named_modules())
    report = tilelang_ops.patch(model)

    out = model(x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    after = model.state_dict()
    assert list(after) == list(sd)  # same keys, same order
    for k in sd:
        assert torch.equal(after[k], sd[k]), k

    # state_dict round-trips both ways: patched <- plain checkpoint, plain <- patched checkpoint
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    for o, r in zip(fresh(x), ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    other = _model()
    tilelang_ops.patch(other)
    other.load_state_dict(sd)
    for o, r in zip(other(x), ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)

    restored = tilelang_ops.unpatch(model)
    assert sorted(restored) == sorted(n for n, _ in report.originals)
    for name, m in model.named_modules():
        assert m is originals[name], name
    assert not hasattr(model, "_tileops_originals")
    for o, r in zip(model(x), ref):
        assert torch.equal(o, r)


def test_gradients_match_and_training_while_patched_is_kept_after_unpatch():
    model = _model().train()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 7, E)
    tilelang_ops.patch(model)
    for m in (model, plain):
        p, lp = m(x)
        (p.square().sum() + lp.mean()).backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)

    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    trained = _state(model)
    tilelang_ops.unpatch(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k  # parameters were shared, never copied


def test_patch_twice_and_unpatch_one_report():
    model = _model()
    first = tilelang_ops.patch(model)
    second = tilelang_ops.patch(model)
    assert second.replaced == []
    assert dict(second.skipped)["probs"] == "already a tilelang_ops module"
    assert tilelang_ops.unpatch(model, second) == []
    assert len(tilelang_ops.unpatch(model, first)) == len(first.originals)
    assert type(model.probs) is torch.nn.Softmax and not hasattr(model, "_tileops_originals")


def test_left_alone_with_reasons():
    class MySoftmax(torch.nn.Softmax):
        pass

    model = torch.nn.Sequential(
        torch.nn.Softmax(dim=None),
        MySoftmax(dim=-1),
        torch.nn.MultiheadAttention(E, HEADS, batch_first=True, add_bias_kv=True),
        torch.nn.MultiheadAttention(E, HEADS, batch_first=True, add_zero_attn=True),
        torch.nn.ReLU(),
    )
    report = tilelang_ops.patch(model)
    assert report.replaced == []
    why = dict(report.skipped)
    assert "implicit dim" in why["0"] and "subclass" in why["1"]
    assert "add_bias_kv" in why["2"] and "add_zero_attn" in why["3"]
    assert "not fed by exactly one nn.Linear" in why["4"]
    root = tilelang_ops.patch(torch.nn.Softmax(dim=-1))
    assert root.replaced == [] and "root module" in dict(root.skipped)[""]


# ------------------------------------------------------------------------------ MultiheadAttention
MHA_CASES = [
    # (id, kwargs, self-attention?, Sq, Sk, is_causal)
    ("self", {}, True, 33, 33, False),  # one packed in_proj GEMM
    ("self-causal", {}, True, 33, 33, True),  # is_causal hint + attn_mask: the mask is dropped
    ("cross", {}, False, 17, 40, False),  # separate q / k / v projections, Sq != Sk
    ("kdim-vdim", {"kdim": 96, "vdim": 80}, False, 12, 20, False),  # q/k/v_proj_weight, no in_proj_weight
    ("no-bias-causal", {"bias": False}, True, 8, 8, True),
]


def _mha_inputs(kwargs, self_attn, Sq, Sk, dtype, device="cpu"):
    q = torch.randn(2, Sq, E, device=device, dtype=dtype)
    if self_attn:
        return q, q, q
    k = torch.randn(2, Sk, kwargs.get("kdim", E), device=device, dtype=dtype)
    v = torch.randn(2, Sk, kwargs.get("vdim", E), device=device, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("case", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_mha_float32_equals_torch(case):
    _, kwargs, self_attn, Sq, Sk, is_causal = case
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True, **kwargs).eval()
    q, k, v = _mha_inputs(kwargs, self_attn, Sq, Sk, torch.float32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(Sq) if is_causal else None
    ref, _ = mha(q, k, v, need_weights=False, attn_mask=mask, is_causal=is_causal)
    ours = PatchedMHA.from_module(mha)
    out, w = ours(q, k, v, need_weights=False, attn_mask=mask, is_causal=is_causal)
    assert w is None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_mha_bfloat16_runs_tileops_within_torch_error(case):
    _, kwargs, self_attn, Sq, Sk, is_causal = case
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True, **kwargs).eval()
    q, k, v = _mha_inputs(kwargs, self_attn, Sq, Sk, torch.float32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(Sq) if is_causal else None
    ref32, _ = mha(q, k, v, need_weights=False, attn_mask=mask, is_causal=is_causal)
    mha16 = copy.deepcopy(mha).bfloat16()
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    if self_attn:
        k16 = v16 = q16
    mask16 = mask.bfloat16() if is_causal else None
    torch16, _ = mha16(q16, k16, v16, need_weights=False, attn_mask=mask16, is_causal=is_causal)
    with RecordOps() as calls:
        out, _ = PatchedMHA.from_module(mha16)(q16, k16, v16, need_weights=False, attn_mask=mask16, is_causal=is_causal)
    assert "flash_attn_with_lse" in calls.tileops and "linear" in calls.tileops
    assert out.dtype == torch.bfloat16 and out.shape == ref32.shape
    assert rel_err(out, ref32) <= 2 * rel_err(torch16, ref32) + 1e-3


@pytest.fixture
def fresh_warnings(monkeypatch):
    from tilelang_ops import _warnings

    monkeypatch.setattr(_warnings, "_warned", set())


def test_mha_calls_it_cannot_serve_run_torch_and_warn_once(fresh_warnings):
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True, dropout=0.1).eval()
    ours = PatchedMHA.from_module(mha)
    x = torch.randn(2, 6, E)
    with pytest.warns(RuntimeWarning, match="need_weights=True"):
        out, w = ours(x, x, x)  # PyTorch's default need_weights=True
    ref, ref_w = mha(x, x, x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, ref_w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call does not warn again
        ours(x, x, x)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, -2:] = True
    with pytest.warns(RuntimeWarning, match="key_padding_mask"):
        out, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out, mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0])
    with pytest.raises(RuntimeError, match="Need attn_mask"):  # PyTorch's own error for a bare causal hint
        ours(x, x, x, need_weights=False, is_causal=True)
    ours.train()  # dropout 0.1 in training: torch's forward (random, so only shapes compared)
    with pytest.warns(RuntimeWarning, match="dropout"):
        assert ours(x, x, x, need_weights=False)[0].shape == x.shape


def test_patched_module_under_torch_compile_fullgraph():
    model = Block().bfloat16().eval()
    tilelang_ops.patch(model)
    x = torch.randn(2, 16, E, dtype=torch.bfloat16)
    ref = model(x)
    out = torch.compile(model, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, ref)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_patched_model_on_gpu_within_torch_error(dtype):
    torch.manual_seed(0)
    model32 = _model(device="cuda")
    x = torch.randn(4, 256, E, device="cuda")
    ref = model32(x)
    plain = copy.deepcopy(model32).to(dtype)
    patched = copy.deepcopy(model32).to(dtype)
    report = tilelang_ops.patch(patched)
    assert len(report.replaced) == 7
    theirs, ours = plain(x.to(dtype)), patched(x.to(dtype))
    for o, t, r in zip(ours, theirs, ref):
        assert rel_err(o, r) <= 2 * rel_err(t, r) + 1e-3


# ------------------------------------------------------------------------------ modules calling F.sdpa
import torch.nn.functional as F  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa  # noqa: E402


class SdpaAttention(torch.nn.Module):
    """A user attention module: packed QKV projection, F.scaled_dot_product_attention, output proj."""

    def __init__(self, dim=128, heads=2, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, S, C))


class ImportedSdpaAttention(SdpaAttention):
    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(imported_sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, C))


class SpelledOutSdpaAttention(SdpaAttention):
    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, C))


@pytest.mark.parametrize("cls", [SdpaAttention, ImportedSdpaAttention])
def test_modules_calling_sdpa_are_routed_to_ours_and_back(cls, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(cls(), torch.nn.LayerNorm(128)).to(torch.bfloat16)
    x = torch.randn(2, 33, 128, dtype=torch.bfloat16)
    before = model(x)
    calls = []
    real = tilelang_ops.ops.attention.flash_attn.impls[torch._C.DispatchKey.CPU]
    monkeypatch.setitem(tilelang_ops.ops.attention.flash_attn.impls, torch._C.DispatchKey.CPU, lambda *a: calls.append(1) or real(*a))
    report = tilelang_ops.patch(model)
    assert report.routed == ["0"] and "0: F.scaled_dot_product_attention -> tilelang_ops" in str(report)
    assert type(model[0]) is cls and set(model.state_dict()) == {"0.qkv.weight", "0.qkv.bias", "0.proj.weight", "0.proj.bias", "1.weight", "1.bias"}
    with torch.no_grad():
        after = model(x)
    assert calls == [1], "the routed forward did not reach tilelang_ops.flash_attn"
    assert rel_err(after, before) < 1e-2
    assert tilelang_ops.unpatch(model) == ["0"] and "forward" not in model[0].__dict__
    model(x)
    assert calls == [1], "unpatch left the routing in place"


def test_sdpa_spelled_out_is_left_alone_with_the_reason():
    model = torch.nn.Sequential(SpelledOutSdpaAttention())
    report = tilelang_ops.patch(model)
    assert report.routed == []
    why = dict(report.skipped)["0"]
    assert "scaled_dot_product_attention" in why and "cannot rebind" in why


def test_routed_module_under_torch_compile_fullgraph():
    model = torch.nn.Sequential(SdpaAttention()).to(torch.bfloat16)
    tilelang_ops.patch(model)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    out = torch.compile(model, backend="eager", fullgraph=True)(x)  # a graph break would raise
    assert rel_err(out, model(x)) < 1e-2
    torch._dynamo.reset()


class OursAlready(SdpaAttention):
    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(tilelang_ops.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, C))


def test_modules_already_calling_our_sdpa_are_not_reported_as_sdpa_users():
    report = tilelang_ops.patch(torch.nn.Sequential(OursAlready()))
    assert report.routed == [] and "0" not in dict(report.skipped)
