#!/usr/bin/env bash
# The soft-RoCE test: runs the RDMA tests against a real verbs device, rdma_rxe, inside a
# qemu guest (stock Debian kernel, TCG; the host kernel has no RDMA): libkv's verbs and
# window tests (libkv/tests/rdma.rs), the page server's RDMA sessions (prefilld), and the
# whole stack over the RDMA transport (tests/tests/stack.rs); and, since the stock kernel has
# sch_netem where the host's may not, the network fault campaign on the TCP page path
# (tests/tests/netfaults.rs). The binaries are built on the
# host; the guest sees the host root read-only over
# virtio-9p, brings up rxe0 on a dummy netdev with a TEST-NET-1 address that exists only in
# the guest (`-nic none`: no network at all), and runs the binary with KVFENCE_RDMA_DEVICE=rxe0
# (see tests/vm/rxe-guest.sh and rxe-up.sh; the boot itself is in rxe-lib.sh).
#
# Usage: tests/vm/rxe.sh [--no-build] [--no-setup] [--model]
#   --no-build  use the binaries cargo built last
#   --no-setup  do not run tests/vm/setup.sh --rxe (the cache must be ready)
#   --model     instead: the real model (SmolLM2-135M, scripts/fetch-model) through the stack
#               over RDMA, each prompt against the monolithic path (tests/tests/real_model.rs);
#               slow under TCG, so not part of the default run (4 GiB, 2400 s by default)
# Env: KVFENCE_VM_CACHE (default ~/.cache/kvfence-vm), KVFENCE_VM_TIMEOUT (whole VM, s, 300),
#      KVFENCE_VM_MEM (MiB, 1024), KVFENCE_VM_CPUS (2), KVFENCE_VM_ACCEL (tcg | kvm: only where
#      /dev/kvm is real VMX/SVM), KVFENCE_VM_KEEP=1 (keep the results directory on success),
#      KVFENCE_NETFAULT_ROUNDS (rounds of the network fault campaign, 1),
#      KVFENCE_MODEL_PROMPT_TOKENS (--model: only prompts of at most this many tokens; all).
# Exit: 0 pass, 1 fail, 77 cannot run here (not x86_64, not root, no qemu and cannot install).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck disable=SC2034  # used by rxe-lib.sh
tag=rxe
# shellcheck source=rxe-lib.sh
. "$here/rxe-lib.sh"
build=1
setup=1
model=0
for a in "$@"; do
  case $a in
    --no-build) build=0 ;;
    --no-setup) setup=0 ;;
    --model) model=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "rxe: unknown argument $a" >&2; exit 1 ;;
  esac
done
t0=$SECONDS
rxe_prepare "$setup"

# The test binaries: cargo names them with a hash, its JSON messages say which. The stack
# tests spawn the daemons from target/release, built with RDMA here as well.
offline=()
[ "$build" = 1 ] || offline=(--offline)
# test_binary NAME CARGO-ARGS...: the executable of test target NAME
test_binary() {
  local name=$1; shift
  (cd "$root" && timeout 1800 cargo test --release --locked --features libkv/rdma "${offline[@]}" \
     "$@" --no-run --message-format=json 2>/dev/null) \
    | sed -n 's/.*"target":{[^}]*"name":"'"$name"'"[^}]*}.*"executable":"\([^"]*\)".*/\1/p' | tail -1
}
[ "$build" = 1 ] && echo "rxe: cargo build --release --bins --features libkv/rdma, test binaries"
if [ "$build" = 1 ]; then
  (cd "$root" && timeout 1800 cargo build --release --locked --bins --features libkv/rdma) \
    || { echo "rxe: FAIL: cannot build the daemons" >&2; exit 1; }
fi
if [ "$model" = 1 ]; then
  # fetches the model unless it is there (its path honours $KVFENCE_MODEL); the guest sees
  # the host's files where they are, and is told the path (it starts with no environment)
  model_path=$(cd "$root" && scripts/fetch-model) \
    || { echo "rxe: FAIL: no model file (scripts/fetch-model failed)" >&2; exit 1; }
  real=$(test_binary real_model -p kvfence-tests --test real_model)
  binaries=("$real")
else
  verbs=$(test_binary rdma -p libkv --test rdma)
  pages=$(test_binary prefilld -p prefilld --lib)
  stack=$(test_binary stack -p kvfence-tests --test stack)
  netfaults=$(test_binary netfaults -p kvfence-tests --test netfaults)
  binaries=("$verbs" "$pages" "$stack" "$netfaults")
fi
for b in "${binaries[@]}"; do
  [ -x "${b:-/nonexistent}" ] || { echo "rxe: FAIL: cannot build or find the RDMA test binaries" >&2; exit 1; }
done
tb=$SECONDS

out=$(mktemp -d -t kvfence-rxe.XXXXXX)
# one line per test binary: the binary, then its test filter
if [ "$model" = 1 ]; then
  echo "$real over_rdma" > "$out/test-binaries"
  echo "$model_path" > "$out/model-path"
  # every prompt, unless KVFENCE_MODEL_PROMPT_TOKENS caps their length for a host whose
  # emulation is slow (the test still wants 8 of them)
  [ -n "${KVFENCE_MODEL_PROMPT_TOKENS:-}" ] && echo "$KVFENCE_MODEL_PROMPT_TOKENS" > "$out/model-prompt-tokens"
  export KVFENCE_VM_MEM=${KVFENCE_VM_MEM:-4096} KVFENCE_VM_TIMEOUT=${KVFENCE_VM_TIMEOUT:-2400}
else
  {
    echo "$verbs"
    echo "$pages pageserver::tests::rdma::"
    echo "$stack rdma"
    echo "$netfaults"
  } > "$out/test-binaries"
fi
# the guest starts with an empty environment: the rounds of the network fault campaign go in
# a file (KVFENCE_NETFAULT_ROUNDS: the long run in the README)
[ -n "${KVFENCE_NETFAULT_ROUNDS:-}" ] && echo "$KVFENCE_NETFAULT_ROUNDS" > "$out/netfault-rounds"
cp "$here/rxe-guest.sh" "$out/rxe-guest.sh"
rxe_boot "$out" rxe-guest.sh "${KVFENCE_VM_TIMEOUT:-300}" || exit 1
rc=$guest_rc
echo "rxe: build $((tb - t0)) s, VM $vm_seconds s (boot to poweroff), total $((SECONDS - t0)) s"
if [ "$rc" = 0 ]; then
  echo "rxe: PASS"
  if [ "${KVFENCE_VM_KEEP:-0}" = 1 ]; then echo "rxe: results kept in $out"; else rm -rf "$out"; fi
  exit 0
fi
echo "rxe: FAIL (guest exit $rc); results in $out (console.log)" >&2
exit 1
