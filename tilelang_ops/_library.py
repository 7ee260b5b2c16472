"""The one place that talks to torch.library: namespace and the registration helper.

`custom_op` here has the interface of `torch.library.custom_op` (decorate the CPU/reference
implementation, then `.register_kernel("cuda")`, `.register_fake`, `.register_autograd`), but
registers through `torch.library.Library.define/impl` directly, and its autograd kernel is ours.
Same schema, fake and autograd semantics (opcheck and torch.compile see an ordinary op); the
difference is host time per call. torch's generated autograd kernel re-enters the dispatcher to
reach the backend kernel: a second C++→Python crossing, a dataclass and a context manager on
every call. Ours calls the CPU/CUDA implementation directly when nothing sits between autograd
and the backend (no fake/functional tensor, no dispatch mode, no subclass: the dispatcher's own
keyset says so), and redispatches otherwise. Measured on the CPU machine: 2.9 µs per call
against torch's 5.1 µs (a no-autograd op: 1.6 µs).
"""
from __future__ import annotations

import sys

import torch
from torch import _C

from . import fastpath

NAMESPACE = "tileops"
# FRAGMENT, not DEF: another library may own a TORCH_LIBRARY block for the same namespace.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_AFTER_AUTOGRAD = _C._after_autograd_keyset
_BACKEND_KEYS = {"cpu": _C.DispatchKey.CPU, "cuda": _C.DispatchKey.CUDA}
_MISSING = object()
_len_dispatch_stack = _C._len_torch_dispatch_stack
_function_mode = _C._is_torch_function_mode_enabled
_functorch_active = _C._are_functorch_transforms_active
_profiler_on = _C._autograd._profiler_enabled


_FAST: bool | None = None


def _fast() -> bool:
    """Whether ops register their CUDA and Autograd kernels through the C++ call path
    (fastpath.py), decided once, on the first registration."""
    global _FAST
    if _FAST is None:
        _FAST = fastpath.wanted() and fastpath.load() is not None
    return _FAST


def _is_registered(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


OPS: list["CustomOp"] = []  # every op `custom_op` defined, in order
_inductor_fallbacks_done = False


def _register_inductor_fallbacks() -> None:
    """Give Inductor an explicit fallback for every tileops op (what it creates implicitly, with
    the same layout constraint: the op's tag, else Inductor's default for custom ops), once Inductor
    is loaded — fake kernels run while AOTAutograd traces for it, before it lowers the graph.

    Why: torch 2.11's implicit-fallback path formats every argument's IR for a log line even with
    INFO logging off (lazily from 2.13 on), and that string grows exponentially with the depth of
    the IR behind an argument. The GPT example's first compiled backward spent minutes in it on the
    H200 host (session 15; the same hang: vllm-project/vllm#43111). On any error (another torch's
    internals) nothing is registered and Inductor falls back implicitly, as before."""
    global _inductor_fallbacks_done
    if "torch._inductor.lowering" not in sys.modules:
        return
    _inductor_fallbacks_done = True
    try:
        from torch._inductor import lowering as L
        from torch._library.utils import get_layout_constraint_tag

        for op in OPS:
            if op.op not in L.lowerings:
                constraint = L.tag_to_layout_constraint(get_layout_constraint_tag(op.op, with_default=True))
                L.make_fallback(op.op, layout_constraint=constraint, warn=False)
    except Exception:  # noqa: BLE001 — an optimization of Inductor's own path; never fail a compile over it
        pass


class CustomOp:
    """Handle returned by `custom_op`: call it like the op, register the other pieces on it."""

    def __init__(self, name: str, fn, mutates_args, schema: str | None):
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        schema = schema or torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIB.define(name + schema)
        # The decorated function is the reference: it serves every device without its own kernel.
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self.op = getattr(getattr(torch.ops, NAMESPACE), name).default
        # backend dispatch key -> implementation, for the autograd kernel's direct call
        self.impls = _Impls({_C.DispatchKey.CPU: fn})
        self.python_impls = {_C.DispatchKey.CPU: fn}  # every backend's Python implementation
        self._run = _no_grad_path(self.op, self.impls)  # (keyset, args) -> result, no autograd
        OPS.append(self)

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def from_backward(self, *args):
        """Call this op from an autograd formula: its CUDA (or CPU) implementation directly when
        the dispatcher would reach it with nothing in between, else `self.op(*args)`.

        The dispatcher's crossing costs ~3-4 µs a call on the H200 host, and a training step's
        backward makes one such call per op per layer. Direct only when every tensor argument is
        a plain tensor on one device type, no dispatch or function mode, functorch transform or
        profiler is active, and no gradient of this call is being recorded (double backward):
        then the dispatcher would pass the call through the op's autograd fallback straight to
        that kernel. Under torch.compile's tracing the arguments are fake or functional tensors,
        so traced calls are dispatched (and recorded) as before."""
        if _len_dispatch_stack() or _function_mode() or _functorch_active() or _profiler_on():
            return self.op(*args)
        cuda = None  # of the tensor arguments: all on CUDA (True) or all on the CPU (False)
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) is not torch.Tensor:
                    return self.op(*args)
                on_cuda = a.is_cuda
                if not (on_cuda or a.is_cpu) or (cuda is not None and on_cuda is not cuda):
                    return self.op(*args)  # another device, or mixed: the dispatcher (and our checks) decide
                cuda = on_cuda
        impl = None if cuda is None else self.impls.get(_C.DispatchKey.CUDA if cuda else _C.DispatchKey.CPU)
        if impl is None or (_C.is_grad_enabled() and _C._any_requires_grad(*args)):
            return self.op(*args)
        return impl(*args)

    def register_kernel(self, device_type: str):
        def wrap(fn):
            key = _BACKEND_KEYS[device_type]
            if device_type == "cuda" and torch.cuda.device_count() > 1:  # one GPU: always current
                fn = _on_tensors_gpu(fn)
            self.python_impls[key] = fn
            if device_type == "cuda" and _fast():
                # The C++ kernel, which calls fn on a key it has no plan for. Not in `impls`: the
                # grad-recording forward and backward formulas then reach it through the dispatcher.
                fastpath.register(NAMESPACE, self.name, key.name, fn)
            else:
                _LIB.impl(self.name, fn, key.name)
                self.impls[key] = fn
            return fn

        return wrap

    def register_fake(self, fn):
        def fake(*args, **kwargs):
            if not _inductor_fallbacks_done:  # one global read per traced call after that
                _register_inductor_fallbacks()
            return fn(*args, **kwargs)

        torch.library.register_fake(self.qualname, fake, lib=_LIB)
        return fn

    def register_autograd(self, backward, *, setup_context=None):
        """backward(ctx, *grads) -> one gradient (or None) per input; setup_context(ctx, inputs, output).

        The gradient of an output that was not used is None (grads are not materialized)."""
        # The dispatcher drops trailing arguments equal to their defaults; setup_context sees all.
        defaults = tuple(a.default_value if a.has_default_value() else None for a in self.op._schema.arguments)
        run = self._run

        def forward(ctx, *args):
            keyset, args = args[-1], args[:-1]
            # An output nobody used gets None, not a materialized zero tensor: backward formulas
            # skip its term (linear_preact's z is usually unused: no zero fill, no add).
            ctx.set_materialize_grads(False)
            out = run(keyset, args)
            if setup_context is not None:
                full = args + defaults[len(args):]
                rec = fastpath.setup_recorder  # the C++ call path learning what this call saves
                setup_context(ctx if rec is None else rec.wrap(ctx, full, out), full, out)
            return out

        def backward_(ctx, *grads):
            needs = ctx.needs_input_grad
            try:
                ctx.needs_input_grad = needs[:-1]  # the keyset is not an input
                grads_in = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = needs
            return (*grads_in, None) if isinstance(grads_in, tuple) else (grads_in, None)

        fn_cls = type(f"{self.name}_autograd", (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_)})
        self.apply_with_grad = _fast_apply(fn_cls)
        if _fast():  # C++: a key's recorded setup replays without Python until the backward
            fastpath.register_autograd(NAMESPACE, self.name, self.apply_with_grad, backward, setup_context is not None)
            return
        self._impl_autograd(self.apply_with_grad)

    def register_autograd_via(self, other: "CustomOp", output: int):
        """Autograd by delegation to `other`, an op with the same arguments and an autograd
        formula: when a gradient is needed, the result is other's output number `output`, recorded
        by other's autograd; otherwise this op's own kernel runs."""
        if _fast():
            fastpath.register_autograd_via(NAMESPACE, self.name, other.name, output)
            return
        self._impl_autograd(lambda keyset, args: other.apply_with_grad(keyset, args)[output])

    def _impl_autograd(self, with_grad):
        """The Autograd kernel: `with_grad(keyset, args)` when a gradient will be needed, else the
        no-grad path (the implementation directly, or a redispatch)."""
        run = self._run

        def autograd_kernel(keyset, *args):
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                return with_grad(keyset, args)
            return run(keyset, args)

        _LIB.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)


def _on_tensors_gpu(fn):
    """`fn` run with its first tensor argument's GPU as the current device, as PyTorch's CUDA ops
    run: TileLang's host function makes a tensor's GPU current and leaves it so, and torch's
    current stream and allocations follow the current device. One compare when it already is;
    not applied at all in a process that sees one GPU. (The C++ call path guards its own calls:
    csrc/fastpath.cpp.)"""

    def run(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                index = a.get_device()
                if index >= 0 and index != _C._cuda_getDevice():
                    with torch.cuda.device(index):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)

    run.__wrapped__ = fn
    run.__name__ = getattr(fn, "__name__", "run")
    return run


def _fast_apply(fn_cls):
    """(keyset, args) -> fn_cls.apply(*args, keyset), minus Function.apply's Python preamble.

    Outside functorch transforms, `Function.apply` unwraps dead functorch wrappers (tensors that
    escaped a finished grad/vmap) and calls the C `_FunctionBase.apply`. Here the call comes from
    the op's Autograd kernel: the dispatcher has already passed functorch's wrapper keys, whose
    fallback unwraps dead wrappers, so the C apply is called directly (~1 µs less per
    grad-recording call on the H200 host; tests/test_library.py feeds a dead wrapper). Under
    vmap/grad it is `Function.apply` itself, unchanged."""
    raw = _C._FunctionBase.__dict__["apply"].__get__(None, fn_cls)
    transforms_active = _C._are_functorch_transforms_active

    def apply(keyset, args):
        if transforms_active():
            return fn_cls.apply(*args, keyset)
        return raw(*args, keyset)

    return apply


class _Impls(dict):
    """backend DispatchKey -> implementation, and the direct-call memo built from it: keyset bits
    -> implementation (None: redispatch). Hashing a DispatchKey costs ~0.2 µs, an int ~0.04, so a
    call looks up its keyset's bits only; any change to the table (registration, a test's
    monkeypatch) clears the memo, so the table stays the one source of truth."""

    def __init__(self, *args):
        super().__init__(*args)
        self.direct: dict[int, object] = {}

    def __setitem__(self, key, fn):
        super().__setitem__(key, fn)
        self.direct.clear()

    def __delitem__(self, key):
        super().__delitem__(key)
        self.direct.clear()


def _no_grad_path(op, impls: _Impls):
    """(keyset, args) -> result without autograd: the implementation directly, else redispatch."""
    direct = impls.direct

    def run(keyset, args):
        bits = keyset.raw_repr()  # one cheap call; the keyset itself is not hashable
        impl = direct.get(bits, _MISSING)
        if impl is _MISSING:
            impl = direct[bits] = impls.get((keyset & _AFTER_AUTOGRAD).highestPriorityTypeId())
        if impl is not None:
            return impl(*args)
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    return run


def custom_op(name: str, *, mutates_args=(), schema: str | None = None):
    """Decorator defining `torch.ops.tileops.<name>`; fails loudly if the name is taken.

    Another library (the TileLang team's TileOPs) also registers ops under `tileops::`; a silent
    clash would route calls to whichever registered last, so we refuse instead.
    """
    if _is_registered(name):
        raise RuntimeError(
            f"torch.ops.{NAMESPACE}.{name} is already registered by another library or an earlier "
            f"import; tilelang_ops refuses to shadow it. Import only one library that defines "
            f"{NAMESPACE}::{name}."
        )
    return lambda fn: CustomOp(name, fn, mutates_args, schema)
