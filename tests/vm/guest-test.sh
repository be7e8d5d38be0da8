#!/bin/bash
# Runs INSIDE the VM guest (systemd is PID 1), started by the runner unit that
# tests/vm/setup.sh puts in the guest rootfs; $1 is the results share, which holds the staged
# repository (src/: scripts, systemd/, the example config, the release binaries) and the test
# config. Every step is bounded by a timeout; its verdict goes to steps.txt, its output to
# guest.log (stdout). Exit status: the number of failed steps (0 = pass).
# shellcheck disable=SC2317  # the step functions are called through step()
set -u
out=$1
src=$out/src
bin=/usr/local/bin
units=(kvctld.socket kvctld.service prefilld@kvfence.service decoded@kvfence.service)
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
: > "$out/steps.txt"
failed=0
declare -A bad=()

now() { cut -d' ' -f1 /proc/uptime; }
# step NAME [needs=STEP,...] -- CMD...: runs CMD, records PASS/FAIL with its duration; a step
# whose prerequisite failed is recorded as SKIP (so one failure does not cascade into timeouts).
step() {
  local name=$1 needs='' s e rc
  shift
  if [ "${1#needs=}" != "$1" ]; then needs=${1#needs=}; shift; fi
  [ "$1" = -- ] && shift
  for n in ${needs//,/ }; do
    if [ -n "${bad[$n]:-}" ]; then
      echo "SKIP $name (needs $n)" | tee -a "$out/steps.txt"
      bad[$name]=1
      return 1
    fi
  done
  echo "=== $name ($(now) s)"
  s=$(now)
  "$@"
  rc=$?
  e=$(now)
  if [ "$rc" = 0 ]; then
    printf 'PASS %s (%.1f s)\n' "$name" "$(echo "$e - $s" | awk '{print $1 - $3}')" | tee -a "$out/steps.txt"
  else
    printf 'FAIL %s (rc %s, %.1f s)\n' "$name" "$rc" "$(echo "$e - $s" | awk '{print $1 - $3}')" | tee -a "$out/steps.txt"
    failed=$((failed + 1))
    bad[$name]=1
  fi
  return "$rc"
}
# wait_for SECONDS CMD...: polls CMD every 0.2 s until it succeeds or the time is up.
wait_for() {
  local end=$(( $(date +%s) + $1 ))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.2
  done
}
is_state() { [ "$(systemctl show -P ActiveState "$1")" = "$2" ]; }
show() { systemctl show -p ActiveState,SubState,Result,ExecMainCode,ExecMainStatus,NRestarts "$@"; }

boot() {
  echo "system state: $(systemctl is-system-running)"   # "starting": this runner is a job
  systemd-analyze time || true
  local failed_units
  failed_units=$(systemctl list-units --failed --plain --no-legend)
  [ -z "$failed_units" ] || { echo "failed units at boot: $failed_units"; return 1; }
}

install_stack() {
  timeout 120 "$src/scripts/install.sh" --no-build || return 1
  id kvfence || return 2
  [ "$(stat -c %U:%G /run/kvfence)" = kvfence:kvfence ] || return 3
  [ -x $bin/kvctld ] && [ -x $bin/kvctl ] && [ -x $bin/prefilld ] && [ -x $bin/decoded ] || return 4
  # daemon-reload happened: systemd knows the units from /etc/systemd/system
  [ "$(systemctl show -P FragmentPath kvctld.service)" = /etc/systemd/system/kvctld.service ] || return 5
  cmp "$src/libkv/kvfence.example.toml" /etc/kvfence/kvfence.toml || return 6
}

config_kept() {
  install -m 644 "$out/kvfence-vm.toml" /etc/kvfence/kvfence.toml
  timeout 120 "$src/scripts/install.sh" --no-build || return 1
  cmp "$out/kvfence-vm.toml" /etc/kvfence/kvfence.toml || { echo "install.sh replaced the config"; return 2; }
}

check_config() {
  local d
  for d in kvctld prefilld decoded; do
    timeout 20 runuser -u kvfence -- $bin/$d --config /etc/kvfence/kvfence.toml --check-config \
      || { echo "$d --check-config failed"; return 1; }
  done
}

enable_units() {
  timeout 60 systemctl enable kvfence.target kvctld.socket prefilld@kvfence.service decoded@kvfence.service \
    || return 1
  [ -L /etc/systemd/system/kvfence.target.wants/prefilld@kvfence.service ] || return 2
}

socket_listening() {
  timeout 30 systemctl start kvctld.socket || return 1
  is_state kvctld.socket active || return 2
  is_state kvctld.service inactive || { echo "kvctld started before any client"; return 3; }
  [ -S /run/kvfence/kvctld.sock ] || return 4
  local perm
  perm=$(stat -c '%U:%G %a' /run/kvfence/kvctld.sock)
  [ "$perm" = "kvfence:kvfence 660" ] || { echo "socket is $perm"; return 5; }
}

# A client connects while kvctld is not running: systemd queues the connection, starts
# kvctld.service with the listening socket as fd 3, and the client gets its answer.
socket_activation() {
  local inode pid rc
  inode=$(stat -c %i /run/kvfence/kvctld.sock)
  is_state kvctld.service inactive || return 1
  timeout 30 $bin/kvctl status > "$out/status-activation.txt" 2>&1 &
  pid=$!
  wait_for 30 is_state kvctld.service active || { echo "systemd did not start kvctld"; show kvctld.service; return 2; }
  wait "$pid"
  rc=$?
  cat "$out/status-activation.txt"
  [ "$rc" = 0 ] || { echo "kvctl status (connected before kvctld ran) exited $rc"; return 3; }
  # kvctld served the socket systemd passed instead of binding a new one
  [ "$(stat -c %i /run/kvfence/kvctld.sock)" = "$inode" ] || { echo "kvctld replaced the socket"; return 4; }
}

start_workers() {
  # Type=notify: start returns once each worker reported READY=1 (pool allocated, registered)
  timeout 150 systemctl start kvfence.target || { show prefilld@kvfence.service decoded@kvfence.service; return 1; }
  local u
  for u in "${units[@]}"; do
    is_state "$u" active || { echo "$u not active"; show "$u"; return 2; }
  done
}

generate() {
  timeout 60 $bin/kvctl generate --tenant t "hello" > "$out/generate.txt" 2>&1
  local rc=$?
  cat "$out/generate.txt"
  [ "$rc" = 0 ] || return "$rc"
  [ -s "$out/generate.txt" ] || { echo "no output"; return 10; }
  timeout 30 $bin/kvctl status > "$out/status-running.txt" 2>&1
  cat "$out/status-running.txt"
}

# SIGTERM through systemd: every daemon drains and exits 0 on its own, within TimeoutStopSec.
graceful_stop() {
  local pid u rc=0
  # a request in flight while the stack stops: it completes, or is told the stack is stopping
  timeout 60 $bin/kvctl generate --tenant t --max-new 200 "in flight during the stop" \
    > "$out/generate-during-stop.txt" 2>&1 &
  pid=$!
  sleep 0.2
  timeout 90 systemctl stop kvfence.target || rc=1
  wait "$pid"
  echo "request in flight during the stop: kvctl exited $? (0 done, 4 stopping)"
  for u in "${units[@]}"; do
    show "$u"
    is_state "$u" inactive || { echo "$u is $(systemctl show -P ActiveState "$u")"; rc=2; }
    [ "$(systemctl show -P Result "$u")" = success ] || rc=3
    case $u in
      *.service)
        # exited (code 1 = CLD_EXITED) with status 0: it handled SIGTERM, not killed by it
        [ "$(systemctl show -P ExecMainCode "$u")" = 1 ] && [ "$(systemctl show -P ExecMainStatus "$u")" = 0 ] \
          || { echo "$u did not exit 0 after SIGTERM"; rc=4; }
        ;;
    esac
  done
  return "$rc"
}

uninstall_stack() {
  timeout 120 "$src/scripts/uninstall.sh" || return 1
  [ ! -e $bin/kvctld ] && [ ! -e /etc/systemd/system/kvctld.service ] || return 2
  [ -z "$(systemctl list-unit-files --no-legend 'kvctld*' kvfence.target 'prefilld@*' 'decoded@*')" ] || return 3
  [ -f /etc/kvfence/kvfence.toml ] || { echo "uninstall removed the config without --purge"; return 4; }
}

step boot -- boot
step install -- install_stack
step install-keeps-config needs=install -- config_kept
step check-config needs=install-keeps-config -- check_config
step enable needs=install -- enable_units
step socket-listening needs=enable -- socket_listening
step socket-activation needs=socket-listening -- socket_activation
step start-workers needs=socket-listening -- start_workers
step generate needs=start-workers -- generate
step graceful-stop needs=socket-listening -- graceful_stop

journalctl -b --no-pager -o short-monotonic > "$out/journal.txt" 2>&1
journalctl -b --no-pager -o short-monotonic -u 'kvctld*' -u 'prefilld@*' -u 'decoded@*' \
  > "$out/kvfence-journal.txt" 2>&1
echo "=== kvfence journal"
cat "$out/kvfence-journal.txt"

step uninstall needs=install -- uninstall_stack
echo "guest: $failed failed step(s) at $(now) s"
exit "$failed"
