#!/usr/bin/env bash
# Checks the unit files in systemd/ without installing anything:
#   1. `systemd-analyze verify` on every unit (templates through an instance). verify exits 0
#      on unknown keys and bad values, so ANY output on stderr is a failure.
#   2. `systemd-analyze security --offline=true`: the overall exposure must be at most the
#      threshold (2.0 for kvctld, 4.0 for the workers, 2.5 for openaid), checked twice: by systemd-analyze's
#      own --threshold (non-zero exit above it) and by parsing the "Overall exposure level" line.
#   3. The sysusers.d and tmpfiles.d snippets apply cleanly to an empty temporary root.
#   4. decoded@.service is prefilld@.service with the names changed (they must not drift).
#
# verify refuses an ExecStart= whose binary does not exist, so the units are checked as a
# rewritten copy in a temporary directory whose ExecStart= paths point at stub executables
# (nothing else in the copy differs); that directory is put first on SYSTEMD_UNIT_PATH.
#
# Usage: scripts/check-units.sh [--threshold-ctl N] [--threshold-worker N] [--threshold N]
#   --threshold N sets both. Exit: 0 pass, 1 fail, 77 when systemd-analyze is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

ctl_max=2.0
worker_max=4.0
api_max=2.5
while [ $# -gt 0 ]; do
  case $1 in
    --threshold-ctl) ctl_max=$2; shift 2 ;;
    --threshold-worker) worker_max=$2; shift 2 ;;
    --threshold) ctl_max=$2; worker_max=$2; api_max=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "check-units: unknown argument $1" >&2; exit 1 ;;
  esac
done

if ! command -v systemd-analyze >/dev/null; then
  echo "check-units: SKIP: systemd-analyze not found (apt-get install systemd)" >&2
  exit 77
fi
echo "check-units: $(systemd-analyze --version | head -1)"

work=$(mktemp -d -t kvfence-units.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/units" "$work/root/etc"
for b in kvctld prefilld decoded openaid; do
  printf '#!/bin/sh\nexit 0\n' > "$work/bin/$b"
  chmod 755 "$work/bin/$b"
done
for f in systemd/*.service systemd/*.socket systemd/*.target; do
  sed "s|/usr/local/bin/|$work/bin/|g" "$f" > "$work/units/$(basename "$f")"
done
export SYSTEMD_UNIT_PATH="$work/units:"   # trailing colon: then the default search path
fail=0

# 1. verify: every unit, the templates through an instance name.
units=(kvctld.socket kvctld.service kvfence.target prefilld@check.service decoded@check.service
  openaid.service)
if ! timeout 60 systemd-analyze verify "${units[@]}" > "$work/verify.out" 2> "$work/verify.err" \
  || [ -s "$work/verify.err" ]; then
  echo "check-units: FAIL: systemd-analyze verify:" >&2
  cat "$work/verify.out" "$work/verify.err" >&2
  fail=1
else
  echo "check-units: verify clean: ${units[*]}"
fi

# 2. security exposure.
exposure() { # unit max
  local unit=$1 max=$2 out rc level tenths
  # systemd-analyze takes the threshold in tenths of the printed level (2.0 -> 20).
  tenths=$(awk -v m="$max" 'BEGIN { printf "%d", m * 10 + 0.5 }')
  rc=0
  out=$(timeout 60 systemd-analyze security --offline=true --threshold="$tenths" "$unit" 2>&1) || rc=$?
  level=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9][0-9.]*\).*/\1/p')
  if [ -z "$level" ]; then
    echo "check-units: FAIL: no 'Overall exposure level' line for $unit (rc $rc):" >&2
    printf '%s\n' "$out" >&2
    return 1
  fi
  if [ "$rc" != 0 ] || ! awk -v l="$level" -v m="$max" 'BEGIN { exit !(l + 0 <= m + 0) }'; then
    echo "check-units: FAIL: $unit exposure $level, at most $max allowed (systemd-analyze rc $rc):" >&2
    printf '%s\n' "$out" | grep -v '✓' >&2
    return 1
  fi
  echo "check-units: $unit exposure $level (at most $max)"
}
exposure kvctld.service "$ctl_max" || fail=1
exposure prefilld@check.service "$worker_max" || fail=1
exposure decoded@check.service "$worker_max" || fail=1
exposure openaid.service "$api_max" || fail=1

# 3. sysusers.d and tmpfiles.d snippets, applied to an empty root.
# (systemd-sysusers reports the accounts it creates on stderr: not a failure.)
if timeout 60 systemd-sysusers --root="$work/root" "$PWD/systemd/kvfence.sysusers" 2> "$work/sysusers.err" \
  && grep -q '^kvfence:' "$work/root/etc/passwd" && grep -q '^kvfence:' "$work/root/etc/group" \
  && grep -q '^kvfence-openai:' "$work/root/etc/passwd"; then
  echo "check-units: sysusers snippet creates user and group kvfence, user kvfence-openai"
else
  echo "check-units: FAIL: systemd-sysusers systemd/kvfence.sysusers:" >&2
  cat "$work/sysusers.err" >&2
  fail=1
fi
if timeout 60 systemd-tmpfiles --root="$work/root" --create "$PWD/systemd/kvfence.tmpfiles" 2> "$work/tmpfiles.err" \
  && [ -d "$work/root/run/kvfence" ] && [ -d "$work/root/var/lib/kvfence" ] && [ ! -s "$work/tmpfiles.err" ]; then
  echo "check-units: tmpfiles snippet creates /run/kvfence and /var/lib/kvfence"
else
  echo "check-units: FAIL: systemd-tmpfiles systemd/kvfence.tmpfiles:" >&2
  cat "$work/tmpfiles.err" >&2
  fail=1
fi

# 4. The two worker templates are one unit under two names.
if diff <(sed -e 's/prefilld/decoded/g' -e 's/prefill worker/decode worker/' \
          -e 's/\[prefill\] section/[decode] section/' systemd/prefilld@.service) \
        systemd/decoded@.service > "$work/diff.out"; then
  echo "check-units: decoded@.service matches prefilld@.service"
else
  echo "check-units: FAIL: decoded@.service drifted from prefilld@.service:" >&2
  cat "$work/diff.out" >&2
  fail=1
fi

if [ "$fail" = 0 ]; then echo "check-units: PASS"; else echo "check-units: FAIL" >&2; fi
exit "$fail"
