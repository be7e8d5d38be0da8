#!/usr/bin/env bash
# `kvctl demo` on a busy machine: two busy loops take the cores while the demo (its own
# stack of 2 prefill + 2 decode workers, the real model, 8 concurrent requests) runs, in
# rounds that alternate two builds, so that both see the same machine. Prints each round
# as a JSON line (build, passed, failed requests and why), then the pass count per build.
#
#   scripts/bench-demo-busy.sh ROUNDS BIN_DIR [BIN_DIR...]
#   DEMO_REQUESTS=24 scripts/bench-demo-busy.sh ...   # more concurrent requests
#
# Each BIN_DIR holds kvctl and the daemons of one build (target/release, or the release
# directory of another checkout). The busy loops are this script's own children, ended by
# their pids when it exits.
set -euo pipefail

rounds=${1:?usage: bench-demo-busy.sh ROUNDS BIN_DIR [BIN_DIR...]}
shift
[ $# -ge 1 ] || { echo "give at least one BIN_DIR" >&2; exit 2; }
for d in "$@"; do
  [ -x "$d/kvctl" ] || { echo "$d/kvctl is missing" >&2; exit 2; }
done

busy=()
stop_busy() {
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap stop_busy EXIT
for _ in 1 2; do
  sh -c 'while :; do :; done' &
  busy+=("$!")
done

declare -A passed
out=$(mktemp)
for r in $(seq 1 "$rounds"); do
  for d in "$@"; do
    rc=0
    timeout 600 "$d/kvctl" demo --json --requests "${DEMO_REQUESTS:-8}" >"$out" 2>/dev/null || rc=$?
    python3 - "$d" "$r" "$rc" "$out" <<'PY'
import json, sys
build, rnd, rc, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    v = json.load(open(path))
except Exception:
    v = {}
reqs = v.get("requests", [])
failed = [r.get("error") or "wrong output" for r in reqs
          if r.get("error") or not r.get("tokens_match", False)]
lat = sorted(r.get("latency_us", 0) / 1e6 for r in reqs)
print(json.dumps({"build": build, "round": rnd, "exit": rc, "passed": rc == 0,
                  "requests": len(reqs), "failed": failed,
                  "latency_s_max": round(lat[-1], 2) if lat else None}))
PY
    if [ "$rc" = 0 ]; then passed[$d]=$(( ${passed[$d]:-0} + 1 )); fi
  done
done
rm -f "$out"
for d in "$@"; do
  echo "$d: ${passed[$d]:-0} of $rounds demo runs passed with two busy loops"
done
