"""Host µs of a training step's worth of one op: forward with autograd recording plus
`backward()`, small inputs (the launch path, not GPU work), ours against the PyTorch peer, and
ours with the backward formulas' ops called through the dispatcher (`--ab`: the path before
`CustomOp.from_backward`), in turns in one process.

    python -m benchmarks.diag_backward_host [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import tilelang_ops.functional as TF
from benchmarks._timing import host_us, table, write_json
from tilelang_ops import _library


def cases(dev: str = "cuda"):
    bf = torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=bf, requires_grad=True)

    x, g = leaf(8, 1024), torch.randn(8, 1024, device=dev, dtype=bf)
    w, b = leaf(1024, 1024), leaf(1024)
    nw, nb = leaf(1024), leaf(1024)
    q, k, v = leaf(1, 128, 8, 128), leaf(1, 128, 8, 128), leaf(1, 128, 8, 128)
    go = torch.randn(1, 128, 8, 128, device=dev, dtype=bf)
    qt, kt, vt, got = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v, go))
    yield "softmax", lambda: TF.softmax(x, -1).backward(g), lambda: torch.softmax(x, -1).backward(g)
    yield "linear gelu_tanh", lambda: TF.linear(x, w, b, "gelu_tanh").backward(g), lambda: F.gelu(F.linear(x, w, b), approximate="tanh").backward(g)
    yield "linear", lambda: TF.linear(x, w, b).backward(g), lambda: F.linear(x, w, b).backward(g)
    yield "layer_norm", lambda: TF.layer_norm(x, (1024,), nw, nb).backward(g), lambda: F.layer_norm(x, (1024,), nw, nb).backward(g)
    yield "flash_attn", lambda: TF.flash_attn(q, k, v).backward(go), lambda: F.scaled_dot_product_attention(qt, kt, vt).backward(got.detach())


def _dispatched(self, *args):
    return self.op(*args)


def main(rounds: int) -> None:
    direct = _library.CustomOp.from_backward
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, ours, peer in cases():
            r = best.setdefault(name, {"op": name})
            ours()
            peer()
            torch.cuda.synchronize()
            for col, fn in (("dispatched_us", None), ("ours_us", None), ("torch_us", peer)):
                _library.CustomOp.from_backward = _dispatched if col == "dispatched_us" else direct
                us = host_us(fn or ours, n=1000, warmup=100)
                r[col] = min(r.get(col, us), us)
            _library.CustomOp.from_backward = direct
    rows = list(best.values())
    for r in rows:
        r["saved_us"] = r["dispatched_us"] - r["ours_us"]
        r["ratio"] = r["ours_us"] / r["torch_us"]
    write_json("backward_host", rows, {"rounds": rounds})
    print(table(rows, ["op", "dispatched_us", "ours_us", "saved_us", "torch_us", "ratio"]))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    main(p.parse_args().rounds)
