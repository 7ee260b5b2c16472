#!/usr/bin/env bash
# Packs the TileLang kernel cache warmed here (.tl-cache) for a GPU host: compiled kernels only
# (the nvcc binary cache is only needed to recompile), xz-compressed into .tl-carry/.
set -euo pipefail
src=${1:-.tl-cache}
mkdir -p .tl-carry
tar -C "$src" -cf - 0.1.15/linux-x86_64 2>/dev/null | xz -T0 -6 > .tl-carry/tlcache.tar.xz || true
echo "packed $(du -h .tl-carry/tlcache.tar.xz | cut -f1) from $src"
