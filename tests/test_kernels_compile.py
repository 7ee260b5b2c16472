"""Every shipped kernel compiles for Hopper (sm_90a) and Ampere (sm_80) without a GPU."""
from __future__ import annotations

import pytest

from tilelang_ops.ops import all_kernels
from tilelang_ops.runtime import config_str, sm_of

KERNELS = all_kernels()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("entry", KERNELS, ids=[f"{k.family}.{k.name}-{config_str(c)}-{'-'.join(map(str, s.values()))}" for k, c, s in KERNELS])
def test_kernel_compiles(entry, arch):
    kdef, config, static = entry
    need = kdef.min_sm_for(config)
    if sm_of(arch) < need:
        pytest.skip(f"{kdef.name} {config_str(config)} needs sm_{need}+ (clusters or a Hopper-only schedule)")
    src = kdef.source(config, arch, **static)
    assert "__global__" in src


@pytest.mark.slow
@pytest.mark.parametrize("schedule, n, backward", [("csplitd", 32768, False), ("csplitd", 32768, True)])
def test_dsmem_receive_buffer_is_never_aliased(schedule, n, backward):
    """The DSMEM softmax schedules receive their peers' partials by remote stores, which TileLang's
    shared-memory planner cannot see: in dynamic shared memory it aliased the receive buffer with
    the reductions' scratch (wrong results on the H200). It must stay a static __shared__ array."""
    from tilelang_ops.kernels import softmax as K

    cfg = K.SoftmaxConfig(schedule, 1, 256, 8192, 0)
    (kdef, c, st), = K.schedule_kernels(cfg, n, "bfloat16", "softmax", backward)
    src = kdef.source(c, "sm_90a", **st)
    assert "map_shared_rank" in src  # the partials really go through DSMEM
    assert "__shared__ __align__(16) float peers[" in src, "peers must be static shared memory"
    assert "peers = ((void*)((char*)buf_dyn_shmem" not in src
