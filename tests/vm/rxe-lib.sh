# shellcheck shell=bash
# shellcheck disable=SC2154  # `here` and `tag` come from the caller
# Shared by tests/vm/rxe.sh and tests/vm/rxe-bench.sh (sourced by bash): the checks and the
# set-up a soft-RoCE guest needs, and the guest boot itself. The caller sets `here` (this
# directory) and `tag` (its name, for messages).
# Env: KVFENCE_VM_CACHE (default ~/.cache/kvfence-vm), KVFENCE_VM_MEM (MiB, 1024),
#      KVFENCE_VM_CPUS (2), KVFENCE_VM_ACCEL (tcg | kvm: only where /dev/kvm is real VMX/SVM).

cache=${KVFENCE_VM_CACHE:-$HOME/.cache/kvfence-vm}
skip() { echo "$tag: SKIP: $*" >&2; exit 77; }

# rxe_prepare SETUP: checks that this host can boot the guest (exit 77 when not) and, when
# SETUP is 1, prepares it with setup.sh --rxe (exit 1 when that fails).
rxe_prepare() {
  local rc
  [ "$(uname -m)" = x86_64 ] || skip "needs an x86_64 host (the guest kernel is amd64)"
  [ "$(id -u)" = 0 ] || skip "needs root (the host root is exported to the guest over 9p)"
  if [ "$1" = 1 ]; then
    timeout 1800 "$here/setup.sh" --rxe
    rc=$?
    [ "$rc" = 77 ] && exit 77
    [ "$rc" = 0 ] || { echo "$tag: FAIL: setup.sh --rxe exited $rc" >&2; exit 1; }
  fi
  command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 missing (run tests/vm/setup.sh --rxe as root)"
  for f in kernel/vmlinux initramfs-rxe.cpio.gz; do
    [ -e "$cache/$f" ] || skip "$cache/$f missing: run tests/vm/setup.sh --rxe"
  done
}

# rxe_boot OUT SCRIPT TIMEOUT: boots the guest, which brings up rxe0 and runs OUT/SCRIPT
# (OUT is shared read-write with the guest) within TIMEOUT seconds of the VM's life; prints
# the guest's output without the boot noise. Sets guest_rc to the script's exit status and
# vm_seconds; returns 1, after a FAIL line, when the guest gave no result.
rxe_boot() {
  local out=$1 script=$2 vm_timeout=$3 qrc tv accel
  guest_rc=
  # shellcheck disable=SC2054  # the commas belong to qemu options
  case "${KVFENCE_VM_ACCEL:-tcg}" in
    kvm) accel=(-machine q35 -accel kvm -cpu host) ;;
    *) accel=(-machine q35 -accel tcg,thread=multi,tb-size=64 -cpu max) ;;
  esac
  cp "$here/rxe-up.sh" "$out/rxe-up.sh"
  chmod -R a+rX "$out"
  echo "$tag: booting the guest (timeout ${vm_timeout}s), results in $out"
  tv=$SECONDS
  timeout --kill-after=10 "$vm_timeout" qemu-system-x86_64 "${accel[@]}" \
    -smp "${KVFENCE_VM_CPUS:-2}" -m "${KVFENCE_VM_MEM:-1024}" \
    -display none -vga none -monitor none -serial stdio -no-reboot -nic none \
    -kernel "$cache/kernel/vmlinux" -initrd "$cache/initramfs-rxe.cpio.gz" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off kvfence_out=$out kvfence_script=$out/$script kvfence_timeout=$((vm_timeout - 30))" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
    < /dev/null > "$out/console.log" 2>&1
  qrc=$?
  # shellcheck disable=SC2034  # read by the caller
  vm_seconds=$((SECONDS - tv))
  # the guest's output (rxe set-up, then the script's) without the boot noise
  sed -n '/^init: ready/,/^KVFENCE_VM_EXIT=/p' "$out/console.log" | tr -d '\r'
  if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    echo "$tag: FAIL: the guest did not power off within ${vm_timeout}s; see $out/console.log" >&2
    tail -20 "$out/console.log" >&2
    return 1
  fi
  if [ ! -f "$out/exit-code" ]; then
    echo "$tag: FAIL: no result from the guest (qemu rc $qrc); see $out/console.log" >&2
    tail -20 "$out/console.log" >&2
    return 1
  fi
  # shellcheck disable=SC2034  # read by the caller
  guest_rc=$(cat "$out/exit-code")
}
