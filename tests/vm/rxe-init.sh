#!/bin/sh
# /init of the soft-RoCE test's initramfs (busybox ash). Loads virtio/9p/overlay, dummy and
# rdma_rxe (with crc32 preloaded), mounts the host root (shared read-only over virtio-9p) under
# a RAM overlay so that every host path, the test binaries included, is visible unchanged,
# mounts the read-write results share at the path the host gave (kvfence_out=), runs the
# script named by kvfence_script= in a chroot of that root, writes its exit status to
# $OUT/exit-code and powers off. The guest has no network.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod "/lib/modules/$m" || echo "init: insmod $m failed"; done
arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline; }
OUT=$(arg kvfence_out)
SCRIPT=$(arg kvfence_script)
TMO=$(arg kvfence_timeout)
R=/mnt/root
fail() { echo "init: $*"; echo "KVFENCE_VM_EXIT=125"; poweroff -f; }
mkdir -p /mnt/lower /mnt/rw $R
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /mnt/lower \
  || fail "9p host root mount failed"
mount -t tmpfs -o mode=755 tmpfs /mnt/rw && mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay $R \
  || fail "overlay mount failed"
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/run
[ -n "$OUT" ] || fail "no kvfence_out= on the command line"
mkdir -p "$R$OUT"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "$R$OUT" || fail "results share mount failed"
ip link set lo up
echo "init: ready at $(cut -d' ' -f1 /proc/uptime)s, running $SCRIPT"
chroot $R /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root TERM=dumb timeout -k 5 "${TMO:-240}" /bin/sh "$SCRIPT" "$OUT"
rc=$?
echo "$rc" > "$R$OUT/exit-code"
sync
echo "KVFENCE_VM_EXIT=$rc"
poweroff -f
