#!/usr/bin/env bash
# The systemd integration test: boots systemd as PID 1 in a qemu guest (stock Debian kernel,
# TCG), installs kvfence in it with the project's own scripts/install.sh, and through systemd
# checks socket activation (a client connects before kvctld runs; systemd starts kvctld),
# starts two prefilld@ and two decoded@ instances under one kvctld, each reading its own
# /etc/kvfence/<instance>.toml, checks in `kvctl status` that all four registered under their
# instance names with their own pools, generates through them (draining one pair sends the
# requests to the other; a drained worker stops and comes back), stops the stack gracefully
# and uninstalls it. The guest powers off and reports its result; see tests/vm/guest-test.sh
# for the steps.
#
# Usage: tests/vm/systemd-boot.sh [--no-build] [--no-setup]
#   --no-build  use target/release/{kvctld,kvctl,prefilld,decoded} as they are
#   --no-setup  do not run tests/vm/setup.sh (the cache must be ready)
# Env: KVFENCE_VM_CACHE (default ~/.cache/kvfence-vm), KVFENCE_VM_TIMEOUT (whole VM, s, 600),
#      KVFENCE_VM_MEM (MiB, 1024), KVFENCE_VM_CPUS (2), KVFENCE_VM_ACCEL (tcg | kvm: only where
#      /dev/kvm is real VMX/SVM), KVFENCE_VM_KEEP=1 (keep the results directory on success).
# Exit: 0 pass, 1 fail, 77 cannot run here (no qemu, not root, no cache and cannot build it).
# Results: console.log, guest.log (step by step), steps.txt, journal.txt, kvfence-journal.txt
# in a directory printed at the end (kept on failure).
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
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "systemd-boot: unknown argument $a" >&2; exit 1 ;;
  esac
done
skip() { echo "systemd-boot: SKIP: $*" >&2; exit 77; }
t0=$SECONDS

[ "$(uname -m)" = x86_64 ] || skip "needs an x86_64 host (the guest kernel is amd64)"
[ "$(id -u)" = 0 ] || skip "needs root (the guest rootfs is a root-owned tree shared over 9p)"
if [ "$setup" = 1 ]; then
  timeout 1800 "$here/setup.sh"
  rc=$?
  [ "$rc" = 77 ] && exit 77
  [ "$rc" = 0 ] || { echo "systemd-boot: FAIL: setup.sh exited $rc" >&2; exit 1; }
fi
command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 missing (run tests/vm/setup.sh as root)"
for f in kernel/vmlinux initramfs.cpio.gz rootfs/lib/systemd/systemd; do
  [ -e "$cache/$f" ] || skip "$cache/$f missing: run tests/vm/setup.sh"
done

bins=(kvctld kvctl prefilld decoded openaid)
target=${CARGO_TARGET_DIR:-$root/target}
if [ "$build" = 1 ]; then
  echo "systemd-boot: cargo build --release"
  (cd "$root" && timeout 1800 cargo build --release --locked -p kvctld -p prefilld -p decoded -p openaid --bins) \
    || { echo "systemd-boot: FAIL: cargo build" >&2; exit 1; }
fi
for b in "${bins[@]}"; do
  [ -x "$target/release/$b" ] || { echo "systemd-boot: FAIL: $target/release/$b missing" >&2; exit 1; }
done
tb=$SECONDS

# Stage what the guest needs, laid out as the repository so that install.sh runs unchanged:
# the results share (read-write, same path in the guest) carries it.
out=$(mktemp -d -t kvfence-vm.XXXXXX)
src=$out/src
mkdir -p "$src/scripts" "$src/systemd" "$src/libkv" "$src/target/release"
cp "$root/scripts/install.sh" "$root/scripts/uninstall.sh" "$src/scripts/"
cp "$root"/systemd/* "$src/systemd/"
cp "$root/libkv/kvfence.example.toml" "$src/libkv/"
# (without their debug info: a quarter of the size to read over 9p in the guest)
for b in "${bins[@]}"; do
  strip --strip-debug -o "$src/target/release/$b" "$target/release/$b" 2>/dev/null \
    || cp "$target/release/$b" "$src/target/release/$b"
done
cp "$here/guest-test.sh" "$out/guest-test.sh"
# A small stack on host memory: pages of 16 KiB, pools of 2 MiB or less, short deadlines.
# kvfence-vm.toml is kvctld's; each worker instance gets its own file, which differs from it
# in the size of that worker's pool (so `kvctl status` shows which file each one read).
vm_config() { # prefill_pages decode_pages
  cat <<EOT
[geometry]
tokens_per_page = 16
layers = 2
kv_heads = 2
head_dim = 64
dtype = "f16"

[limits]
max_context = 1024
max_new_tokens = 256

[control]
socket = "/run/kvfence/kvctld.sock"

[prefill]
pool_pages = $1
backend = "host"

[decode]
pool_pages = $2
backend = "host"

[deadlines]
drain = 2000
EOT
}
# max_context 1024 needs 64 prefill pages, + max_new_tokens 256 needs 80 decode pages.
# (guest-test.sh checks these sizes in kvctl status: keep them in step.)
vm_config 128 128 > "$out/kvfence-vm.toml"
vm_config 120 128 > "$out/prefill-0.toml"
vm_config 96 128 > "$out/prefill-1.toml"
vm_config 128 124 > "$out/decode-0.toml"
vm_config 128 112 > "$out/decode-1.toml"
chmod -R a+rX "$out"

# shellcheck disable=SC2054  # the commas belong to qemu options
case "${KVFENCE_VM_ACCEL:-tcg}" in
  kvm) accel=(-machine q35 -accel kvm -cpu host) ;;
  *) accel=(-machine q35 -accel tcg,thread=multi,tb-size=64 -cpu max) ;;
esac
vm_timeout=${KVFENCE_VM_TIMEOUT:-600}
echo "systemd-boot: booting the guest (timeout ${vm_timeout}s), results in $out"
tv=$SECONDS
timeout --kill-after=10 "$vm_timeout" qemu-system-x86_64 "${accel[@]}" \
  -smp "${KVFENCE_VM_CPUS:-2}" -m "${KVFENCE_VM_MEM:-1024}" \
  -display none -vga none -monitor none -serial stdio -no-reboot -nic none \
  -kernel "$cache/kernel/vmlinux" -initrd "$cache/initramfs.cpio.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off systemd.show_status=error kvfence_out=$out kvfence_script=$out/guest-test.sh kvfence_timeout=$((vm_timeout - 60))" \
  -virtfs local,path="$cache/rootfs",mount_tag=rootfs,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
  < /dev/null > "$out/console.log" 2>&1
qrc=$?
tq=$((SECONDS - tv))

[ -f "$out/steps.txt" ] && cat "$out/steps.txt"
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
  echo "systemd-boot: FAIL: the guest did not power off within ${vm_timeout}s; see $out/console.log" >&2
  tail -20 "$out/console.log" >&2
  exit 1
fi
if [ ! -f "$out/exit-code" ]; then
  echo "systemd-boot: FAIL: no result from the guest (qemu rc $qrc); see $out/console.log" >&2
  tail -20 "$out/console.log" >&2
  exit 1
fi
rc=$(cat "$out/exit-code")
echo "systemd-boot: build $((tb - t0)) s, VM $tq s (boot to poweroff), total $((SECONDS - t0)) s"
if [ "$rc" = 0 ]; then
  echo "systemd-boot: PASS"
  [ "${KVFENCE_VM_KEEP:-0}" = 1 ] && echo "systemd-boot: results kept in $out" || rm -rf "$out"
  exit 0
fi
[ -s "$out/steps.txt" ] || tail -20 "$out/guest.log" >&2
echo "systemd-boot: FAIL (guest exit $rc); results in $out (guest.log, journal.txt, kvfence-journal.txt)" >&2
exit 1
