#!/usr/bin/env bash
# One-time, cached preparation for the systemd VM test (tests/vm/systemd-boot.sh):
#   - host packages (qemu-system-x86 busybox-static cpio kmod xz-utils zstd debootstrap),
#     installed only when missing and only when running as root;
#   - the stock Debian kernel (downloaded and unpacked, never installed on the host), its
#     uncompressed ELF vmlinux (qemu boots it through the PVH entry: no in-guest decompression);
#   - a busybox initramfs that mounts the rootfs over virtio-9p and hands over to systemd;
#   - a minimal Debian rootfs (debootstrap) with systemd, plus a runner unit that executes the
#     test script the host passes on the kernel command line and powers the guest off.
#
# Everything lands in $KVFENCE_VM_CACHE (default ~/.cache/kvfence-vm). Each piece is rebuilt
# only when missing or when its recipe changed (a stamp holds the recipe's hash), so a warm run
# takes about a second. The debootstrap step (~2 min, network) is the slow one.
#
# With --rxe it prepares the soft-RoCE guest of tests/vm/rxe.sh instead: the same kernel, a
# second initramfs (tests/vm/rxe-init.sh as /init, rdma_rxe and its dependencies, the dummy
# netdev) that runs a script in a chroot of the host root, the host's rxe provider library
# (ibverbs-providers) and perftest (for tests/vm/rxe-bench.sh); no rootfs.
#
# Usage: tests/vm/setup.sh [--rebuild-rootfs] [--rebuild-all] [--rxe]
# Env:   KVFENCE_VM_CACHE   cache directory
#        KVFENCE_VM_MIRROR  Debian mirror for debootstrap (default: the one apt is configured
#                           with, read from `apt-get indextargets`)
#        KVFENCE_VM_SUITE   Debian suite of the rootfs (default: the host's codename)
# Exit: 0 ready, 1 failed, 77 cannot run here (missing tools and not root, no apt, ...).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVFENCE_VM_CACHE:-$HOME/.cache/kvfence-vm}
rebuild_rootfs=0
rebuild_all=0
rxe=0
for a in "$@"; do
  case $a in
    --rebuild-rootfs) rebuild_rootfs=1 ;;
    --rebuild-all) rebuild_all=1; rebuild_rootfs=1 ;;
    --rxe) rxe=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "setup: unknown argument $a" >&2; exit 1 ;;
  esac
done
skip() { echo "setup: SKIP: $*" >&2; exit 77; }
log() { echo "setup: $*"; }
t0=$SECONDS

[ "$(uname -m)" = x86_64 ] || skip "the VM test boots an amd64 kernel; this host is $(uname -m)"
command -v apt-get >/dev/null || skip "needs a Debian-like host (apt-get) to fetch the kernel and build the rootfs"

# --- host packages -----------------------------------------------------------------------------
need=()
if [ "$rxe" = 1 ]; then
  tools="iproute2:rdma"
else
  tools="debootstrap:debootstrap"
fi
for p in qemu-system-x86:qemu-system-x86_64 cpio:cpio kmod:depmod xz-utils:xz zstd:zstd $tools; do
  command -v "${p#*:}" >/dev/null || need+=("${p%%:*}")
done
# the guest runs host binaries on the host's libraries: libibverbs and its rxe provider, and
# perftest (ib_read_bw, ib_write_bw) for tests/vm/rxe-bench.sh
if [ "$rxe" = 1 ]; then
  for p in libibverbs1 ibverbs-providers perftest; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
  done
fi
# a dynamically linked busybox cannot run inside the initramfs: the static one is required
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || skip "missing host packages (${need[*]}); run as root or install them"
  log "installing ${need[*]}"
  timeout 900 apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends "${need[@]}" >/dev/null \
    || { timeout 600 apt-get update -q >/dev/null && \
         timeout 900 apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends "${need[@]}" >/dev/null; }
fi
# debootstrap, chroot and the 9p export of a root-owned tree need root
[ "$(id -u)" = 0 ] || skip "building the guest rootfs needs root (debootstrap, 9p export of /)"

mkdir -p "$cache"
[ "$rebuild_all" = 1 ] && rm -rf "$cache/kernel" "$cache/initramfs.cpio.gz" "$cache/initramfs.stamp" \
  "$cache/initramfs-rxe.cpio.gz" "$cache/initramfs-rxe.stamp"

# --- kernel ------------------------------------------------------------------------------------
K=$cache/kernel
# the initramfs this run prepares: name, /init script, modules (deps resolved below)
if [ "$rxe" = 1 ]; then
  iname=initramfs-rxe
  init_script=$here/rxe-init.sh
  # crc32 shash for rxe's ICRC, preloaded so that no request_module happens in the chroot;
  # dummy for the netdev rxe sits on; veth and sch_netem for the network fault campaign
  # (tests/tests/netfaults.rs), which needs netem the host kernel may not have
  mods="virtio_pci 9pnet_virtio 9p overlay dummy crc32_generic crc32_pclmul rdma_rxe veth sch_netem"
else
  iname=initramfs
  init_script=$here/guest-init.sh
  mods="virtio_pci 9pnet_virtio 9p overlay"
fi
istamp() { (cat "$init_script"; echo "$mods $(cat "$K/KV" 2>/dev/null)") | sha256sum | cut -c1-16; }
initramfs_stale() {
  [ "$(cat "$cache/$iname.stamp" 2>/dev/null)" != "$(istamp)" ] || [ ! -f "$cache/$iname.cpio.gz" ]
}
# (the modules are pruned once the initramfs is built: an initramfs rebuild refetches them)
if [ ! -f "$K/KV" ] || [ ! -f "$K/vmlinux" ] || { initramfs_stale && [ ! -d "$K/lib/modules" ]; }; then
  # the package linux-image-amd64 points to: the standard flavour of the stock kernel
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  if [ -z "$kpkg" ]; then
    timeout 600 apt-get update -q >/dev/null
    kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  fi
  [ -n "$kpkg" ] || { echo "setup: cannot resolve linux-image-amd64 (apt-get update?)" >&2; exit 1; }
  log "fetching $kpkg (not installed on the host)"
  rm -rf "$cache/debs" "$K"; mkdir -p "$cache/debs" "$K"
  (cd "$cache/debs" && timeout 600 apt-get download -q -o APT::Sandbox::User=root "$kpkg" >/dev/null) \
    || skip "cannot download $kpkg (no network or apt source reachable, and nothing cached)"
  dpkg-deb -x "$cache/debs/${kpkg}"_*.deb "$K"
  kv=$(ls "$K/lib/modules")
  cp "$K/boot/vmlinuz-$kv" "$K/vmlinuz"
  depmod -b "$K" "$kv"             # the .deb ships no modules.dep (its postinst makes it)
  # vmlinux: the ELF payload of the bzImage (xz on 6.1, zstd on later kernels)
  extract() { # magic-regex decompressor...
    local off; off=$(LC_ALL=C grep -aboP "$1" "$K/vmlinuz" | head -1 | cut -d: -f1) || true
    [ -n "$off" ] || return 1; shift
    tail -c +$((off + 1)) "$K/vmlinuz" | "$@" > "$K/vmlinux" 2>/dev/null || true
    [ "$(head -c4 "$K/vmlinux" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]
  }
  extract '\xFD\x37\x7A\x58\x5A\x00' xz -dc --single-stream || extract '\x28\xB5\x2F\xFD' zstd -dc \
    || { echo "setup: no xz or zstd ELF payload in $K/vmlinuz" >&2; exit 1; }
  rm -rf "${K:?}/boot" "${K:?}/usr/share" "$cache/debs"
  echo "$kv" > "$K/KV"
  log "kernel $kv ready"
fi
kv=$(cat "$K/KV")

# --- initramfs ---------------------------------------------------------------------------------
if initramfs_stale; then
  w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
  mkdir -p "$w"/{bin,proc,sys,dev,mnt,lib/modules}
  cp "$(command -v busybox)" "$w/bin/busybox"
  for a in $("$w/bin/busybox" --list); do [ -e "$w/bin/$a" ] || ln -s busybox "$w/bin/$a"; done
  : > "$w/modules.list"
  for m in $mods; do
    modprobe -d "$K" -S "$kv" --show-depends "$m" | awk '$1=="insmod"{print $2}' | while read -r p; do
      b=$(basename "$p"); b=${b%.xz}; b=${b%.zst}     # busybox insmod wants them uncompressed
      grep -qx "$b" "$w/modules.list" && continue
      case $p in *.xz) xz -dc "$p" ;; *.zst) zstd -qdc "$p" ;; *) cat "$p" ;; esac > "$w/lib/modules/$b"
      echo "$b" >> "$w/modules.list"
    done
  done
  install -m 755 "$init_script" "$w/init"
  (cd "$w" && find . | cpio -o -H newc --quiet | gzip -1) > "$cache/$iname.cpio.gz.new"
  mv "$cache/$iname.cpio.gz.new" "$cache/$iname.cpio.gz"
  istamp > "$cache/$iname.stamp"
  rm -rf "$w"; trap - EXIT
  rm -rf "${K:?}/lib" "${K:?}/vmlinuz"    # 400+ MB of modules the guest does not need
  log "$iname ready ($(du -h "$cache/$iname.cpio.gz" | cut -f1))"
fi
if [ "$rxe" = 1 ]; then
  log "ready in $((SECONDS - t0)) s: $cache (soft-RoCE guest)"
  exit 0
fi

# --- rootfs ------------------------------------------------------------------------------------
. /etc/os-release
suite=${KVFENCE_VM_SUITE:-${VERSION_CODENAME:-bookworm}}
pkgs=systemd,systemd-sysv,udev,dbus
R=$cache/rootfs
bstamp=$(echo "$suite $pkgs" | sha256sum | cut -c1-16)
if [ "$rebuild_rootfs" = 1 ] || [ "$(cat "$cache/rootfs.stamp" 2>/dev/null)" != "$bstamp" ] \
   || [ ! -x "$R/lib/systemd/systemd" ]; then
  mirror=${KVFENCE_VM_MIRROR:-}
  if [ -z "$mirror" ]; then
    # the mirror apt itself uses for this suite (no host name is written down anywhere)
    mirror=$(apt-get indextargets --format '$(REPO_URI) $(CODENAME) $(TARGET_OF)' 2>/dev/null \
             | awk -v c="$suite" '$2 == c && $3 == "deb" { print $1; exit }')
  fi
  [ -n "$mirror" ] || skip "no apt source for suite $suite (apt-get update, or set KVFENCE_VM_MIRROR)"
  log "debootstrap $suite ($pkgs), about 2 minutes"
  rm -rf "$R" "$cache/rootfs.stamp"
  timeout 1200 debootstrap --variant=minbase --include="$pkgs" "$suite" "$R" "$mirror" \
    > "$cache/debootstrap.log" 2>&1 \
    || { echo "setup: debootstrap failed, see $cache/debootstrap.log" >&2; tail -5 "$cache/debootstrap.log" >&2; exit 1; }
  rm -rf "$R/var/cache/apt/archives/"*.deb "$R/var/lib/apt/lists/"*
  echo "$bstamp" > "$cache/rootfs.stamp"
fi

# Guest customisation: cheap and idempotent, so it is re-applied on every run.
echo kvfence-vm > "$R/etc/hostname"
passwd -R "$R" -d root >/dev/null          # empty root password: console debugging only
# Units a throw-away test guest does not need: under TCG every exec costs, so a lean boot is
# several times faster. No udev, dbus or logind (systemctl talks to PID 1 over its private
# socket), no module loading (the guest has no modules beyond the initramfs's), and no
# generators (they run again at every daemon-reload).
for u in systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer \
         fstrim.timer e2scrub_reap.service serial-getty@ttyS0.service getty@tty1.service \
         systemd-networkd-wait-online.service systemd-udevd.service systemd-udev-trigger.service \
         systemd-udev-settle.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
         dbus.service dbus.socket systemd-logind.service systemd-hwdb-update.service \
         ldconfig.service systemd-journal-catalog-update.service systemd-random-seed.service \
         systemd-pstore.service modprobe@configfs.service modprobe@dm_mod.service \
         modprobe@drm.service modprobe@efi_pstore.service modprobe@fuse.service \
         modprobe@loop.service sys-kernel-debug.mount sys-kernel-tracing.mount \
         sys-kernel-config.mount sys-fs-fuse-connections.mount; do
  ln -sfn /dev/null "$R/etc/systemd/system/$u"
done
mkdir -p "$R/etc/systemd/system-generators"
for g in "$R"/lib/systemd/system-generators/*; do
  ln -sfn /dev/null "$R/etc/systemd/system-generators/$(basename "$g")"
done
# The runner: one oneshot unit that runs the script named on the kernel command line
# (kvfence_script=), writes its exit status to the results share (kvfence_out=, mounted by the
# initramfs) and powers the guest off, pass or fail.
install -D -m 755 /dev/stdin "$R/usr/local/sbin/kvfence-vm-runner" <<'EOT'
#!/bin/sh
arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline; }
out=$(arg kvfence_out); script=$(arg kvfence_script); tmo=$(arg kvfence_timeout)
rc=125
if [ -n "$out" ] && [ -f "$script" ]; then
  timeout --kill-after=5 "${tmo:-240}" "$script" "$out" > "$out/guest.log" 2>&1
  rc=$?
fi
echo "$rc" > "$out/exit-code"
sync
echo "KVFENCE_VM_EXIT=$rc" > /dev/console
exit 0
EOT
cat > "$R/etc/systemd/system/kvfence-vm-runner.service" <<'EOT'
[Unit]
Description=kvfence VM test runner (runs once, then powers the guest off)
After=multi-user.target
# pass or fail, the guest powers off when the runner is done ([Unit] keys, not [Service])
SuccessAction=poweroff-immediate
FailureAction=poweroff-immediate

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/kvfence-vm-runner
# the runner bounds the script itself (kvfence_timeout=), the host bounds the VM
TimeoutStartSec=infinity
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
EOT
mkdir -p "$R/etc/systemd/system/multi-user.target.wants"
ln -sfn ../kvfence-vm-runner.service "$R/etc/systemd/system/multi-user.target.wants/kvfence-vm-runner.service"
log "ready in $((SECONDS - t0)) s: $cache (rootfs $(du -sh "$R" | cut -f1))"
