#!/bin/sh
# Runs inside the soft-RoCE guest (tests/vm/rxe.sh): brings up rxe0 (rxe-up.sh), then runs
# the RDMA test binaries against it, the page server on the device's address.
# Usage: rxe-guest.sh OUTDIR (OUTDIR/test-binaries: one line per binary, "PATH [FILTER]")
set -u
out=$1
# shellcheck source=rxe-up.sh
. "$out/rxe-up.sh"
export KVFENCE_RDMA_DEVICE=rxe0 KVFENCE_RDMA_GID_INDEX=$gid KVFENCE_RDMA_ADDR=$addr
# the guest kernel has sch_netem: the network fault campaign must not skip its netem faults
export KVFENCE_NETEM_REQUIRED=1
[ -f "$out/netfault-rounds" ] && KVFENCE_NETFAULT_ROUNDS=$(cat "$out/netfault-rounds") && export KVFENCE_NETFAULT_ROUNDS
[ -f "$out/model-path" ] && KVFENCE_MODEL=$(cat "$out/model-path") && export KVFENCE_MODEL
[ -f "$out/model-prompt-tokens" ] && KVFENCE_MODEL_PROMPT_TOKENS=$(cat "$out/model-prompt-tokens") \
  && export KVFENCE_MODEL_PROMPT_TOKENS
failed=0
while read -r bin filter; do
  echo "rxe-guest: running $(basename "$bin") ${filter:-(all tests)}"
  # shellcheck disable=SC2086  # an empty filter is no argument
  "$bin" --test-threads=1 --nocapture $filter || failed=1
done < "$out/test-binaries"
exit $failed
