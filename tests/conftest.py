"""Shared fixtures and markers. GPU tests skip with a visible reason where CUDA is absent."""
from __future__ import annotations

import os

import pytest
import torch

import tilelang_ops  # noqa: F401  (registers torch.ops.tileops.*)

# Hypothesis: deterministic in CI so a red run reproduces; fewer examples where no GPU speeds things up.
try:
    from hypothesis import register_random, settings

    class _TorchRNG:
        """Lets hypothesis seed torch per example, so a failing example replays the same tensors
        (otherwise hypothesis reports every tensor-valued failure as flaky)."""

        def seed(self, s):
            torch.manual_seed(s)

        def getstate(self):
            return torch.random.get_rng_state()

        def setstate(self, state):
            torch.random.set_rng_state(state)

    _TORCH_RNG = _TorchRNG()  # hypothesis keeps only a weak reference
    register_random(_TORCH_RNG)

    settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
    settings.register_profile("dev", max_examples=50, deadline=None)
    # benchmarks/gpu_run.sh: half the examples (GPU device time is rationed), still random
    settings.register_profile("gpu", max_examples=25, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    # A test parametrized on device="cuda" (opcheck, compile, reference tests over DEVICES) is a GPU
    # test too, so `-m gpu` selects it on the GPU host.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(str(v) == "cuda" or str(v).startswith("cuda:") for v in params.values()):
            item.add_marker(pytest.mark.gpu)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped with a reason elsewhere")
    config.addinivalue_line("markers", "slow: compiles kernels or runs long")
    # Always list why tests were skipped (GPU tests on a CPU machine), as `-rs` would.
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars:
        config.option.reportchars += "s"


@pytest.fixture(autouse=True)
def _fresh_plans():
    # The C++ call path replays what an op's Python implementation did for a key; a test that
    # monkeypatches what that implementation decides from must see it decide again.
    from tilelang_ops import fastpath

    fastpath.invalidate()


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test (but reproducible from the test id): fresh inputs, never zeros.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
