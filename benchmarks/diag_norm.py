"""Diagnostic (GPU): tileops LayerNorm against PyTorch inside autograd and inside a 2-layer GPT step
(eager and compiled): losses and the worst parameter-gradient differences.

    python3 benchmarks/diag_norm.py
"""
import copy
import importlib.util
import pathlib

import torch
import torch.nn.functional as F

import tilelang_ops

torch.manual_seed(0)
dev = "cuda"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# (a) op level, the training shapes
x = torch.randn(16, 1024, 768, device=dev) * 2 + 0.3
w = torch.randn(768, device=dev)
b = torch.randn(768, device=dev)
dy = torch.randn(16, 1024, 768, device=dev).bfloat16()
leaves = [t.clone().requires_grad_() for t in (x, w, b)]
y = tilelang_ops.layer_norm(leaves[0], 768, leaves[1], leaves[2], out_dtype=torch.bfloat16)
y.backward(dy)
ref = [t.clone().requires_grad_() for t in (x, w, b)]
yr = F.layer_norm(ref[0], (768,), ref[1], ref[2]).to(torch.bfloat16)
yr.backward(dy)
print("a) y equal frac", (y == yr).float().mean().item(), "max|dy|", (y.float() - yr.float()).abs().max().item())
print("a) dx/dw/db rel", [rel(l.grad, r.grad) for l, r in zip(leaves, ref)])
_, mean, rstd = torch.ops.tileops.layer_norm(x, w, b, 1e-5, torch.bfloat16)
dx, dw, db = torch.ops.tileops.layer_norm_backward(dy, x, w, mean, rstd)
print("a) direct dx/dw/db rel", rel(dx, ref[0].grad), rel(dw, ref[1].grad), rel(db, ref[2].grad))
m_ref = x.mean(-1)
print("a) mean/rstd rel", rel(mean, m_ref), rel(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)))

# (b) GPT step: torch LN vs tileops LN (only), eager; and tileops LN compiled
spec = importlib.util.spec_from_file_location("train_gpt", pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py")
tg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tg)
torch.manual_seed(0)
base = tg.GPT(2, 768, 12, 1024).to(dev)
idx = torch.randint(0, 256, (16, 1024), device=dev)
tgt = torch.randint(0, 256, (16, 1024), device=dev)


def grads(model, compiled=False):
    model.zero_grad(set_to_none=True)
    f = torch.compile(model, fullgraph=True) if compiled else model
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = f(idx, tgt)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def with_ln(m):
    m = copy.deepcopy(m)
    for blk in m.blocks:
        blk.ln1 = tilelang_ops.nn.LayerNorm.from_layer_norm(blk.ln1, out_dtype=torch.bfloat16)
        blk.ln2 = tilelang_ops.nn.LayerNorm.from_layer_norm(blk.ln2, out_dtype=torch.bfloat16)
    m.ln_f = tilelang_ops.nn.LayerNorm.from_layer_norm(m.ln_f, out_dtype=torch.bfloat16)
    return m


def full(m):
    m = copy.deepcopy(m)
    tg.to_tileops(m)
    return m


l0, g0 = grads(base)
l0b, g0b = grads(copy.deepcopy(base))
for name, model, comp in (("ln-eager", with_ln(base), False), ("ln-compiled", with_ln(base), True), ("full-eager", full(base), False), ("full-compiled", full(base), True)):
    l1, g1 = grads(model, comp)
    worst = sorted(((rel(g1[n], g0[n]), n) for n in g0), reverse=True)[:4]
    print(f"b) {name}: loss {l1:.5f} vs torch {l0:.5f} (torch rerun {l0b:.5f}); worst grads {[(round(e, 4), n) for e, n in worst]}")
print("b) torch vs torch rerun worst", sorted(((rel(g0b[n], g0[n]), n) for n in g0), reverse=True)[:2])
