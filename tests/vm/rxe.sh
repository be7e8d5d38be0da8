#!/usr/bin/env bash
# The soft-RoCE test: runs the RDMA tests against a real verbs device, rdma_rxe, inside a
# qemu guest (stock Debian kernel, TCG; the host kernel has no RDMA): libkv's verbs and
# window tests (libkv/tests/rdma.rs), the page server's RDMA sessions (prefilld), and the
# whole stack over the RDMA transport (tests/tests/stack.rs). The binaries are built on the
# host; the guest sees the host root read-only over
# virtio-9p, brings up rxe0 on a dummy netdev with a TEST-NET-1 address that exists only in
# the guest (`-nic none`: no network at all), and runs the binary with KVFENCE_RDMA_DEVICE=rxe0
# (see tests/vm/rxe-guest.sh).
#
# Usage: tests/vm/rxe.sh [--no-build] [--no-setup]
#   --no-build  use the binaries cargo built last
#   --no-setup  do not run tests/vm/setup.sh --rxe (the cache must be ready)
# Env: KVFENCE_VM_CACHE (default ~/.cache/kvfence-vm), KVFENCE_VM_TIMEOUT (whole VM, s, 300),
#      KVFENCE_VM_MEM (MiB, 1024), KVFENCE_VM_CPUS (2), KVFENCE_VM_ACCEL (tcg | kvm: only where
#      /dev/kvm is real VMX/SVM), KVFENCE_VM_KEEP=1 (keep the results directory on success).
# Exit: 0 pass, 1 fail, 77 cannot run here (not x86_64, not root, no qemu and cannot install).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${KVFENCE_VM_CACHE:-$HOME/.cache/kvfence-vm}
build=1
setup=1
for a in "$@"; do
  case $a in
    --no-build) build=0 ;;
    --no-setup) setup=0 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "rxe: unknown argument $a" >&2; exit 1 ;;
  esac
done
skip() { echo "rxe: SKIP: $*" >&2; exit 77; }
t0=$SECONDS

[ "$(uname -m)" = x86_64 ] || skip "needs an x86_64 host (the guest kernel is amd64)"
[ "$(id -u)" = 0 ] || skip "needs root (the host root is exported to the guest over 9p)"
if [ "$setup" = 1 ]; then
  timeout 1800 "$here/setup.sh" --rxe
  rc=$?
  [ "$rc" = 77 ] && exit 77
  [ "$rc" = 0 ] || { echo "rxe: FAIL: setup.sh --rxe exited $rc" >&2; exit 1; }
fi
command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 missing (run tests/vm/setup.sh --rxe as root)"
for f in kernel/vmlinux initramfs-rxe.cpio.gz; do
  [ -e "$cache/$f" ] || skip "$cache/$f missing: run tests/vm/setup.sh --rxe"
done

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
verbs=$(test_binary rdma -p libkv --test rdma)
pages=$(test_binary prefilld -p prefilld --lib)
stack=$(test_binary stack -p kvfence-tests --test stack)
for b in "$verbs" "$pages" "$stack"; do
  [ -x "${b:-/nonexistent}" ] || { echo "rxe: FAIL: cannot build or find the RDMA test binaries" >&2; exit 1; }
done
tb=$SECONDS

out=$(mktemp -d -t kvfence-rxe.XXXXXX)
# one line per test binary: the binary, then its test filter
{
  echo "$verbs"
  echo "$pages pageserver::tests::rdma::"
  echo "$stack rdma"
} > "$out/test-binaries"
cp "$here/rxe-guest.sh" "$out/rxe-guest.sh"
chmod -R a+rX "$out"

# shellcheck disable=SC2054  # the commas belong to qemu options
case "${KVFENCE_VM_ACCEL:-tcg}" in
  kvm) accel=(-machine q35 -accel kvm -cpu host) ;;
  *) accel=(-machine q35 -accel tcg,thread=multi,tb-size=64 -cpu max) ;;
esac
vm_timeout=${KVFENCE_VM_TIMEOUT:-300}
echo "rxe: booting the guest (timeout ${vm_timeout}s), results in $out"
tv=$SECONDS
timeout --kill-after=10 "$vm_timeout" qemu-system-x86_64 "${accel[@]}" \
  -smp "${KVFENCE_VM_CPUS:-2}" -m "${KVFENCE_VM_MEM:-1024}" \
  -display none -vga none -monitor none -serial stdio -no-reboot -nic none \
  -kernel "$cache/kernel/vmlinux" -initrd "$cache/initramfs-rxe.cpio.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off kvfence_out=$out kvfence_script=$out/rxe-guest.sh kvfence_timeout=$((vm_timeout - 30))" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
  < /dev/null > "$out/console.log" 2>&1
qrc=$?
tq=$((SECONDS - tv))

# the guest's output (rxe set-up, then the test binary's) without the boot noise
sed -n '/^init: ready/,/^KVFENCE_VM_EXIT=/p' "$out/console.log" | tr -d '\r'
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
  echo "rxe: FAIL: the guest did not power off within ${vm_timeout}s; see $out/console.log" >&2
  tail -20 "$out/console.log" >&2
  exit 1
fi
if [ ! -f "$out/exit-code" ]; then
  echo "rxe: FAIL: no result from the guest (qemu rc $qrc); see $out/console.log" >&2
  tail -20 "$out/console.log" >&2
  exit 1
fi
rc=$(cat "$out/exit-code")
echo "rxe: build $((tb - t0)) s, VM $tq s (boot to poweroff), total $((SECONDS - t0)) s"
if [ "$rc" = 0 ]; then
  echo "rxe: PASS"
  if [ "${KVFENCE_VM_KEEP:-0}" = 1 ]; then echo "rxe: results kept in $out"; else rm -rf "$out"; fi
  exit 0
fi
echo "rxe: FAIL (guest exit $rc); results in $out (console.log)" >&2
exit 1
