"""The C++ call path: each op's CUDA kernel and autograd kernel in C++ (csrc/fastpath.cpp).

A call of a Python op pays the dispatcher's crossing into Python, its argument checks, its
allocations from Python and tvm_ffi's argument packing, ~7 µs of a ~15 µs call on the GPU hosts
(docs/benchmarks.md, #4), for work that is the same on every call of one shape. So the op's CUDA
kernel is a C++ kernel that keys each call on what the Python implementation's launches can depend
on (every tensor's dtype, device, sizes, strides, 16-byte alignment and storage aliasing, the other
arguments' values, the current stream, torch's deterministic flag) and:
- the first call of a key runs the Python implementation as it is (it fills the op's caches);
- the second runs it under a recorder: a dispatch mode that sees every aten call (allocations and
  views only, else no plan) and a hook in every kernel launcher (`runtime.launcher`) that sees each
  launch's arguments. From those it builds a plan: the allocations to make, and each launch's
  compiled host function with its arguments as views of an input, an allocation or a tensor the op
  had cached (a tile counter, a ones vector);
- every later call replays that plan in C++: no Python at all, the same launches on fresh outputs.
A call that could not be recorded (any other aten call: an empty input's fill, a copy of a
non-contiguous input) keeps the Python path for its key; so does any call under CUDA graph capture.
The Autograd kernel is C++ too: without a gradient to record it goes straight to the CUDA kernel;
with one, the op's Python autograd path runs for a key's first two calls, the second under a
recorder of its setup_context (what it saved, as inputs or outputs, and the attributes it set);
later calls are a C++ autograd Function that saves the same, its backward calling the op's Python
backward formula.

`TILEOPS_FASTPATH=0` keeps every op on the Python path. The extension is built (torch's
cpp_extension, ~30 s) on the first import on a machine with CUDA, once per torch version, into
`tuning.cache_dir()/ext`, then imported directly by later processes; a failed build warns once and
leaves the Python path in place. `invalidate()` drops every plan: call it after changing what an
op's Python implementation decides from (a monkeypatched default config, a tuned config stored in
this process).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "TILEOPS_FASTPATH"
_SRC = Path(__file__).parent / "csrc" / "fastpath.cpp"
_ext = None
_load_error: Exception | None = None
_lock = threading.Lock()
_keep: dict[int, object] = {}  # tvm_ffi Functions referenced by a plan, kept alive for it
_indices: dict[str, int] = {}  # op name -> the extension's index of its backend kernel
_grad_indices: dict[str, int] = {}  # op name -> index of its Autograd kernel

# torch dtype -> DLPack (code, bits, lanes), as tvm_ffi passes a torch tensor to a kernel
_DL_DTYPE = {
    torch.float32: (2, 32, 1), torch.float16: (2, 16, 1), torch.bfloat16: (4, 16, 1),
    torch.float64: (2, 64, 1), torch.int32: (0, 32, 1), torch.int64: (0, 64, 1),
    torch.int16: (0, 16, 1), torch.int8: (0, 8, 1), torch.uint8: (1, 8, 1), torch.bool: (6, 8, 1),
}
_T, _INT, _BOOL, _FLOAT = 7, 1, 2, 3  # tvm_ffi type indices (csrc/fastpath.cpp)
_INPUT, _ALLOC, _CONST = 0, 1, 2


def wanted() -> bool:
    """The environment asks for the C++ path (the default) and CUDA is there for it to serve."""
    return os.environ.get(ENV, "1") != "0" and torch.cuda.is_available()


def build_dir() -> Path:
    from .tuning import cache_dir

    tag = re.sub(r"[^A-Za-z0-9_.]", "_", f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")
    return cache_dir() / "ext" / f"fastpath-{tag}"


def load(verbose: bool = False):
    """The extension module (built on the first call for this torch), or None if it cannot be
    built; the reason then in `load_error()`."""
    global _ext, _load_error
    with _lock:
        if _ext is not None or _load_error is not None:
            return _ext
        try:
            # no tvm_ffi import and no CUDA call here: this runs when tilelang_ops is imported
            _ext = _import_built() or _build(verbose)
        except Exception as e:  # noqa: BLE001 — any failure leaves the Python path, said once
            _load_error = e
            warnings.warn(f"tilelang_ops: the C++ call path is off ({type(e).__name__}: {e}); ops run on the Python path", stacklevel=2)
        return _ext


_CFLAGS = ["-O2"]


def _stamp() -> str:
    """What the built module depends on: the source, the flags, torch and Python."""
    import hashlib

    return hashlib.sha256(_SRC.read_bytes() + repr((_CFLAGS, torch.__version__, sys.version)).encode()).hexdigest()


def _import_built():
    """The module built earlier for this source and torch, imported directly (~10 ms; going
    through cpp_extension.load costs ~0.6 s a process even when nothing is rebuilt), or None."""
    import importlib.util

    d = build_dir()
    so, stamp = d / "tileops_fastpath.so", d / "tileops_fastpath.stamp"
    try:
        if not so.exists() or stamp.read_text() != _stamp():
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location("tileops_fastpath", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(verbose: bool):
    from torch.utils import cpp_extension

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    print(f"tilelang_ops: building the C++ call path into {d} (once per torch version, ~30 s)", file=sys.stderr)
    # cpp_extension locks the build directory: concurrent first imports build once
    ext = cpp_extension.load(name="tileops_fastpath", sources=[str(_SRC)], build_directory=str(d), extra_cflags=_CFLAGS, verbose=verbose)
    tmp = d / f"tileops_fastpath.stamp.{os.getpid()}"
    tmp.write_text(_stamp())
    os.replace(tmp, d / "tileops_fastpath.stamp")  # atomic: a reader sees no stamp or a whole one
    return ext


_ready: bool | None = None  # None: not checked yet


def ready() -> bool:
    """Whether plans may be made: once, when the first is (tvm_ffi is loaded and CUDA is up by
    then), the extension finds tvm_ffi's C API and reads torch's current CUDA stream right."""
    global _ready
    if _ready is None:
        try:
            import tvm_ffi.libinfo

            _ext.init_ffi(tvm_ffi.libinfo.find_libtvm_ffi())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    seen = _ext.current_stream(torch.cuda.current_device())
                if seen != s.cuda_stream:
                    raise RuntimeError(f"the extension reads the current CUDA stream as {seen:#x}, torch as {s.cuda_stream:#x}")
            _ready = True
        except Exception as e:  # noqa: BLE001
            _ready = False
            warnings.warn(f"tilelang_ops: the C++ call path replays nothing ({type(e).__name__}: {e}); ops run on the Python path", stacklevel=2)
    return _ready


def load_error() -> Exception | None:
    return _load_error


def invalidate() -> None:
    """Every op's plans are dropped: each key runs the Python implementation again next call."""
    if _ext is not None:
        _ext.invalidate()


def stats(name: str) -> dict | None:
    """calls, hits (replayed plans), keys, plans and python_only keys of op `name`'s C++ kernel."""
    i = _indices.get(name)
    return None if i is None else _ext.stats(i)


def register(namespace: str, name: str, key: str, impl) -> None:
    """`impl` (the Python implementation) served through the C++ kernel of `name` at dispatch key
    `key` ("CUDA"; "CPU" in tests)."""

    def handler(args, record):
        if not record or _ready is False:
            return impl(*args), None
        rec = _Recorder(args)
        with rec:
            result = impl(*args)
        return result, rec.plan(result)

    _indices[name] = _ext.register_backend(namespace, name, key, handler)


def register_autograd(namespace: str, name: str, with_grad, backward, has_setup: bool = True) -> None:
    """The Autograd kernel of `name`: without a gradient to record, C++ straight to the backend
    kernel; with one, `with_grad(keyset, args)` (the op's Python autograd path, which calls
    setup_context) until a key's setup is recorded, then a C++ autograd Function that saves what
    setup_context saved and calls `backward(ctx, *grads)` from its backward. has_setup=False: the
    op has no setup_context (nothing saved, no attributes): recorded as such at once."""

    def grad_handler(keyset, args, record):
        global setup_recorder
        if not record or _ready is False:
            return with_grad(keyset, args), None
        rec = setup_recorder = _SetupRecorder()
        try:
            result = with_grad(keyset, args)
        finally:
            setup_recorder = None
        return result, rec.spec(result, has_setup)

    _grad_indices[name] = _ext.register_autograd(namespace, name, grad_handler, backward, _Ctx)


def register_autograd_via(namespace: str, name: str, other: str, output: int) -> None:
    """`name`'s gradient is recorded by `other` (same arguments), whose output `output` it returns."""
    _ext.register_autograd_via(namespace, name, other, output)


def grad_stats(name: str) -> dict | None:
    """calls (grad-recording), hits (the C++ Function), specs and python_only keys of `name`."""
    i = _grad_indices.get(name)
    return None if i is None else _ext.grad_stats(i)


# ------------------------------------------------------------------------------------ recording
_recording: "_Recorder | None" = None  # read by runtime.launcher's wrappers on every launch


_VIEW_LIKE = {"aten::_unsafe_view", "aten::detach", "aten::alias"}
_ALLOCS = {"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::empty_like"}


def _no_tensors(*trees) -> bool:
    """No tensor in or out (torch.promote_types dispatches as an aten op): nothing to replay."""
    from torch.utils._pytree import tree_leaves

    return not any(isinstance(t, torch.Tensor) for t in tree_leaves(trees))


class _Reject(Exception):
    """The call does something a plan cannot replay: its key stays on the Python path."""


class _Recorder(TorchDispatchMode):
    """Sees one call of a Python implementation: its aten calls (allocations and views only) and
    its launches, and turns them into a plan (csrc/fastpath.cpp `parse_plan`)."""

    def __init__(self, args):
        super().__init__()
        self.tid = threading.get_ident()
        self.inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.device = self.inputs[0][1].device if self.inputs else None
        self.allocs: list[torch.Tensor] = []  # held until the plan is made: no address is reused
        self.consts: list[torch.Tensor] = []
        self.launches: list = []
        self.reject: str | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable by default, which
        # imports torch._dynamo on the first call: 1-4 s in a key's second call. Nothing is
        # compiled inside a recording (it runs one eager call of the op's implementation).
        return False

    def __enter__(self):
        global _recording
        _recording = self
        return super().__enter__()

    def __exit__(self, *exc):
        global _recording
        _recording = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _ALLOCS:
            self.allocs.append(out)
        elif not (func.is_view or name in _VIEW_LIKE or _no_tensors(args, kwargs, out)):
            self.reject = self.reject or f"{func} is not an allocation or a view"
        return out

    def _ref(self, t: torch.Tensor) -> tuple:
        """(kind, index, byte offset from that tensor's data pointer) of a launch's tensor."""
        if t.device != self.device or t.layout != torch.strided:
            raise _Reject(f"a launch argument on {t.device}")
        storage, ptr = t.untyped_storage().data_ptr(), t.data_ptr()
        if storage == 0:
            raise _Reject("an empty launch argument")
        same = [(i, a) for i, a in self.inputs if a.untyped_storage().data_ptr() == storage]
        if same:  # the input it is (offset 0) if there is one, else the first it is a view of
            i, a = next(((i, a) for i, a in same if a.data_ptr() == ptr), same[0])
            return _INPUT, i, ptr - a.data_ptr()
        for j, a in enumerate(self.allocs):
            if a.untyped_storage().data_ptr() == storage:
                return _ALLOC, j, ptr - a.data_ptr()
        for j, c in enumerate(self.consts):
            if c.untyped_storage().data_ptr() == storage:
                return _CONST, j, ptr - c.data_ptr()
        self.consts.append(t)  # a tensor the op keeps across calls: passed as it is
        return _CONST, len(self.consts) - 1, 0

    def launch(self, fn, args) -> None:
        if threading.get_ident() != self.tid or self.reject:
            return
        try:
            packed = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    dt = _DL_DTYPE.get(a.dtype)
                    if dt is None:
                        raise _Reject(f"dtype {a.dtype}")
                    packed.append((_T, *self._ref(a), tuple(a.shape), tuple(a.stride()), dt))
                elif isinstance(a, bool):
                    packed.append((_BOOL, int(a)))
                elif isinstance(a, int):
                    packed.append((_INT, a))
                elif isinstance(a, float):
                    packed.append((_FLOAT, a))
                else:
                    raise _Reject(f"a launch argument of type {type(a).__name__}")
            self.launches.append((fn, packed))
        except _Reject as e:
            self.reject = str(e)

    def plan(self, result):
        """The plan for this call (None if anything in it cannot be replayed)."""
        if self.reject or not self.launches or self.device is None or not ready():
            return None
        outs = []
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if t is None:
                outs.append((-1, 0, 0, (), ()))
                continue
            storage = t.untyped_storage().data_ptr()
            j = next((j for j, a in enumerate(self.allocs) if a.untyped_storage().data_ptr() == storage), None)
            if j is None or storage == 0 or t.dtype != self.allocs[j].dtype:
                return None  # an output that is not a fresh allocation of this call (or a reinterpretation)
            outs.append((_ALLOC, j, t.storage_offset() - self.allocs[j].storage_offset(), tuple(t.shape), tuple(t.stride())))
        if any(a.device != self.device or a.storage_offset() != 0 for a in self.allocs):
            return None
        allocs = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in self.allocs]
        launches = []
        for fn, packed in self.launches:
            _keep[id(fn)] = fn
            launches.append((fn.__chandle__(), packed))
        return allocs, list(self.consts), launches, outs


# --------------------------------------------------------------------------- recording a setup
setup_recorder: "_SetupRecorder | None" = None  # read by _library's autograd forward


class _SetupRecorder:
    """Sees one call of an op's setup_context (through `wrap`): what it saved, as inputs or outputs
    of the call, the attributes it set and the outputs it marked non-differentiable."""

    def __init__(self):
        self.saved: list | None = None
        self.attrs: dict = {}
        self.non_diff: list = []
        self.reject: str | None = None
        self.outputs: tuple = ()
        self.seen = False

    def wrap(self, ctx, args, output):
        self.seen = True
        self.args = args
        self.outputs = output if isinstance(output, tuple) else (output,)
        return _CtxProxy(ctx, self)

    def _where(self, t):
        if t is None:
            return None
        for i, a in enumerate(self.args):
            if t is a:
                return (_INPUT, i)
        for j, o in enumerate(self.outputs):
            if t is o:
                return (_ALLOC, j)
        self.reject = "saved a tensor that is neither an input nor an output"
        return None

    def spec(self, result, has_setup: bool):
        if not has_setup and not self.seen:
            outs = result if isinstance(result, tuple) else (result,)
            return [], [False] * len(outs), {}
        if self.reject or not self.seen:
            return None
        ids = [id(t) for t in self.non_diff]
        return list(self.saved or []), [id(o) in ids for o in self.outputs], dict(self.attrs)


_ATTR_TYPES = (bool, int, float, str, type(None), torch.dtype)


class _CtxProxy:
    """The autograd ctx as setup_context sees it while a recorder watches."""

    def __init__(self, ctx, rec):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_rec", rec)

    def save_for_backward(self, *tensors):
        self._rec.saved = [self._rec._where(t) for t in tensors]
        self._ctx.save_for_backward(*tensors)

    def mark_non_differentiable(self, *tensors):
        self._rec.non_diff.extend(tensors)
        self._ctx.mark_non_differentiable(*tensors)

    def set_materialize_grads(self, value):  # the C++ Function never materializes
        self._ctx.set_materialize_grads(value)

    def __setattr__(self, name, value):
        if isinstance(value, _ATTR_TYPES):
            self._rec.attrs[name] = value
        else:
            self._rec.reject = f"ctx.{name} is a {type(value).__name__}"
        setattr(self._ctx, name, value)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


class _Ctx:
    """The ctx a backward formula gets from the C++ Function: saved_tensors, needs_input_grad (one
    per op argument) and the attributes setup_context set."""

    def __init__(self, saved_tensors, needs_input_grad, attrs):
        self.saved_tensors = saved_tensors
        self.needs_input_grad = needs_input_grad
        self.__dict__.update(attrs)
