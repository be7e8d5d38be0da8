#!/bin/sh
# Runs inside the soft-RoCE guest (tests/vm/rxe.sh): creates rxe0 on a dummy netdev whose
# TEST-NET-1 address exists only in this network-less guest (rdma_cm does not work with rxe
# on lo), finds the RoCE v2 GID of that address, then runs the RDMA test binaries against it.
# Usage: rxe-guest.sh OUTDIR (OUTDIR/test-binaries: one line per binary, "PATH [FILTER]")
set -u
out=$1
addr=192.0.2.1
if ! { ip link add rxed0 type dummy && ip addr add $addr/24 dev rxed0 && ip link set rxed0 up; }; then
  echo "rxe-guest: cannot set up the dummy netdev"
  exit 1
fi
rdma link add rxe0 type rxe netdev rxed0 || { echo "rxe-guest: rdma link add failed"; exit 1; }
# the RoCE v2 GID of an IPv4 address is its IPv4-mapped IPv6 address (192.0.2.1 = c000:0201)
want=0000:0000:0000:0000:0000:ffff:c000:0201
gid=
for i in $(seq 0 15); do
  [ "$(cat /sys/class/infiniband/rxe0/ports/1/gids/"$i" 2>/dev/null)" = "$want" ] && { gid=$i; break; }
done
[ -n "$gid" ] || { echo "rxe-guest: no GID for $addr"; exit 1; }
echo "rxe-guest: rxe0 on rxed0 ($addr), GID index $gid"
export KVFENCE_RDMA_DEVICE=rxe0 KVFENCE_RDMA_GID_INDEX=$gid KVFENCE_RDMA_ADDR=$addr
failed=0
while read -r bin filter; do
  echo "rxe-guest: running $(basename "$bin") ${filter:-(all tests)}"
  # shellcheck disable=SC2086  # an empty filter is no argument
  "$bin" --test-threads=1 --nocapture $filter || failed=1
done < "$out/test-binaries"
exit $failed
