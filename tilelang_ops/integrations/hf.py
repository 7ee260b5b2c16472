"""Hugging Face transformers: ``attn_implementation="tileops"``.

    import tilelang_ops.integrations.hf as tileops_hf
    tileops_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tileops")

`register()` adds an attention function to transformers' ``AttentionInterface`` and, under the same
name, a mask function to ``AttentionMaskInterface``. The mask function matters: for a name with no
mask function, transformers builds no mask at all, so padding (and any mask that is not plain
causal) would be dropped without a word. We register transformers' own SDPA mask builder, which
returns None exactly when the mask is plain causal (or absent) and SDPA's ``is_causal`` can stand
for it; the attention function then runs `tilelang_ops.scaled_dot_product_attention`. A mask that
was materialized (padding, packed sequences, sliding window beyond the window, custom masks) is not
served by the kernel: that call runs transformers' SDPA attention with the mask, after a one-time
warning, so results are never silently wrong.

transformers is an optional dependency (``pip install tilelang_ops[hf]``); importing this module
does not import it, `register()` does.
"""
from __future__ import annotations

import torch

from .. import functional as _F
from .._warnings import warn_once
from ..ops.attention import DTYPES, HEADDIMS

NAME = "tileops"
MIN_TRANSFORMERS = "4.56"

def _warn_once(why: str) -> None:
    warn_once(f"attn_implementation={NAME!r}: {why}; such calls run transformers' SDPA attention instead")


def _fallback_reason(query, key, value, attention_mask, dropout, scaling, causal, kwargs) -> str | None:
    if attention_mask is not None:
        return "a materialized attention mask (padding, packed sequences, sliding window or custom) is not served by the kernel"
    for name in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return f"{name} is not supported by the kernel"
    if dropout:
        return "attention dropout (training mode) is not supported by the kernel"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} is not served by the kernel (float16 / bfloat16 only)"
    if query.shape[-1] not in HEADDIMS or value.shape[-1] != query.shape[-1]:
        return f"head dim {query.shape[-1]} (value {value.shape[-1]}) is not served by the kernel (64, 128 or 256)"
    if not _F._sdpa_supported(query, key, value, None, 0.0, causal, scaling, key.shape[1] != query.shape[1]):
        return f"shapes q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)} or scale {scaling!r} are not served by the kernel"
    return None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over `tilelang_ops.scaled_dot_product_attention`.

    Args:
        module: the calling attention module; its ``is_causal`` (default True) applies when the
            call does not pass ``is_causal``.
        query: (batch, heads, seqlen_q, head_dim).
        key, value: (batch, kv_heads, seqlen_k, head_dim); heads % kv_heads == 0 (GQA/MQA: K/V
            are not repeated, the kernel maps query head h to kv head h // (heads // kv_heads)).
        attention_mask: None when the mask is plain causal or absent (what our registered mask
            function returns in that case); anything else runs transformers' SDPA attention.
        dropout: attention dropout probability; non-zero runs transformers' SDPA attention.
        scaling: softmax scale, default 1 / sqrt(head_dim).
        is_causal: overrides ``module.is_causal``.

    Returns:
        (attn_output (batch, seqlen_q, heads, head_dim) contiguous, None): no attention weights.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1  # one query token sees the whole cache
    k, v = key, value
    if causal and kv_len > q_len:
        # Only reachable in prefill of an empty static cache (the mask builder materializes every
        # other causal mask with kv_len != q_len): keys past q_len are unwritten slots.
        k, v = key[:, :, :q_len], value[:, :, :q_len]
    why = _fallback_reason(query, k, v, attention_mask, dropout, scaling, causal, kwargs)
    if why is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _warn_once(why)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    # Checked above (what the SDPA drop-in would check again): the kernel directly, on
    # (B, S, H, D) transposed views read in place; its output is already (B, Sq, H, D) contiguous.
    out = torch.ops.tileops.flash_attn(query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scaling)
    return out, None


def register(name: str = NAME) -> str:
    """Register ``attn_implementation=name`` (default "tileops") with transformers; idempotent.

    Returns the name, to pass as ``attn_implementation`` to ``from_config`` / ``from_pretrained``
    or to ``model.set_attn_implementation``.

    Raises:
        ImportError: transformers is not installed, or older than 4.56 (no AttentionMaskInterface:
            without a mask function a custom attention would silently lose the causal mask).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(
            f"tilelang_ops.integrations.hf needs transformers>={MIN_TRANSFORMERS} with AttentionInterface and "
            f"AttentionMaskInterface (pip install 'tilelang_ops[hf]'): {e}"
        ) from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
