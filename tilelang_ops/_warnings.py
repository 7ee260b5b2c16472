"""One-time warnings for visible fallbacks, also from inside torch.compile(fullgraph=True) regions."""
from __future__ import annotations

import warnings

import torch

_warned: set[str] = set()


def _emit(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _emit_while_tracing(ctx) -> None:
    # comptime functions may not close over variables: read warn_once's local instead.
    _emit(ctx.get_local("msg").as_python_constant())


def warn_once(msg: str) -> None:
    """Warn with `msg` (a constant string) the first time this process meets it.

    Under torch.compile, warnings.warn is a graph break (an error with fullgraph=True), and
    Dynamo's reorderable logging functions are dropped when called from inlined frames (torch
    2.13), so the warning is emitted while Dynamo traces the call: once, when the graph compiles.
    """
    if torch.compiler.is_compiling():
        try:
            from torch._dynamo.comptime import comptime
        except ImportError:  # pragma: no cover  (no compile-time hook: stay silent rather than break the graph)
            return
        comptime(_emit_while_tracing)
        return
    _emit(msg)
