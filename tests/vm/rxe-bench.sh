#!/usr/bin/env bash
# The soft-RoCE benchmark: in one boot of the rxe guest (see rxe.sh), kvrdmabench (RDMA READ
# of page runs through per-request read windows, between two QPs on rxe0) next to perftest's
# ib_read_bw and ib_write_bw on the same device, interleaved round by round (kvfence, read,
# write, for each size, then again), and the ratios kvfence / ib_read_bw and
# kvfence / ib_write_bw per message size: the median of the per-round ratios.
#
# Under TCG every figure is slow (ib_write_bw about 0.1-0.3 Gb/s) and only the ratios mean
# anything. A benchmark: it prints figures and asserts nothing; it fails only when a run
# fails. perftest must be installed on the host (tests/vm/setup.sh --rxe installs it).
#
# Usage: tests/vm/rxe-bench.sh [--no-build] [--no-setup]
#   --no-build  use the kvrdmabench cargo built last
#   --no-setup  do not run tests/vm/setup.sh --rxe (the cache must be ready)
# Env: KVFENCE_BENCH_ROUNDS (3), KVFENCE_BENCH_SIZES (bytes, "65536 1048576"),
#      KVFENCE_BENCH_SECONDS (per kvrdmabench case, 3), KVFENCE_BENCH_MIB (per perftest run, 48),
#      KVFENCE_VM_TIMEOUT (whole VM, s, 600), and rxe-lib.sh's KVFENCE_VM_*.
# Exit: 0 ran, 1 a run failed, 77 cannot run here.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tag=rxe-bench
# shellcheck source=rxe-lib.sh
. "$here/rxe-lib.sh"
build=1
setup=1
for a in "$@"; do
  case $a in
    --no-build) build=0 ;;
    --no-setup) setup=0 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "$tag: unknown argument $a" >&2; exit 1 ;;
  esac
done
rxe_prepare "$setup"
for t in ib_read_bw ib_write_bw ss; do
  command -v "$t" >/dev/null || skip "$t missing (run tests/vm/setup.sh --rxe as root)"
done

# The binary: cargo's JSON messages say where it is (whatever the target directory).
build_args=(build --release --locked -p kvfence-tests --features libkv/rdma --bin kvrdmabench
            --message-format=json)
[ "$build" = 1 ] && echo "$tag: cargo ${build_args[*]}"
[ "$build" = 1 ] || build_args+=(--offline)
bin=$(cd "$root" && timeout 1800 cargo "${build_args[@]}" 2>/dev/null \
      | sed -n 's/.*"target":{[^}]*"name":"kvrdmabench"[^}]*}.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "${bin:-/nonexistent}" ] || { echo "$tag: FAIL: cannot build or find kvrdmabench" >&2; exit 1; }

out=$(mktemp -d -t kvfence-rxe-bench.XXXXXX)
cat > "$out/bench.env" <<EOT
bin=$bin
rounds=${KVFENCE_BENCH_ROUNDS:-3}
sizes="${KVFENCE_BENCH_SIZES:-65536 1048576}"
seconds=${KVFENCE_BENCH_SECONDS:-3}
mib=${KVFENCE_BENCH_MIB:-48}
EOT
cp "$here/rxe-bench-guest.sh" "$out/rxe-bench-guest.sh"
rxe_boot "$out" rxe-bench-guest.sh "${KVFENCE_VM_TIMEOUT:-600}" || exit 1

# ratios: per round kvfence / perftest, then the median over the rounds (medians of the
# figures themselves alongside)
echo "$tag: VM $vm_seconds s; medians over the rounds, Gb/s and ratios:"
awk '
  { bw[$1, $2, $3] = $4; rounds[$1] = 1; tools[$2] = 1; sizes[$3] = 1 }
  function median(a, n,   i, j, t) {
    for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  END {
    ns = 0; for (s in sizes) sl[++ns] = s + 0
    for (i = 2; i <= ns; i++) { t = sl[i]; for (j = i - 1; j >= 1 && sl[j] > t; j--) sl[j + 1] = sl[j]; sl[j + 1] = t }
    split("kvfence-contiguous kvfence-scattered ib_read_bw ib_write_bw", tl, " ")
    for (k = 1; k <= ns; k++) {
      s = sl[k]
      line = sprintf("size %7d:", s)
      for (t = 1; t <= 4; t++) {
        n = 0; delete v
        for (r in rounds) if ((r, tl[t], s) in bw) v[++n] = bw[r, tl[t], s]
        line = line sprintf("  %s %s", tl[t], n ? sprintf("%.3f", median(v, n)) : "-")
      }
      print line
      for (a = 1; a <= 2; a++) for (b = 3; b <= 4; b++) {
        n = 0; delete v
        for (r in rounds) if ((r, tl[a], s) in bw && (r, tl[b], s) in bw && bw[r, tl[b], s] > 0)
          v[++n] = bw[r, tl[a], s] / bw[r, tl[b], s]
        if (n) printf "size %7d: %s / %s = %.2f (median of %d rounds)\n", s, tl[a], tl[b], median(v, n), n
      }
    }
  }' "$out/results.txt" | tee "$out/summary.txt"
if [ "$guest_rc" != 0 ]; then
  echo "$tag: FAIL: $guest_rc runs failed in the guest; results in $out" >&2
  exit 1
fi
echo "$tag: results in $out"
