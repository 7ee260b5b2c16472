#!/usr/bin/env bash
# One GPU session: `tileops check`, benchmarks, then GPU tests. Logs and JSON under $OUT.
# On the device host (no package index):  source .gpu-bundle/activate.sh; [TESTS_FIRST=1] bash benchmarks/gpu_run.sh [tests...] -- [bench modules...]
# A bench entry may carry arguments as one quoted word: 'benchmarks.sweep_gemm --group nn_3072_768'.
# Carry .gpu-bundle and .tl-carry (warm and pack it here with: benchmarks/warm_all.sh).
set -uo pipefail
FINAL_OUT=${OUT:-gpu_out}; OUT=$FINAL_OUT/run; mkdir -p "$OUT"; export OUT
# the device tool returns at most 8 files: everything is packed into results.tgz at the end
trap 'tar -C "$FINAL_OUT" -czf "$FINAL_OUT/results.tgz" run && rm -rf "$OUT"' EXIT
# A kernel cache warmed on the CPU machine travels as .tl-carry/tlcache.tar.xz (xz: ~20x smaller);
# TL_CARRY=.tl-carry-X: another such folder (a call's own selection, when both would not fit).
carry=${TL_CARRY:-.tl-carry}
if [[ -f $carry/tlcache.tar.xz ]]; then
  mkdir -p /tmp/tlcache && tar -C /tmp/tlcache -xJf "$carry/tlcache.tar.xz" && export TILELANG_CACHE_DIR=/tmp/tlcache
fi
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tl-cache}
tests=(); benches=(); seen=0
for a in "$@"; do if [[ $a == -- ]]; then seen=1; elif ((seen)); then benches+=("$a"); else tests+=("$a"); fi; done
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch,tilelang;print('torch',torch.__version__,'cuda',torch.version.cuda,'tilelang',tilelang.__version__)"; } 2>&1 | tee "$OUT/env.txt"
status=0
touch "$OUT/.start"
# CHECK_ARGS="--op layer_norm ...": only those ops (their kernels are all a call may have warmed)
# shellcheck disable=SC2086
python3 -m tilelang_ops.cli check ${CHECK_ARGS:-} > "$OUT/check.log" 2>&1; rc=$?; status=$((status|rc))
echo "tileops check: rc=$rc  $(tail -1 "$OUT/check.log")"
run_benches() {
  local i=0 b log rc
  for b in "${benches[@]}"; do  # "module [args]" (one word each: quote a module with arguments)
    i=$((i+1)); log="$OUT/${i}_${b%% *}.log"  # numbered: one module may run twice with other arguments
    # under a timeout: a hung kernel must not eat the whole call
    # shellcheck disable=SC2086  # word splitting wanted: the module and its arguments
    timeout -s INT -k 30 "${BENCH_TIMEOUT:-900}" python3 -m $b > "$log" 2>&1; rc=$?; status=$((status|rc)); echo "== $b rc=$rc"; grep -v "INFO\|WARNING" "$log" | tail -40
  done
}
run_tests() {
  local rc
  ((${#tests[@]})) || return 0
  # -v and SIGINT: a run cut short still names the test it was in and prints the durations so far
  HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} timeout -s INT -k 30 "${TEST_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider -rs --durations=15 "${tests[@]}" > "$OUT/pytest.log" 2>&1; rc=$?; status=$((status|rc))
  echo "pytest ${tests[*]}: rc=$rc  $(tail -1 "$OUT/pytest.log")"
  ((rc == 124)) && echo "cut short in: $(grep -E '^tests/.*::' "$OUT/pytest.log" | tail -1)"
}
# TESTS_FIRST=1: the tests before the benchmarks (new kernels: a wrong or hanging one shows before
# the benchmarks spend the call's time on it)
if [[ ${TESTS_FIRST:-0} == 1 ]]; then run_tests; run_benches; else run_benches; run_tests; fi
grep -E "FAILED|Error" "$OUT/pytest.log" 2>/dev/null | head -30
# Kernels compiled here cost device time (the tma softmax kernels ~20-80 s of nvcc each): say so,
# so the next call carries them (warm on the CPU machine: benchmarks/warm_all.sh, pack_cache.sh).
# pytest captures TileLang's log: list the cache entries this host wrote instead (kernel name, entry)
find "$TILELANG_CACHE_DIR" -name device_kernel.cu -newer "$OUT/.start" 2>/dev/null | while read -r f; do
  echo "$(grep -o '__global__ void[^(]*' "$f" | head -1 | awk '{print $NF}') $(dirname "$f")"
done > "$OUT/compiled_here.txt"
if [[ -s $OUT/compiled_here.txt ]]; then
  echo "NOTE: $(wc -l < "$OUT/compiled_here.txt") kernels compiled on this host: $(cut -d' ' -f1 "$OUT/compiled_here.txt" | sort | uniq -c | sort -rn | head -8 | tr -s ' \n' ' ')"
  # ...and bring them back (~50-100 KB each, xz), so the next call carries them instead of
  # compiling again: here, benchmarks/add_to_carry.sh .../compiled_here.tar.xz.
  (cd "$TILELANG_CACHE_DIR" && cut -d' ' -f2 "$OUT/compiled_here.txt" | sed "s|^$TILELANG_CACHE_DIR/||" \
    | tar -cf - -T - | xz -T0 -6 > "$OUT/compiled_here.tar.xz")
fi
for log in "$OUT"/*.log; do
  n=$(grep -c "begins to compile" "$log" 2>/dev/null); n=${n:-0}
  ((n)) && echo "NOTE: $(basename "$log"): $n kernels compiled on this host (not in the carried cache)"
done
exit $status
