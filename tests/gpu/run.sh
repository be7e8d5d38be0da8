#!/usr/bin/env bash
# Runs the GPU tests and the GPU pull benchmark on one GPU, and prints the figures.
#
#   tests/gpu/build.sh                 # here, with Rust: builds target/gpu-bundle
#   target/gpu-bundle/run.sh [N]       # on the GPU host, no Rust needed; N: CUDA ordinal (0)
#   tests/gpu/run.sh [N]               # on a GPU host with Rust: builds the bundle, runs it
#
# Needs the NVIDIA driver (libcuda.so.1) and NVRTC (libnvrtc.so.12) on the loader path.
# Each test runs in a process of its own (a CUDA fault poisons the whole context), under a
# time limit; then kvgpubench runs. Under 10 minutes on one H100 (about 1 GiB of GPU
# memory). Exits non-zero if any test failed or the benchmark did not run.
# Environment: KVFENCE_GPU_TEST_TIMEOUT (s per test, 120), KVFENCE_GPU_BENCH_ARGS
# (kvgpubench arguments, default "--pages 2048 --page-kib 256 --iters 20").
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
device=${1:-0}
per_test=${KVFENCE_GPU_TEST_TIMEOUT:-120}
bench_args=${KVFENCE_GPU_BENCH_ARGS:---pages 2048 --page-kib 256 --iters 20}

if [ ! -x "$here/gpu-tests" ]; then
  # Run from the source tree: build the bundle first (needs cargo).
  root=$(cd "$here/../.." && pwd)
  bundle="${CARGO_TARGET_DIR:-$root/target}/gpu-bundle"
  "$here/build.sh" "$bundle" || exit 1
  exec "$bundle/run.sh" "$@"
fi

echo "== GPU host"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
else
  echo "nvidia-smi not found"
fi
for lib in libcuda.so.1 libnvrtc.so.12; do
  if ldconfig -p 2>/dev/null | grep -q "$lib"; then echo "$lib: found"; else echo "$lib: not in the ldconfig cache (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"; fi
done
[ -f "$here/MANIFEST" ] && head -1 "$here/MANIFEST"

echo "== GPU tests (device $device)"
export KVFENCE_GPU=$device
mapfile -t tests < <("$here/gpu-tests" --list --format terse 2>/dev/null | sed -n 's/: test$//p')
if [ "${#tests[@]}" -eq 0 ]; then
  echo "no tests listed by $here/gpu-tests" >&2
  exit 1
fi
passed=0 failed=0 skipped=0
failures=()
for t in "${tests[@]}"; do
  start=$(date +%s%N)
  out=$(timeout "$per_test" "$here/gpu-tests" --exact "$t" --nocapture --test-threads 1 2>&1)
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  secs="$((ms / 1000)).$((ms % 1000 / 100))"
  if [ "$rc" -eq 0 ] && grep -q "SKIPPED" <<<"$out"; then
    skipped=$((skipped + 1)); verdict="skipped: $(grep -m1 SKIPPED <<<"$out")"
  elif [ "$rc" -eq 0 ]; then
    passed=$((passed + 1)); verdict="ok"
  else
    failed=$((failed + 1)); verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
    failures+=("$t")
    printf '%s\n' "$out" | tail -n 30 | sed 's/^/    /'
  fi
  printf '%-64s %6ss  %s\n' "$t" "$secs" "$verdict"
done
echo "tests: $passed passed, $failed failed, $skipped skipped"

echo "== GPU pull benchmark (device $device)"
# shellcheck disable=SC2086
timeout 300 "$here/kvgpubench" --device "$device" $bench_args
bench=$?
[ "$bench" -eq 0 ] || echo "kvgpubench failed (exit $bench)"

if [ "$failed" -gt 0 ] || [ "$bench" -ne 0 ]; then
  [ "$failed" -gt 0 ] && echo "failed: ${failures[*]}"
  exit 1
fi
exit 0
