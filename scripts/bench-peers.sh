#!/usr/bin/env bash
# Runs kvtcpbench (the TCP page path on loopback: pull, land with the digest fused, verify)
# side by side with iperf3 (one stream and as many streams as page path connections) and
# Mooncake Transfer Engine's own benchmark, transfer_engine_bench over its TCP transport, in
# interleaved rounds, and prints the figures, the ratios and where each one's CPU time went.
# Everything stays on 127.0.0.1.
#
#   1. Creates the .peers virtual environment with the Mooncake wheel (it ships
#      transfer_engine_bench) unless it is there already.
#   2. Builds kvtcpbench in release.
#   3. Runs it with --mooncake pointing at the benchmark binary inside the wheel.
#
# Every step is bounded by what is left of one time budget (BENCH_BUDGET seconds, 290 by
# default). A first build can take most of it: the run then does not start, and running the
# script again (everything is built by then) measures.
#
# Usage: scripts/bench-peers.sh [kvtcpbench options, e.g. --rounds 5]
# Needs python3 with venv, iperf3 on the PATH for the iperf3 figures, and libibverbs1 (the
# Mooncake benchmark links it even over TCP; without it Mooncake's figures say why they are
# missing).
set -euo pipefail
cd "$(dirname "$0")/.."

budget=${BENCH_BUDGET:-290}
# A default run: 3 rounds of iperf3 (-P 1, -P 2) and 4 cases of the page path (1 and 2
# connections) and Mooncake (write, read): about a minute a round.
run_needs=200
mooncake_pkg=mooncake-transfer-engine-non-cuda==0.3.13.post1

left() {
  local n=$((budget - SECONDS))
  if [ "$n" -le 0 ]; then
    echo "bench-peers: out of time (budget ${budget}s)" >&2
    exit 1
  fi
  echo "$n"
}

# Runs a command under what is left of the budget.
bounded() {
  local t
  t=$(left)
  timeout "$t" "$@"
}

find_bench() {
  # The executable inside the mooncake package; bin/transfer_engine_bench is a launcher
  # script that would run it as a grandchild.
  find .peers -path '*/mooncake/transfer_engine_bench' -type f 2>/dev/null | head -n 1
}

if [ ! -x .peers/bin/pip ]; then
  bounded python3 -m venv .peers
fi
if [ -z "$(find_bench)" ]; then
  bounded .peers/bin/pip install --quiet "$mooncake_pkg"
fi
bench=$(find_bench)
if [ -z "$bench" ]; then
  echo "bench-peers: no transfer_engine_bench in .peers after installing $mooncake_pkg" >&2
  exit 1
fi

bounded cargo build --release --quiet -p kvfence-tests --bin kvtcpbench

remaining=$(left)
if [ "$remaining" -lt "$run_needs" ]; then
  echo "bench-peers: built, but only ${remaining}s of the ${budget}s budget are left;" \
    "run it again to measure" >&2
  exit 1
fi
exec timeout --kill-after=10 "$remaining" target/release/kvtcpbench --mooncake "$bench" "$@"
