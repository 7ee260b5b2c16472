"""Every shipped kernel compiles for Hopper (sm_90a) and Ampere (sm_80) without a GPU."""
from __future__ import annotations

import pytest

from tilelang_ops.ops import all_kernels
from tilelang_ops.runtime import config_str

KERNELS = all_kernels()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("entry", KERNELS, ids=[f"{k.family}.{k.name}-{config_str(c)}-{'-'.join(map(str, s.values()))}" for k, c, s in KERNELS])
def test_kernel_compiles(entry, arch):
    kdef, config, static = entry
    if int(arch[3:5]) < kdef.min_sm:
        pytest.skip(f"{kdef.name} needs sm_{kdef.min_sm}+ (thread-block clusters)")
    src = kdef.source(config, arch, **static)
    assert "__global__" in src
