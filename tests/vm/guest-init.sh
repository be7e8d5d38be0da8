#!/bin/sh
# /init of the VM test's initramfs (busybox ash). Loads the virtio/9p/overlay modules, mounts
# the guest rootfs (shared read-only by the host over virtio-9p) under a RAM overlay so the
# guest can write without touching the host's cached copy, mounts the read-write results share
# at the path the host gave (kvfence_out=), and hands PID 1 over to systemd with switch_root.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod "/lib/modules/$m" || echo "init: insmod $m failed"; done
arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline; }
OUT=$(arg kvfence_out)
INIT=$(arg kvfence_init)
R=/mnt/root
fail() { echo "init: $*"; echo "KVFENCE_VM_EXIT=125"; poweroff -f; }
mkdir -p /mnt/lower /mnt/rw $R
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose rootfs /mnt/lower \
  || fail "9p rootfs mount failed"
mount -t tmpfs -o mode=755 tmpfs /mnt/rw && mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay $R \
  || fail "overlay mount failed"
if [ -n "$OUT" ]; then
  mkdir -p "$R$OUT"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "$R$OUT" || fail "results share mount failed"
fi
echo "init: switch_root to ${INIT:-/lib/systemd/systemd} at $(cut -d' ' -f1 /proc/uptime)s"
umount /proc /sys
mount --move /dev $R/dev
exec switch_root $R "${INIT:-/lib/systemd/systemd}"
