# shellcheck shell=sh
# Sourced inside the soft-RoCE guest (by rxe-guest.sh and rxe-bench-guest.sh): creates rxe0
# on a dummy netdev whose TEST-NET-1 address exists only in this network-less guest (rdma_cm
# does not work with rxe on lo) and sets `gid` to the RoCE v2 GID index of that address.
# Exits 1 when any of it fails.
addr=192.0.2.1
if ! { ip link add rxed0 type dummy && ip addr add $addr/24 dev rxed0 && ip link set rxed0 up; }; then
  echo "rxe-up: cannot set up the dummy netdev"
  exit 1
fi
rdma link add rxe0 type rxe netdev rxed0 || { echo "rxe-up: rdma link add failed"; exit 1; }
# the RoCE v2 GID of an IPv4 address is its IPv4-mapped IPv6 address (192.0.2.1 = c000:0201)
want=0000:0000:0000:0000:0000:ffff:c000:0201
gid=
for i in $(seq 0 15); do
  [ "$(cat /sys/class/infiniband/rxe0/ports/1/gids/"$i" 2>/dev/null)" = "$want" ] && { gid=$i; break; }
done
[ -n "$gid" ] || { echo "rxe-up: no GID for $addr"; exit 1; }
echo "rxe-up: rxe0 on rxed0 ($addr), GID index $gid"
