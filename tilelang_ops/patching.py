"""Model patching: `patch(model)` swaps supported modules for tilelang_ops ones in place and reports
what it replaced and what it left alone (and why); `unpatch(model)` puts the originals back.

Replaced modules share their parameters with the originals (no copies), so state_dict keys and
values are unchanged, and weights trained after `patch` are still there after `unpatch`.
"""
from __future__ import annotations

import dataclasses
import dis
import sys
import types

import torch

from . import functional as _F
from . import nn as _nn
from ._warnings import warn_once

# The list of (qualified name, original module) swaps, oldest first, kept on the patched model so
# that `unpatch(model)` needs nothing else. A plain attribute: not a submodule, not in state_dict.
_ORIGINALS_ATTR = "_tileops_originals"
_ROUTED = object()  # in place of an original module: the module stayed, only its forward was routed


# ---------------------------------------------------------------- MultiheadAttention
class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` (batch_first=True) whose attention is
    ``tilelang_ops.scaled_dot_product_attention`` and whose projections are ``tilelang_ops.linear``.

    Same parameters and state_dict keys as the module it is made from (`from_module` shares them).
    The fast path serves ``need_weights=False`` with no ``attn_mask`` and no ``key_padding_mask``
    (``is_causal=True`` with an ``attn_mask`` is taken as the causal mask, as PyTorch does), and
    no dropout (``dropout == 0`` or eval mode), on batched 3-D inputs. Any other call runs
    PyTorch's ``nn.MultiheadAttention.forward`` unchanged and warns once per reason.
    """

    @classmethod
    def from_module(cls, mha: torch.nn.MultiheadAttention) -> "MultiheadAttention":
        """A module sharing `mha`'s parameters, buffers, submodules (out_proj) and settings."""
        new = cls.__new__(cls)
        # Shallow-copy every dict (parameters, submodules, hooks) so the two modules share tensors
        # and children but registering something on one does not register it on the other.
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in mha.__dict__.items()})
        return new

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, attention=tilelang_ops"

    def _unsupported(self, query, key, value, key_padding_mask, need_weights, attn_mask) -> str | None:
        if need_weights:
            return "need_weights=True (attention weights are never materialized by the kernel; pass need_weights=False)"
        if attn_mask is not None:
            return "attn_mask is given"
        if key_padding_mask is not None:
            return "key_padding_mask is given"
        if self.training and self.dropout > 0.0:
            return "attention dropout in training mode"
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            return "unbatched (2-D) input"
        return None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
        mask = attn_mask
        if is_causal and attn_mask is not None and key_padding_mask is None and not need_weights:
            mask = None  # PyTorch trusts the hint the same way: attn_mask is the causal mask
        why = self._unsupported(query, key, value, key_padding_mask, need_weights, mask)
        if why is not None or (is_causal and attn_mask is None):  # the latter: PyTorch's error, unchanged
            if why is not None:
                warn_once(f"tilelang_ops.patching.MultiheadAttention: {why}; running torch.nn.MultiheadAttention.forward instead")
            return super().forward(
                query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                average_attn_weights=average_attn_weights, is_causal=is_causal,
            )
        B, Sq, E = query.shape
        H, D = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim and query is key and key is value:  # self-attention: one GEMM, (B, S, 3E)
            q, k, v = _F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            if self._qkv_same_embed_dim:
                wq, wk, wv = self.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            bq, bk, bv = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
            q, k, v = _F.linear(query, wq, bq), _F.linear(key, wk, bk), _F.linear(value, wv, bv)
        q, k, v = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = _F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, Sq, D)
        out = _F.linear(out.transpose(1, 2).reshape(B, Sq, E), self.out_proj.weight, self.out_proj.bias)
        return out, None


def _mha_unsupported(m: torch.nn.MultiheadAttention) -> str | None:
    if not m.batch_first:
        return "nn.MultiheadAttention with batch_first=False (only the batch-first layout is patched)"
    if m.bias_k is not None:
        return "nn.MultiheadAttention with add_bias_kv=True"
    if m.add_zero_attn:
        return "nn.MultiheadAttention with add_zero_attn=True"
    return None


# ---------------------------------------------------------------- modules that call F.scaled_dot_product_attention
_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_NAME = "scaled_dot_product_attention"


def _functional_with_our_sdpa() -> types.ModuleType:
    """A copy of ``torch.nn.functional`` whose scaled_dot_product_attention is ours (every other
    name is the torch object itself): what a routed forward sees where its module sees ``F``."""
    shim = types.ModuleType("torch.nn.functional", "torch.nn.functional, with tilelang_ops' SDPA")
    shim.__dict__.update({k: v for k, v in vars(torch.nn.functional).items() if k not in ("__name__", "__doc__")})
    setattr(shim, _SDPA_NAME, _F.scaled_dot_product_attention)
    return shim


_SHIM: types.ModuleType | None = None


def _sdpa_references(code, g: dict) -> tuple[int, set[str]]:
    """Where `code` (and the functions nested in it) reaches torch's SDPA through globals:
    (how many references go through an attribute chain we cannot rebind, such as
    `torch.nn.functional.scaled_dot_product_attention`; the global names that reach it directly:
    `X.scaled_dot_product_attention` with X torch.nn.functional, or torch's SDPA imported under
    any name). Chains that resolve to something else (tilelang_ops' own SDPA) are not counted."""
    other, via, chain = 0, set(), None
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            chain = [ins.argval]
            if g.get(ins.argval) is _SDPA:
                via.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            obj = g.get(chain[0])
            for attr in chain[1:] + [ins.argval]:
                obj = getattr(obj, attr, None)
            if obj is _SDPA:
                if len(chain) == 1 and g.get(chain[0]) is torch.nn.functional:
                    via.add(chain[0])
                else:
                    other += 1
            chain.append(ins.argval)
        else:
            chain = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            n, v = _sdpa_references(const, g)
            other, via = other + n, via | v
    return other, via


def _routed_globals(fn, rebind: dict) -> dict:
    """The globals a routed forward runs with: a snapshot of its module's globals with `rebind`
    applied, as the namespace of a module registered in sys.modules (Dynamo resolves the globals
    of a function it inlines through sys.modules[globals['__name__']])."""
    name = f"tilelang_ops._routed.{fn.__globals__.get('__name__', 'anonymous')}"
    mod = sys.modules.get(name)
    if mod is None:
        mod = sys.modules[name] = types.ModuleType(name)
        mod.__dict__.update({k: v for k, v in fn.__globals__.items() if k not in ("__name__", "__spec__", "__loader__")})
    mod.__dict__.update(rebind)
    return mod.__dict__


def _sdpa_route(m: torch.nn.Module):
    """(routed forward function, "") when `m`'s class forward calls F.scaled_dot_product_attention
    only through global names we can rebind; (None, why) when it calls it otherwise; (None, "")
    when not at all.

    The forward's code is reused with globals in which the names that reach SDPA — `F` (any alias
    of torch.nn.functional) or torch's SDPA imported under any name — point to tilelang_ops'
    drop-in, which runs our kernel where it can and torch's SDPA otherwise. No per-call cost, and
    Dynamo traces it like the original. The globals are a snapshot taken at the first patch of a
    class from that module.
    """
    global _SHIM
    fn = getattr(type(m).forward, "__func__", type(m).forward)
    code = getattr(fn, "__code__", None)
    if code is None or type(m).__module__.startswith("torch."):
        return None, ""
    g = fn.__globals__
    other, via = _sdpa_references(code, g)
    if not other and not via:
        return None, ""
    rebind = {}
    for name in via:  # each is torch.nn.functional or torch's SDPA itself
        if g[name] is torch.nn.functional:
            _SHIM = _SHIM or _functional_with_our_sdpa()
            rebind[name] = _SHIM
        else:
            rebind[name] = _F.scaled_dot_product_attention
    if other:
        return None, (f"{type(m).__name__}.forward reaches torch's scaled_dot_product_attention through an attribute "
                      f"chain (e.g. torch.nn.functional.scaled_dot_product_attention), which patch() cannot rebind")
    if "forward" in m.__dict__:
        return None, f"{type(m).__name__} has an instance-level forward already (not routed twice)"
    new = types.FunctionType(code, _routed_globals(fn, rebind), fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return new, ""


# ---------------------------------------------------------------- report
@dataclasses.dataclass
class PatchReport:
    """What `patch` did.

    replaced: (qualified name, what it was, what it is now), in model order.
    skipped: (qualified name, why it was left alone) for every leaf module not replaced, and for
        modules `fuse_linear_activations` could not read.
    routed: qualified names of modules kept in place whose forward now calls tilelang_ops'
        scaled_dot_product_attention where it called torch's.
    fuse: the `tilelang_ops.nn.FuseReport` of the Linear + activation pass.
    originals: (qualified name, original module) for each swap; `unpatch` restores from these.
    """

    replaced: list = dataclasses.field(default_factory=list)
    routed: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    fuse: _nn.FuseReport = dataclasses.field(default_factory=_nn.FuseReport)
    originals: list = dataclasses.field(default_factory=list, repr=False)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} module(s), routed {len(self.routed)}, left {len(self.skipped)} alone"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  {name}: F.scaled_dot_product_attention -> tilelang_ops.scaled_dot_product_attention" for name in self.routed]
        by_reason: dict[str, list] = {}
        for name, why in self.skipped:
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            shown = ", ".join(n or "<root>" for n in names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  left alone: {why}: {shown}")
        return "\n".join(lines)


# ---------------------------------------------------------------- patch / unpatch
def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _type_name(m: torch.nn.Module) -> str:
    t = type(m)
    return f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else t.__name__


_OURS = (_nn.Linear, _nn.Softmax, _nn.LogSoftmax, MultiheadAttention)


def _replacement(m: torch.nn.Module) -> tuple[torch.nn.Module | None, str]:
    """(new module, "") or (None, why it stays)."""
    if isinstance(m, _OURS):
        return None, "already a tilelang_ops module"
    for base, ours in ((torch.nn.Softmax, _nn.Softmax), (torch.nn.LogSoftmax, _nn.LogSoftmax)):
        if isinstance(m, base):
            if type(m) is not base:
                return None, f"subclass of nn.{base.__name__} (its forward may differ)"
            if m.dim is None:
                return None, f"nn.{base.__name__}(dim=None): implicit dim is not supported"
            return ours(m.dim), ""
    if isinstance(m, torch.nn.MultiheadAttention):
        if type(m) is not torch.nn.MultiheadAttention:
            return None, "subclass of nn.MultiheadAttention (its forward may differ)"
        why = _mha_unsupported(m)
        return (None, why) if why else (MultiheadAttention.from_module(m), "")
    if type(m) is torch.nn.Linear:
        return None, "nn.Linear without a fusable activation after it (stays on torch)"
    if _nn._activation_name(m) is not None:
        return None, "activation not fed by exactly one nn.Linear (nothing to fuse into)"
    return None, f"no tilelang_ops equivalent ({_type_name(m)})"


def patch(model: torch.nn.Module) -> PatchReport:
    """Swap, in place, the modules of `model` that tilelang_ops serves, and report.

    - ``nn.Linear`` followed by ReLU / GELU / GELU(tanh) / SiLU (torch's or transformers'
      activation modules): `tilelang_ops.nn.fuse_linear_activations` (fused `tilelang_ops.nn.Linear`
      + ``nn.Identity``);
    - ``nn.Softmax(dim)`` / ``nn.LogSoftmax(dim)`` -> `tilelang_ops.nn.Softmax` / `LogSoftmax`;
    - ``nn.MultiheadAttention(batch_first=True)`` without add_bias_kv / add_zero_attn ->
      `tilelang_ops.patching.MultiheadAttention` (same parameters; calls it cannot serve run
      PyTorch's forward, with a one-time warning);
    - any other module whose forward calls ``F.scaled_dot_product_attention`` (or an imported
      ``scaled_dot_product_attention``) stays in place, and its forward calls
      `tilelang_ops.scaled_dot_product_attention` instead (same semantics: it runs torch's SDPA for
      what our kernel does not serve). Listed in ``report.routed``.
    Everything else is left alone and listed in ``report.skipped`` with the reason (exact types
    only: a subclass may override forward). Parameters are shared, never copied: state_dict keys
    and values are unchanged. `unpatch(model)` restores the original modules.

    Returns:
        A `PatchReport`; ``print(report)`` summarizes it.
    """
    report = PatchReport()
    before = dict(model.named_modules(remove_duplicate=False))
    report.fuse = _nn.fuse_linear_activations(model)
    for lin, act, kind in report.fuse.fused:
        report.originals += [(lin, before[lin]), (act, before[act])]
        report.replaced.append((lin, f"nn.Linear + {_type_name(before[act])} ({act})", f"tilelang_ops.nn.Linear(activation={kind!r})"))
    report.skipped += report.fuse.skipped
    fused = {n for lin, act, _ in report.fuse.fused for n in (lin, act)}
    fuse_skipped = dict(report.fuse.skipped)

    swaps: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
    done: dict[int, torch.nn.Module] = {}  # a module registered under several names: one replacement
    covered: list[str] = []  # names whose descendants belong to a module already decided on
    for name, m in model.named_modules(remove_duplicate=False):
        if name in fused or any(name.startswith(p + ".") for p in covered):
            continue
        routed, why_not = _sdpa_route(m)
        if routed is not None:
            m.forward = types.MethodType(routed, m)  # an instance attribute: unpatch deletes it
            report.routed.append(name)
            continue  # the module stays; its children are looked at one by one
        if why_not:
            report.skipped.append((name, why_not))
            continue
        if isinstance(m, torch.nn.MultiheadAttention):
            covered.append(name)  # out_proj is part of the attention, not a Linear of its own
        elif next(m.children(), None) is not None:
            continue  # a container: its children are looked at one by one
        new, why = (done[id(m)], "") if id(m) in done else _replacement(m)
        if new is None:
            if name not in fuse_skipped:
                report.skipped.append((name, why))
            continue
        if name == "":
            report.skipped.append((name, "the root module cannot be replaced in place (use tilelang_ops.nn directly)"))
            continue
        done[id(m)] = new
        swaps.append((name, m, new))
    for name, old, new in swaps:
        _set(model, name, new)
        report.originals.append((name, old))
        report.replaced.append((name, _type_name(old), f"tilelang_ops.{'patching' if isinstance(new, MultiheadAttention) else 'nn'}.{type(new).__name__}"))
    order = {name: i for i, name in enumerate(before)}
    report.replaced.sort(key=lambda r: order[r[0]])
    report.originals += [(name, _ROUTED) for name in report.routed]
    if report.originals:
        model.__dict__.setdefault(_ORIGINALS_ATTR, []).extend(report.originals)
    return report



def unpatch(model: torch.nn.Module, report: PatchReport | None = None) -> list[str]:
    """Put back the modules `patch` replaced (all patches of `model`, or only `report`'s).

    Returns the qualified names restored, most recent swap first. Parameters were shared all along,
    so any training done while patched is kept.
    """
    stack = model.__dict__.get(_ORIGINALS_ATTR, [])
    entries = list(report.originals) if report is not None else list(stack)
    restored = []
    for name, original in reversed(entries):
        if original is _ROUTED:
            model.get_submodule(name).__dict__.pop("forward", None)
        else:
            _set(model, name, original)
        restored.append(name)
    if report is None:
        stack.clear()
    else:
        ids = {(n, id(o)) for n, o in entries}
        stack[:] = [(n, o) for n, o in stack if (n, id(o)) not in ids]
    if not stack:
        model.__dict__.pop(_ORIGINALS_ATTR, None)
    return restored
