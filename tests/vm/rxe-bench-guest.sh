#!/bin/sh
# shellcheck disable=SC2154  # bench.env sets bin, rounds, sizes, seconds and mib
# Runs inside the soft-RoCE guest (tests/vm/rxe-bench.sh): brings up rxe0 (rxe-up.sh), then,
# round after round, for each message size: kvrdmabench (RDMA READ of page runs through
# per-request read windows), perftest's ib_read_bw and ib_write_bw (server and client both
# here, on 192.0.2.1). One figure per line to OUTDIR/results.txt:
#   ROUND TOOL SIZE GBITS   (TOOL: kvfence-contiguous, kvfence-scattered, ib_read_bw, ib_write_bw)
# Every command runs under timeout; a run that fails is logged and leaves its figure out.
# Usage: rxe-bench-guest.sh OUTDIR (OUTDIR/bench.env: bin, rounds, sizes, seconds, mib)
set -u
out=$1
# shellcheck disable=SC1091  # written by rxe-bench.sh
. "$out/bench.env"
# shellcheck source=rxe-up.sh
. "$out/rxe-up.sh"
res=$out/results.txt
: > "$res"
port=18515

# perftest_once TOOL SIZE: one server and one client run of TOOL, about $mib MiB; sets bw
# (Gb/s, empty when the run failed)
perftest_once() {
  tool=$1 size=$2
  n=$((mib * 1048576 / size))
  port=$((port + 1))
  bw=
  # MiB/s (2 decimals), not --report_gbits (2 decimals of Gb/s is too coarse under TCG)
  args="-d rxe0 -x $gid -F -s $size -n $n -p $port"
  # shellcheck disable=SC2086  # args is a list of words
  timeout 120 "$tool" $args > "$out/server.txt" 2>&1 &
  server=$!
  # wait until the server listens (a client that comes too early fails at once)
  i=0
  while ! ss -ltn 2>/dev/null | grep -q ":$port "; do
    i=$((i + 1))
    [ $i -gt 100 ] && break
    sleep 0.2
  done
  # shellcheck disable=SC2086
  timeout 120 "$tool" $args 192.0.2.1 > "$out/client.txt" 2>&1
  crc=$?
  wait $server
  src=$?
  # the figures line: bytes, iterations, peak, average MiB/s, message rate; to Gb/s
  avg=$(awk -v s="$size" '$1 == s && NF >= 5 { print $4; exit }' "$out/client.txt")
  if [ $crc != 0 ] || [ $src != 0 ] || [ -z "$avg" ]; then
    echo "rxe-bench: $tool -s $size failed (client $crc, server $src):"
    tail -5 "$out/client.txt" "$out/server.txt"
    return 1
  fi
  # perftest now and then reports an average of 0.00 for a run that moved every byte: a
  # glitch of its clock under emulation, not a figure
  if [ "$(awk -v a="$avg" 'BEGIN { print (a > 0) }')" != 1 ]; then
    echo "rxe-bench: $tool -s $size reported $avg MiB/s:"
    grep -E "^ *[#0-9]" "$out/client.txt" | tail -2
    return 1
  fi
  bw=$(awk -v a="$avg" 'BEGIN { printf "%.4f", a * 1048576 * 8 / 1e9 }')
}

# perftest TOOL SIZE ROUND: a figure of TOOL for the round, in up to three tries
perftest() {
  for try in 1 2 3; do
    if perftest_once "$1" "$2"; then
      echo "round $3: $1 $2 B x $n: $bw Gb/s"
      echo "$3 $1 $2 $bw" >> "$res"
      return 0
    fi
    echo "rxe-bench: $1 -s $2, try $try of 3 failed"
  done
  return 1
}

# kvfence SIZE ROUND: kvrdmabench with pages of SIZE bytes, both destination layouts
kvfence() {
  size=$1 round=$2
  timeout 300 "$bin" --device rxe0 --gid-index "$gid" --page-kib $((size / 1024)) \
    --seconds "$seconds" --layout both > "$out/kvfence.txt" 2>&1
  rc=$?
  grep -v '^RESULT' "$out/kvfence.txt" | sed "s/^/round $round: /"
  [ $rc = 0 ] || { echo "rxe-bench: kvrdmabench failed ($rc)"; return 1; }
  sed -n 's/^RESULT tool=kvfence page_bytes=\([0-9]*\) layout=\([a-z]*\) gbits=\([0-9.]*\) .*/\1 \2 \3/p' \
    "$out/kvfence.txt" | while read -r bytes layout bw; do
    echo "$round kvfence-$layout $bytes $bw" >> "$res"
  done
}

failed=0
r=1
while [ $r -le "$rounds" ]; do
  for size in $sizes; do
    kvfence "$size" $r || failed=$((failed + 1))
    perftest ib_read_bw "$size" $r || failed=$((failed + 1))
    perftest ib_write_bw "$size" $r || failed=$((failed + 1))
  done
  r=$((r + 1))
done
echo "rxe-bench: $failed failed runs"
exit $failed
