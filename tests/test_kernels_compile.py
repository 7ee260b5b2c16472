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


def test_uniform_warpgroups_rewrites_only_warp_aligned_role_branches():
    """runtime.uniform_warpgroups (the uniform_ws configs): each warp-role branch tests the
    broadcast warp index with the same threshold in warps, `threadIdx.x >> 5 / >> 7` become it,
    and a branch whose threshold splits a warp, or any code before the first role branch, is left
    as it was."""
    from tilelang_ops.runtime import uniform_warpgroups

    src = "\n".join([
        "  int a = ((int)threadIdx.x) >> 7;",
        "  __syncthreads();",
        "  if (256 <= ((int)threadIdx.x)) {",
        "    x = (((int)threadIdx.x) >> 7) * 8192 + (((int)threadIdx.x) >> 5);",
        "  }",
        "  if (((int)threadIdx.x) < 256) {",
        "  }",
        "  if ((128 <= ((int)threadIdx.x)) && (((int)threadIdx.x) < 384)) {",
        "  }",
        "  if (((int)threadIdx.x) < 200) {",
        "  }",
        "    if (((int)threadIdx.x) < 128) {",  # nested (not a role branch): untouched
    ])
    out = uniform_warpgroups(src).splitlines()
    assert out[0] == "  int a = ((int)threadIdx.x) >> 7;"
    assert out[2] == "  const int tl_warp = __shfl_sync(0xffffffffu, ((int)threadIdx.x) >> 5, 0);"
    assert out[3] == "  if (8 <= tl_warp) {"
    assert out[4] == "    x = (tl_warp >> 2) * 8192 + tl_warp;"
    assert out[6] == "  if (tl_warp < 8) {"
    assert out[8] == "  if ((4 <= tl_warp) && (tl_warp < 12)) {"
    assert out[10] == "  if (((int)threadIdx.x) < 200) {"
    assert out[12] == "    if (((int)threadIdx.x) < 128) {"
    assert uniform_warpgroups("  if (x) {\n") == "  if (x) {\n"


def test_uniform_rewrite_chains_a_users_cuda_hook_and_restores_it():
    """The uniform_ws rewrite goes through TileLang's process-wide CUDA post-processing hook only
    for the compile that needs it: after any hook the user registered, which is back in place
    afterwards."""
    import tilelang
    import tvm_ffi

    from tilelang_ops import runtime

    class FakeTileLang:  # compile() runs the hook as TileLang's codegen does
        register_cuda_postproc = staticmethod(tilelang.register_cuda_postproc)

        @staticmethod
        def compile(**kwargs):
            return tvm_ffi.get_global_func(runtime._POSTPROC)("src", None)

    tilelang.register_cuda_postproc(lambda code, target: code + "/*user*/")
    try:
        assert runtime._compile_rewritten(FakeTileLang, lambda code: code + "/*ours*/") == "src/*user*//*ours*/"
        assert tvm_ffi.get_global_func(runtime._POSTPROC)("x", None) == "x/*user*/"
    finally:
        tilelang.register_cuda_postproc(lambda code, target: code)
