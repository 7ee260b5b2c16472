#!/usr/bin/env bash
# Packs the TileLang kernel cache warmed here (.tl-cache) for a GPU host: compiled kernels only
# (the nvcc binary cache is only needed to recompile), xz-compressed into .tl-carry/ (-9e: its
# 64 MiB window spans many near-identical .so files: 1605 kernels in 12 MB instead of 22 at -6).
#   pack_cache.sh [CACHE_DIR] [MARKER]
# With MARKER (a file whose time warm_all.sh set before warming), only the kernel entries read or
# written since then are packed: the cache keeps every kernel ever built here, the GPU host needs
# the ones today's tests, checks and benchmarks load (a call may carry 64 MiB in all).
# KERNELS=REGEX keeps only the entries whose __global__ function matches, KERNELS='!REGEX' the
# others (flash_ / !flash_: the attention kernels in one call, the rest in the next: the whole
# warm cache, ~17 MB packed, does not fit one call beside the tracked tree and the bundle).
# CARRY=DIR writes DIR/ instead of .tl-carry/ (a call then sets TL_CARRY=DIR), e.g.
#   KERNELS=flash_ CARRY=.tl-carry-attn bash benchmarks/pack_cache.sh .tl-cache .tl-carry/warm-start
set -euo pipefail
src=${1:-.tl-cache}
marker=${2:-}
out=${CARRY:-.tl-carry}
mkdir -p "$out"
root=0.1.15/linux-x86_64
if [[ -n $marker ]]; then
  marker=$(realpath "$marker")
  (cd "$src" && find "$root/kernels" -mindepth 2 -maxdepth 2 -anewer "$marker" -printf '%h\n' | sort -u) > "$out/entries.txt"
  if [[ -n ${KERNELS:-} ]]; then
    want=0; re=$KERNELS; [[ $re == '!'* ]] && want=1 re=${re:1}
    while read -r e; do
      grep -qE "__global__ void[^(]*(${re})" "$src/$e/device_kernel.cu"; [[ $? == "$want" ]] && echo "$e"
    done < "$out/entries.txt" > "$out/entries.sel" || true
    mv "$out/entries.sel" "$out/entries.txt"
  fi
  tar -C "$src" -cf - -T "$out/entries.txt" | xz -T0 -9e > "$out/tlcache.tar.xz"
  echo "packed $(wc -l < "$out/entries.txt") kernels, $(du -h "$out/tlcache.tar.xz" | cut -f1), from $src"
else
  tar -C "$src" -cf - $root 2>/dev/null | xz -T0 -9e > "$out/tlcache.tar.xz" || true
  echo "packed $(du -h "$out/tlcache.tar.xz" | cut -f1) from $src"
fi
