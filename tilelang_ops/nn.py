"""Drop-in nn.Modules: thin wrappers that hold parameters and call the functional ops."""
from __future__ import annotations

import dataclasses

import torch

from . import functional as _F

# ---------------------------------------------------------------- Linear (+ fused activation)

_ACT_OF_MODULE = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}
# Hugging Face transformers' activation modules (ACT2FN), matched by name so that this file never
# imports transformers. Each computes exactly the named function (GELUActivation: erf GELU in
# either mode; NewGELUActivation: the tanh formula written out; GELUTanh = PytorchGELUTanh).
_ACT_OF_HF_MODULE = {
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
}


def _activation_name(m: torch.nn.Module) -> str | None:
    if isinstance(m, torch.nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate)
    if type(m).__module__ == "transformers.activations":
        return _ACT_OF_HF_MODULE.get(type(m).__name__)
    return _ACT_OF_MODULE.get(type(m))


def _check_linear_args(activation: str, backend: str) -> None:
    from .ops._checks import check_activation

    check_activation(activation)
    _F.check_backend(backend, activation)


class Linear(torch.nn.Linear):
    """``act(x @ weight.T + bias)`` as one TileLang kernel; a drop-in for ``nn.Linear`` (+ activation).

    Same constructor, parameters, initialization and state_dict keys as ``torch.nn.Linear``, so
    checkpoints of ``nn.Linear`` (followed by an activation module) load unchanged.
    ``activation``: "none" | "relu" | "gelu" | "gelu_tanh" | "silu".
    ``backend``: "tilelang" (default) or "cublas" (PyTorch's GEMMs, our bias gradient; activation
    "none" only): see ``tilelang_ops.functional.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "none", device=None, dtype=None, backend: str = "tilelang"):
        _check_linear_args(activation, backend)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation, self.backend = activation, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F._linear(x, self.weight, self.bias, self.activation, self.backend)  # checked at construction

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}" + (f", backend={self.backend}" if self.backend != "tilelang" else "")

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activation: str = "none", backend: str = "tilelang") -> "Linear":
        """A fused module sharing `linear`'s parameters (no copy)."""
        _check_linear_args(activation, backend)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features, new.activation, new.backend = linear.in_features, linear.out_features, activation, backend
        new.weight = linear.weight
        new.bias = linear.bias
        return new


class MLP(torch.nn.Module):
    """``fc2(act(fc1(x)))`` as `tilelang_ops.functional.mlp`: a Linear-activation-Linear block
    whose backward fuses act' into a GEMM epilogue (see there).

    ``fc1`` and ``fc2`` are ``torch.nn.Linear`` modules (initialization and parameters as
    ``nn.Linear``'s), so the state_dict keys are ``fc1.weight``, ``fc1.bias``, ``fc2.weight``,
    ``fc2.bias``. `from_linears` builds one around existing Linear modules (sharing their
    parameters), e.g. the first and last entries of ``nn.Sequential(Linear, GELU, Linear)``.
    ``activation``: "relu" | "gelu" | "gelu_tanh" | "silu".
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, bias: bool = True, activation: str = "gelu_tanh", device=None, dtype=None):
        _check_mlp_activation(activation)
        super().__init__()
        self.activation = activation
        self.fc1 = torch.nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(hidden_features, out_features or in_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"

    @classmethod
    def from_linears(cls, fc1: torch.nn.Linear, activation: str, fc2: torch.nn.Linear) -> "MLP":
        """An MLP over these two Linear modules (shared, not copied); fc2 must take fc1's output."""
        _check_mlp_activation(activation)
        if fc2.in_features != fc1.out_features:
            raise ValueError(f"fc2: in_features {fc2.in_features} must equal fc1's out_features {fc1.out_features}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.activation, new.fc1, new.fc2 = activation, fc1, fc2
        return new


def _check_mlp_activation(activation: str) -> None:
    from .ops.gemm import check_grad_activation

    check_grad_activation(activation, "MLP")


@dataclasses.dataclass
class FuseReport:
    """What `fuse_linear_activations` did: fused (linear, activation, kind) and skipped (module, why)."""

    fused: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} Linear+activation pair(s)"]
        lines += [f"  {lin} + {act} -> Linear(activation={kind})" for lin, act, kind in self.fused]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _activation_leaf_tracer():
    import torch.fx

    class Tracer(torch.fx.Tracer):
        # fx traces into modules defined outside torch.nn (transformers' SiLUActivation, ...);
        # a recognized activation must stay one call_module node to be matched.
        def is_leaf_module(self, m, qualname):
            return _activation_name(m) is not None or super().is_leaf_module(m, qualname)

    return Tracer()


def fuse_linear_activations(model: torch.nn.Module) -> FuseReport:
    """Replace ``nn.Linear`` followed by ReLU / GELU / GELU(tanh) / SiLU with a fused `Linear`.

    Activations are torch.nn's modules or transformers' (SiLUActivation, GELUActivation, GELUTanh,
    NewGELUActivation), matched by exact type.

    Looks inside every submodule that has both a Linear and a supported activation as direct
    children (``nn.Sequential`` and MLP-style blocks such as ``act(fc1(x))`` or LLaMA's
    ``act_fn(gate_proj(x)) * up_proj(x)``). The data flow is read with ``torch.fx``: a pair is
    fused only when the activation's sole input is that Linear's output, the Linear's output feeds
    nothing else, and each module is called once. The Linear becomes a fused `Linear` sharing the
    same parameters (state_dict keys unchanged) and the activation becomes ``nn.Identity``.
    Modules that fx cannot trace are left alone and reported. Modifies `model` in place.
    """
    import torch.fx

    report = FuseReport()
    names = {m: n for n, m in model.named_modules()}
    for parent in list(model.modules()):
        kids = dict(parent.named_children())
        if not any(type(k) is torch.nn.Linear for k in kids.values()) or not any(_activation_name(k) for k in kids.values()):
            continue
        pname = names.get(parent, "")
        try:
            graph = _activation_leaf_tracer().trace(parent)
        except Exception as e:  # data-dependent control flow etc.: leave the block as it is
            report.skipped.append((pname or type(parent).__name__, f"not traceable by torch.fx ({type(e).__name__})"))
            continue
        calls: dict[str, list] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(node.target, []).append(node)
        for node in graph.nodes:
            if node.op != "call_module" or "." in node.target or type(kids.get(node.target)) is not torch.nn.Linear:
                continue
            users = list(node.users)
            if len(users) != 1 or users[0].op != "call_module" or "." in users[0].target:
                continue
            act_name = users[0].target
            kind = _activation_name(kids.get(act_name))
            if kind is None:
                continue
            if len(calls[node.target]) != 1 or len(calls[act_name]) != 1:
                report.skipped.append((f"{pname}.{node.target}".lstrip("."), "module called more than once"))
                continue
            setattr(parent, node.target, Linear.from_linear(kids[node.target], kind))
            setattr(parent, act_name, torch.nn.Identity())
            report.fused.append((f"{pname}.{node.target}".lstrip("."), f"{pname}.{act_name}".lstrip("."), kind))
    return report


# ---------------------------------------------------------------- Softmax / LogSoftmax


class Softmax(torch.nn.Softmax):
    """Drop-in for ``torch.nn.Softmax(dim)`` running ``tilelang_ops.functional.softmax``.

    ``dim=None`` (PyTorch's legacy implicit dim) is not supported: pass the dim explicitly.
    """

    def __init__(self, dim: int = -1) -> None:
        if dim is None:
            raise ValueError("dim: None (implicit dim) is not supported; pass the dim explicitly")
        super().__init__(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F.softmax(x, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """Drop-in for ``torch.nn.LogSoftmax(dim)`` running ``tilelang_ops.functional.log_softmax``."""

    def __init__(self, dim: int = -1) -> None:
        if dim is None:
            raise ValueError("dim: None (implicit dim) is not supported; pass the dim explicitly")
        super().__init__(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _F.log_softmax(x, self.dim)


# ---------------------------------------------------------------- LayerNorm


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` running ``tilelang_ops.functional.layer_norm``.

    Same constructor, parameters and state_dict keys. ``out_dtype`` (default None: x's dtype, as
    ``nn.LayerNorm`` outside autocast) writes the output in another dtype: ``torch.bfloat16`` for
    an fp32 residual stream feeding a Linear under bf16 autocast saves the cast kernel (the Linear
    would cast to the same values).

    ``ln(x, residual)`` returns ``(x + residual, ln(x + residual))`` from one kernel (and one in
    the backward): a pre-norm block's residual add fused into its norm
    (``tilelang_ops.functional.add_layer_norm``).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            return _F.add_layer_norm(x, residual, self.normalized_shape, self.weight, self.bias, self.eps, self.out_dtype)
        return _F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, self.out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else "")

    @classmethod
    def from_layer_norm(cls, ln: torch.nn.LayerNorm, out_dtype: torch.dtype | None = None) -> "LayerNorm":
        """A module sharing `ln`'s parameters (no copy)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = ln.normalized_shape, ln.eps, ln.elementwise_affine
        new.weight, new.bias, new.out_dtype = ln.weight, ln.bias, out_dtype
        return new
