"""What a C++ dispatch and autograd path would cost per call (#4's host overhead), on this CPU.

    python -m benchmarks.cpp_floor [--n 20000]

Builds (torch.utils.cpp_extension, ~1-2 min the first time) a C++ op with flash_attn_with_lse's
schema and host work — the argument checks, two output allocations, a launch through a function
pointer (a no-op here: a GPU host would pack the tensors and call TileLang's host function) — and
its autograd formula as a C++ `torch::autograd::Function` saving the five tensors ours saves.
Prints µs per call beside the same calls through our Python op (benchmarks.host_standin's
stand-in: everything but the GPU work) and the floors host_standin --floor measures. The
difference is what moving an op's host path to C++ would save, before the launch itself
(cuLaunchKernel, 3.5-4.5 µs on the GPU hosts; twenty-fifth session), which no path avoids.
Nothing here is shipped: it is a measurement for deciding whether the C++ path is worth building.
"""
from __future__ import annotations

import argparse

import torch

_SRC = r"""
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace {

// stand-in for the TileLang host function: a GPU build would fill DLTensor arguments and call it
using Launch = void (*)(void* const*, int);
void noop_launch(void* const*, int) {}
Launch g_launch = noop_launch;

std::tuple<at::Tensor, at::Tensor> attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  // the checks ops.attention._check_qkv makes, with its messages' shape
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "flash_attn: q, k, v must be 4-D (batch, seqlen, nheads, headdim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "flash_attn: q, k, v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "flash_attn: dtype must be bfloat16 or float16");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "flash_attn: q, k, v must be on one device");
  TORCH_CHECK(k.sizes() == v.sizes(), "flash_attn: k and v must have the same shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "flash_attn: batch and headdim of q and k must match");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "flash_attn: nheads must be a multiple of nheads_kv");
  int64_t d = q.size(3);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "flash_attn: headdim must be 64, 128 or 256");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "flash_attn: the last dim must be contiguous");
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  void* const args[5] = {q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()};
  g_launch(args, causal ? 1 : 0);
  return {out, lse};
}

class AttnFunction : public torch::autograd::Function<AttnFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, bool causal) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = attn(q, k, v, causal);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    return {out, lse};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    return {g[0], at::Tensor(), at::Tensor(), at::Tensor()};  // not measured: the forward's cost only
  }
};

std::tuple<at::Tensor, at::Tensor> attn_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  auto r = AttnFunction::apply(q, k, v, causal);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY(tileops_cpp_floor, m) { m.def("attn(Tensor q, Tensor k, Tensor v, bool causal=False) -> (Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(tileops_cpp_floor, CPU, m) { m.impl("attn", attn); }
TORCH_LIBRARY_IMPL(tileops_cpp_floor, Autograd, m) { m.impl("attn", attn_autograd); }
"""


def build() -> None:
    from torch.utils.cpp_extension import load_inline

    load_inline("tileops_cpp_floor", cpp_sources=[_SRC], is_python_module=False, extra_cflags=["-O2"], verbose=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000, help="calls timed per row (median of per-call wall times)")
    a = p.parse_args(argv)
    build()
    from benchmarks._timing import host_us
    from benchmarks.host_standin import install_standin

    install_standin()  # our ops' CUDA path on CPU tensors, launches no-ops
    bf = torch.bfloat16
    q = torch.randn(1, 128, 8, 128, dtype=bf)
    qr = q.clone().requires_grad_()
    ops, cpp = torch.ops.tileops, torch.ops.tileops_cpp_floor
    rows = [
        ("tileops.flash_attn_with_lse (Python op, stand-in)", lambda: ops.flash_attn_with_lse(q, q, q)),
        ("C++ op: checks, 2 allocations, no-op launch", lambda: cpp.attn(q, q, q)),
        ("tileops.flash_attn_with_lse, grad-recording", lambda: ops.flash_attn_with_lse(qr, q, q)),
        ("C++ op, grad-recording (C++ autograd::Function, 5 saved)", lambda: cpp.attn(qr, q, q)),
        ("torch.empty_like(q) (one allocation, for scale)", lambda: torch.empty_like(q)),
    ]
    for _ in range(2):  # the second pass is the one to read (the first warms caches and branch predictors)
        for name, fn in rows:
            print(f"{name:60s} {host_us(fn, n=a.n):6.2f} µs", flush=True)
        print()


if __name__ == "__main__":
    main()
