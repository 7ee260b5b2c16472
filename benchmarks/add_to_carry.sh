#!/usr/bin/env bash
# Adds kernels a GPU host had to compile (benchmarks/gpu_run.sh brings them back as
# compiled_here.tar.xz) to the local cache and to the packed carry, so the next call loads them:
#   benchmarks/add_to_carry.sh benchmarks/results/<date>-h200-sessionN/callK/compiled_here.tar.xz ...
# (Session 30: the model-level GPU tests compile 26 kernels; carried, their run took 36 s, not 175-206 s.)
set -euo pipefail
cache=${TILELANG_CACHE_DIR:-.tl-cache}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$cache" .tl-carry
[[ -f .tl-carry/tlcache.tar.xz ]] && tar -C "$tmp" -xJf .tl-carry/tlcache.tar.xz
before=$(find "$tmp" -name device_kernel.cu | wc -l)
for t in "$@"; do tar -C "$tmp" -xJf "$t"; tar -C "$cache" -xJf "$t"; done
tar -C "$tmp" -cf - . | xz -T0 -9e > .tl-carry/tlcache.tar.xz.new && mv .tl-carry/tlcache.tar.xz.new .tl-carry/tlcache.tar.xz
echo "carry: $before -> $(find "$tmp" -name device_kernel.cu | wc -l) kernels, $(du -h .tl-carry/tlcache.tar.xz | cut -f1)"
