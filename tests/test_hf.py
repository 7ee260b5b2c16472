"""Hugging Face transformers: attn_implementation="tileops" (tilelang_ops.integrations.hf).

Tiny randomly initialised Llama (GQA 4:2), Qwen2 (MQA 4:1) and GPT-2 configs built with
``from_config`` (no hub downloads), head dim 64 so the attention kernel serves them. float32
logits must equal "sdpa"'s (float32 is not a kernel dtype: the call runs torch SDPA after a
one-time warning, so this checks the plumbing: registration, mask function, GQA, scaling).
bfloat16 runs torch.ops.tileops.flash_attn (its CPU reference here; counted), judged against
sdpa's own bfloat16 error vs float32, at most 2x (STYLE 9). Skips where transformers is absent.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.56", reason="transformers>=4.56 is not installed (optional extra: pip install 'tilelang_ops[hf]')")

import tilelang_ops  # noqa: E402
from tilelang_ops.integrations import hf  # noqa: E402

from .helpers import RecordOps, rel_err, requires_cuda  # noqa: E402

VOCAB, LAYERS = 96, 2
_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
CONFIGS = {
    "llama-gqa": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, **_TOKENS,
    ),
    "qwen2-mqa": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=1024, **_TOKENS,
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=LAYERS, n_head=2, n_positions=1024, **_TOKENS),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert hf.register() == "tileops"


@pytest.fixture
def fresh_warnings(monkeypatch):
    from tilelang_ops import _warnings

    monkeypatch.setattr(_warnings, "_warned", set())


def _pair(name, dtype=torch.float32):
    """(tileops model, sdpa model) with the same random weights, eval mode."""
    ours = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="tileops")
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "tileops" and ref.config._attn_implementation == "sdpa"
    return ours.to(dtype).eval(), ref.to(dtype).eval()


def _ids(batch=2, seq=24):
    return torch.randint(3, VOCAB, (batch, seq))


@pytest.mark.parametrize("name", CONFIGS)
def test_float32_logits_equal_sdpa(name, fresh_warnings):
    ours, ref = _pair(name)
    ids = _ids()
    with pytest.warns(RuntimeWarning, match="float32 is not served by the kernel"):
        out = ours(ids).logits
    torch.testing.assert_close(out, ref(ids).logits, rtol=1e-5, atol=1e-5)


def _bfloat16_within_sdpa_error(ours, ref, ids):
    """Logits of `ours` in bfloat16: our attention ran in every layer, and the error against the
    float32 reference is within twice SDPA's own bfloat16 error."""
    ref32 = ref(ids).logits
    ours.bfloat16(), ref.bfloat16()
    sdpa16 = ref(ids).logits
    with RecordOps() as calls:
        out = ours(ids).logits
    assert calls.tileops.count("flash_attn_with_lse") == LAYERS
    assert rel_err(out, ref32) <= 2 * rel_err(sdpa16, ref32) + 1e-3
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_bfloat16_runs_tileops_within_sdpa_error(name):
    _bfloat16_within_sdpa_error(*_pair(name), _ids())


@pytest.mark.parametrize("name", CONFIGS)
def test_causal_a_future_token_never_changes_earlier_logits(name):
    ours, _ = _pair(name, torch.bfloat16)
    ids = _ids(seq=20)
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1 - 3) % (VOCAB - 3) + 3
    a, b = ours(ids).logits, ours(changed).logits
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])  # the changed token itself does matter


def test_padding_mask_falls_back_to_sdpa_with_one_warning(fresh_warnings):
    ours, ref = _pair("llama-gqa", torch.bfloat16)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in the first sequence
    with RecordOps() as calls, pytest.warns(RuntimeWarning, match="materialized attention mask"):
        out = ours(ids, attention_mask=mask).logits
    assert "flash_attn_with_lse" not in calls.tileops
    torch.testing.assert_close(out, ref(ids, attention_mask=mask).logits, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        ours(ids, attention_mask=mask)
        # an all-ones mask is dropped by the mask function: no fallback, no warning
        with RecordOps() as calls:
            ours(ids, attention_mask=torch.ones_like(ids))
        assert calls.tileops.count("flash_attn_with_lse") == LAYERS


def _cache_kw(model, cache):
    import inspect

    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {key: cache}


def test_kv_cache_prefill_and_decode_match_full_forward():
    ours, _ = _pair("llama-gqa", torch.bfloat16)
    ids = _ids(seq=17)
    full = ours(ids).logits
    with RecordOps() as calls:
        pre = ours(ids[:, :-1], use_cache=True)
        step = ours(ids[:, -1:], use_cache=True, **_cache_kw(ours, pre.past_key_values))  # one query token: not causal
    assert calls.tileops.count("flash_attn_with_lse") == 2 * LAYERS
    torch.testing.assert_close(pre.logits, full[:, :-1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=2e-2, atol=2e-2)


def test_static_cache_prefill_runs_tileops_and_decode_falls_back(fresh_warnings):
    ours, _ = _pair("llama-gqa", torch.bfloat16)
    ids = _ids(seq=17)
    full = ours(ids).logits
    cache = transformers.StaticCache(config=ours.config, max_cache_len=32)
    with RecordOps() as calls:  # prefill: keys past the prompt are unwritten slots, cropped
        pre = ours(ids[:, :-1], use_cache=True, **_cache_kw(ours, cache))
    assert calls.tileops.count("flash_attn_with_lse") == LAYERS
    torch.testing.assert_close(pre.logits, full[:, :-1], rtol=2e-2, atol=2e-2)
    # decode: transformers materializes the slot mask for static caches, which the kernel cannot serve
    with pytest.warns(RuntimeWarning, match="materialized attention mask"):
        step = ours(ids[:, -1:], use_cache=True, **_cache_kw(ours, pre.past_key_values))
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=2e-2, atol=2e-2)


def test_compile_fullgraph_no_graph_breaks():
    ours, _ = _pair("llama-gqa", torch.bfloat16)
    ids = _ids()
    ref = ours(ids).logits
    out = torch.compile(ours, backend="eager", fullgraph=True)(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_patch_on_llama_fuses_the_gated_mlp():
    ours, ref = _pair("llama-gqa")
    ids = _ids()
    expect = ref(ids).logits
    report = tilelang_ops.patch(ours)
    assert [(n, new) for n, _, new in report.replaced] == [
        (f"model.layers.{i}.mlp.gate_proj", "tilelang_ops.nn.Linear(activation='silu')") for i in range(LAYERS)
    ]
    assert "SiLUActivation" in report.replaced[0][1]
    assert list(ours.state_dict()) == list(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float32 attention: torch SDPA
        torch.testing.assert_close(ours(ids).logits, expect, rtol=1e-5, atol=1e-5)
    tilelang_ops.unpatch(ours)
    assert type(ours.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"


def test_register_names_and_idempotence():
    assert hf.register() == "tileops" and hf.register("tileops") == "tileops"
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface._global_mapping["tileops"] is hf.attention_forward
    assert "tileops" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_bfloat16_within_sdpa_error(name):
    ours, ref = (m.cuda() for m in _pair(name))
    ids = _ids(batch=4, seq=512).cuda()
    out = _bfloat16_within_sdpa_error(ours, ref, ids)
    loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), ids.flatten())
    loss.backward()  # the backward op runs on the GPU too
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters() if p.requires_grad)
