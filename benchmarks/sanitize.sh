#!/usr/bin/env bash
# benchmarks/sanitize.py under each compute-sanitizer tool, then without one, repeated (the flake
# hunt). On the device host:  source .gpu-bundle/activate.sh; bash benchmarks/sanitize.sh [TOOL ...]
# Logs under $OUT; prints each tool's ERROR SUMMARY and the failed cases last.
# TOOL: memcheck synccheck racecheck initcheck (default: all four); SAN_TIMEOUT seconds each (150);
# SAN_ARGS: arguments of benchmarks.sanitize under the tools (e.g. "--only fwd_cfg");
# HUNT_REPEAT runs of each fwd_cfg case without a sanitizer (200; 0: none).
set -uo pipefail
# shellcheck disable=SC2086  # SAN_ARGS: word splitting wanted
OUT=${OUT:-san_out}; mkdir -p "$OUT"
if [[ -f .tl-carry/tlcache.tar.xz && -z ${TILELANG_CACHE_DIR:-} ]]; then
  mkdir -p /tmp/tlcache && tar -C /tmp/tlcache -xJf .tl-carry/tlcache.tar.xz && export TILELANG_CACHE_DIR=/tmp/tlcache
fi
tools=("$@"); ((${#tools[@]})) || tools=(memcheck synccheck racecheck initcheck)
python3 -m benchmarks.sanitize ${SAN_ARGS:-} > "$OUT/plain.log" 2>&1; echo "plain rc=$? $(tail -1 "$OUT/plain.log")"
for t in "${tools[@]}"; do
  # the caching allocator hides an access past a tensor's end inside its pool block: off for the
  # memory checkers
  env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s INT -k 20 "${SAN_TIMEOUT:-150}" \
    compute-sanitizer --tool "$t" --print-limit 20 python3 -m benchmarks.sanitize ${SAN_ARGS:-} > "$OUT/$t.log" 2>&1
  echo "$t rc=$? $(grep -c '^ok' "$OUT/$t.log") ok, $(grep -c '^FAIL' "$OUT/$t.log") FAIL; $(grep 'ERROR SUMMARY' "$OUT/$t.log" | tail -1)"
done
if ((${HUNT_REPEAT:-200})); then
  timeout -s INT -k 20 "${HUNT_TIMEOUT:-150}" python3 -m benchmarks.sanitize --only fwd_cfg --repeat "${HUNT_REPEAT:-200}" > "$OUT/hunt.log" 2>&1
  echo "hunt rc=$?"; grep -v INFO "$OUT/hunt.log" | tail -10
fi
grep -h "^FAIL\|HUNG" "$OUT"/*.log | sort | uniq -c | head -20
