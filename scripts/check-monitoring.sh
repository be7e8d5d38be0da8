#!/usr/bin/env bash
# Checks the Prometheus alert rules (monitoring/kvfence.rules.yml) with promtool and runs
# their unit tests (monitoring/kvfence.rules.test.yml: every alert firing and quiet).
# Exit: 0 pass, 1 fail, 77 no promtool here (Debian's prometheus package has it).
set -euo pipefail
cd "$(dirname "$0")/../monitoring"
if ! command -v promtool >/dev/null 2>&1; then
  echo "check-monitoring: SKIP: no promtool (install Debian's prometheus package)" >&2
  exit 77
fi
promtool check rules kvfence.rules.yml
promtool test rules kvfence.rules.test.yml
