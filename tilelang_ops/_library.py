"""The one place that talks to torch.library: namespace and the registration helper."""
from __future__ import annotations

import torch

NAMESPACE = "tileops"


def _is_registered(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


def custom_op(name: str, *, mutates_args=(), schema: str | None = None):
    """`torch.library.custom_op` in our namespace, failing loudly if the name is taken.

    Another library (the TileLang team's TileOPs) also registers ops under `tileops::`; a silent
    clash would route calls to whichever registered last, so we refuse instead.
    """
    if _is_registered(name):
        raise RuntimeError(
            f"torch.ops.{NAMESPACE}.{name} is already registered by another library or an earlier "
            f"import; tilelang_ops refuses to shadow it. Import only one library that defines "
            f"{NAMESPACE}::{name}."
        )
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args, schema=schema)
