#!/usr/bin/env bash
# Builds what tests/gpu/run.sh runs on a GPU host, so that host needs no Rust toolchain.
#
#   tests/gpu/build.sh [BUNDLE]     # default BUNDLE: target/gpu-bundle
#
# Builds in release mode, here (no CUDA toolkit needed: the driver and NVRTC are loaded at
# run time), the GPU test binary (libkv/tests/gpu.rs) and kvgpubench, and copies them with
# run.sh into BUNDLE, listed in BUNDLE/MANIFEST. Carry BUNDLE to the GPU host (it is under
# target/, which git ignores) and run BUNDLE/run.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-target/gpu-bundle}
target=${CARGO_TARGET_DIR:-target}

cargo build --release --locked -p libkv --bin kvgpubench
# The test binary's path comes from cargo's own report of what it built.
test_bin=$(cargo test --release --locked -p libkv --test gpu --no-run --message-format=json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "gpu" and "test" in m["target"]["kind"]:
        print(m["executable"])
')
if [ -z "$test_bin" ] || [ ! -x "$test_bin" ]; then
  echo "build.sh: cargo did not report the gpu test binary" >&2
  exit 1
fi

rm -rf "$bundle"
mkdir -p "$bundle"
cp "$test_bin" "$bundle/gpu-tests"
cp "$target/release/kvgpubench" "$bundle/kvgpubench"
cp tests/gpu/run.sh "$bundle/run.sh"
# Debug info is most of the size; the bundle travels, so it goes.
if command -v strip >/dev/null 2>&1; then
  strip --strip-debug "$bundle/gpu-tests" "$bundle/kvgpubench"
fi
{
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  (cd "$bundle" && sha256sum gpu-tests kvgpubench run.sh)
} > "$bundle/MANIFEST"
echo "bundle: $bundle ($(du -sh "$bundle" | cut -f1)); on the GPU host run: $bundle/run.sh"
