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


# TileLang's per-thread row reductions, as it writes them (T.reduce_max / T.reduce_sum)
_SERIAL_MAX = """          m_clear[i_2] = -CUDART_INF_F;
          #pragma unroll
          for (int rv = 0; rv < N; ++rv) {
            m_clear[i_2] = max(m_clear[i_2], s[((((rv & 15) * 4) + (i_2 * 2)) + (rv >> 4))]);
          }
"""
_SERIAL_SUM = """          row_sum[i_5] = 0x0p+0f/*0.000000e+00*/;
          #pragma unroll
          for (int rv_1 = 0; rv_1 < N; ++rv_1) {
            row_sum[i_5] = (row_sum[i_5] + s[((((rv_1 & 15) * 4) + (i_5 * 2)) + (rv_1 >> 4))]);
          }
"""


@pytest.mark.parametrize("n", [3, 8, 32, 44])
@pytest.mark.parametrize("ways", [2, 4, 8])
def test_tree_reductions_compute_the_same_row_max_and_sum(n, ways, tmp_path):
    """runtime.tree_reductions (FwdConfig.tree_reduce): the rewritten loops, compiled as C++ and run
    on random rows, give the serial loop's max exactly and its sum to fp32 rounding, also from an
    accumulator that starts above every element (max) or far from 0 (sum); loops shorter than
    2 * ways are left alone."""
    import shutil
    import subprocess

    from tilelang_ops.runtime import tree_reductions

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to run the rewritten loops")
    serial = (_SERIAL_MAX + _SERIAL_SUM).replace("< N;", f"< {n};")
    # accumulators that start from a value, not the identity: the rewrite must keep it too
    serial = serial.replace("= -CUDART_INF_F;", "= -0.5f;").replace("= 0x0p+0f/*0.000000e+00*/;", "= 1000.0f;")
    tree = tree_reductions(serial, ways)
    if n < 2 * ways:
        assert tree == serial
        return
    assert tree.count(f"{ways} chains") == 2 and "#pragma unroll\n          {" not in tree

    def fn(name, body):
        return (f"void {name}(const float* s, int i_2, float* out) {{\n  int i_5 = i_2;\n  float m_clear[2], row_sum[2];\n"
                f"{body}  out[0] = m_clear[i_2]; out[1] = row_sum[i_5];\n}}\n")

    prog = tmp_path / "reduce.cpp"
    prog.write_text(
        "#include <cmath>\n#include <cstdio>\n#include <cstdlib>\n#include <algorithm>\n"
        "#define CUDART_INF_F INFINITY\nusing std::max;\n"
        + fn("serial", serial) + fn("tree", tree)
        + "int main() {\n  float s[128]; srand(7);\n"
        "  for (int t = 0; t < 200; ++t) {\n"
        "    for (int k = 0; k < 128; ++k) s[k] = 50.0f - 100.0f * rand() / RAND_MAX;\n"
        "    for (int row = 0; row < 2; ++row) {\n"
        "      float a[2], b[2]; serial(s, row, a); tree(s, row, b);\n"
        "      if (a[0] != b[0] || std::fabs(a[1] - b[1]) > 1e-5f * std::fabs(a[1])) { printf(\"%d %g %g %g %g\\n\", t, a[0], b[0], a[1], b[1]); return 1; }\n"
        "    }\n  }\n  return 0;\n}\n"
    )
    exe = tmp_path / "reduce"
    subprocess.run([cxx, "-O1", "-o", str(exe), str(prog)], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, f"tree and serial reductions differ: {run.stdout}"


def test_pin_wgmma_waits_stores_before_the_wait_after_a_softmax():
    """runtime.pin_wgmma_waits (FwdConfig.pin_waits): a volatile store of the row sums, one word a
    thread of a static scratch array sized by the launch bounds, right before a full wgmma wait
    that follows a row sum; a wait with no row sum since the previous wait, and a kernel with none,
    are left as they were."""
    from tilelang_ops.runtime import pin_wgmma_waits

    head = 'extern "C" __global__ void __launch_bounds__(384, 1) k() {\n  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];\n  float row_sum[2];\n'
    body = "\n".join([
        "    tl::wait_wgmma<0>();",  # the first step's: no softmax before it
        "    row_sum[i_5] = tl::AllReduce<tl::SumOp, 4, 1, 0, tl::NamedBarrier<256>>::run(row_sum[i_5]);",
        "    tl::wait_wgmma<0>();",
        "    tl::wait_wgmma<1>();",
        "    tl::wait_wgmma<0>();",  # nothing since the wait before
        "}",
    ])
    out = pin_wgmma_waits(head + body).splitlines()
    assert out[2] == "  __shared__ float tl_pin[384];"
    pins = [i for i, line in enumerate(out) if "tl_pin)[threadIdx.x]" in line]
    assert len(pins) == 1 and out[pins[0]].strip().startswith("((volatile float*)tl_pin)[threadIdx.x] = row_sum[0] + row_sum[1];")
    assert out[pins[0] - 1].strip().startswith("row_sum[i_5] =") and out[pins[0] + 1].strip() == "tl::wait_wgmma<0>();"
    assert pin_wgmma_waits(head + "    tl::wait_wgmma<0>();\n}") == head + "    tl::wait_wgmma<0>();\n}"


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
