#!/usr/bin/env bash
# examples/train_gpt.py on the GPU host: the four single-GPU modes (--compare: tokens/s table and
# loss.png), then DDP and FSDP2 over every visible GPU when there are two or more. Results (JSON,
# logs, loss.png) go to $OUT/train, packed as $OUT/train.tgz (the device tool returns few files).
#   source .gpu-bundle/activate.sh; bash benchmarks/train_runs.sh [STEPS]
# TRAIN_ARGS adds arguments to every run (e.g. "--layers 2 --dim 128 --heads 2 --seq 64").
set -uo pipefail
steps=${1:-200}
read -r -a extra <<< "${TRAIN_ARGS:-}"
out=${OUT:-gpu_out}/train; mkdir -p "$out"
if [[ -f .tl-carry/tlcache.tar.xz && -z "${TILELANG_CACHE_DIR:-}" ]]; then
  mkdir -p /tmp/tlcache && tar -C /tmp/tlcache -xJf .tl-carry/tlcache.tar.xz && export TILELANG_CACHE_DIR=/tmp/tlcache
fi
trap 'tar -C "$out/.." -czf "$out/../train.tgz" train && rm -rf "$out"' EXIT
timeout "${COMPARE_TIMEOUT:-300}" python3 examples/train_gpt.py --compare --steps "$steps" "${extra[@]}" --out "$out" > "$out/compare.log" 2>&1
echo "compare rc=$?"; grep -A6 "^mode" "$out/compare.log"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if ((gpus >= 2)); then
  for d in ddp fsdp2; do
    timeout "${DIST_TIMEOUT:-120}" torchrun --standalone --nproc-per-node "$gpus" examples/train_gpt.py --mode tileops --dist "$d" --steps "$steps" "${extra[@]}" --out "$out" > "$out/$d.log" 2>&1
    echo "$d x$gpus rc=$?: $(tail -1 "$out/$d.log")"
  done
fi
