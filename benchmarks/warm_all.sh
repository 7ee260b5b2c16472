#!/usr/bin/env bash
# Before a GPU run, on the CPU machine: compile (sm_90a, no GPU needed) every kernel the GPU tests,
# `tileops check`, the benchmarks and the sweeps load, then pack the cache for the GPU host
# (.tl-carry/, carried with .gpu-bundle). Cached kernels cost nothing; TUNE=1 also warms the
# attention search spaces that `tileops tune --op flash_attn ...` times.
set -euo pipefail
cd "$(dirname "$0")/.."
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tl-cache} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Age every entry's access time, so that what the steps below load or build can be told apart
# (pack_cache.sh packs only those).
mkdir -p .tl-carry "$TILELANG_CACHE_DIR/0.1.15/linux-x86_64/kernels"
find "$TILELANG_CACHE_DIR/0.1.15/linux-x86_64/kernels" -type f -exec touch -a -d 2020-01-01 {} +
touch -a -m -d "$(date -d '-1 second')" .tl-carry/warm-start
python -m benchmarks.warm_gemm_cache | tail -1
python -m benchmarks.sweep_gemm --warm ${SWEEP_GROUPS:-} | tail -1  # SWEEP_GROUPS="--group g ...": only those
python -m benchmarks.sweep_softmax --warm --jobs 2 | tail -1
python -m benchmarks.warm_attention_cache -j 2 ${TUNE:+--tune} | tail -1
# TUNE_SHAPES=benchmarks/tune_two_shapes.json: every config `tileops tune --shapes` that file times
if [[ -n ${TUNE_SHAPES:-} ]]; then python -m benchmarks.warm_tune "$TUNE_SHAPES" | tail -1; fi
python -m benchmarks.warm_norm_cache -j 2 --sweep | tail -1
python -m benchmarks.warm_gemm_cache --only train | tail -1  # examples/train_gpt.py's fused MLP (attention: --train)
python -m benchmarks.warm_attention_cache --train | tail -1
python -m benchmarks.host_standin --warm-check | tail -1  # what `tileops check` loads on the GPU (all ops, all shapes)
python -m benchmarks.host_standin --warm-overhead | tail -1  # what benchmarks.overhead and diag_backward_host load
bash benchmarks/pack_cache.sh "$TILELANG_CACHE_DIR" .tl-carry/warm-start
