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
# Two workers of each role under one kvctld, each instance reading /etc/kvfence/<id>.toml;
# the pool pages each one's own file gives it (tests/vm/systemd-boot.sh writes the files).
workers=(prefill-0 prefill-1 decode-0 decode-1)
declare -A pool=([prefill-0]=120 [prefill-1]=96 [decode-0]=124 [decode-1]=112)
unit_of() { case $1 in prefill-*) echo "prefilld@$1.service" ;; *) echo "decoded@$1.service" ;; esac; }
worker_units=()
for w in "${workers[@]}"; do worker_units+=("$(unit_of "$w")"); done
units=(kvctld.socket kvctld.service "${worker_units[@]}")
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
# Writes one line per worker of `kvctl --json status` to workers.txt (each worker's own
# counters left out, so that their names cannot shadow a field).
status_workers() {
  timeout 30 $bin/kvctl --json status > "$out/status.json" || return 1
  sed -n 's/.*"workers":\[\(.*\)\].*/\1/p' "$out/status.json" | sed 's/"counters":{[^}]*},\{0,1\}//g' \
    | awk '{
        d = 0; cur = ""
        for (i = 1; i <= length($0); i++) {
          c = substr($0, i, 1)
          if (c == "{") d++
          if (c == "}") d--
          if (d == 0 && c == ",") { print cur; cur = "" } else cur = cur c
        }
        if (cur != "") print cur
      }' > "$out/workers.txt"
}
# field ID KEY: KEY of worker ID in workers.txt (a string without its quotes).
field() {
  grep -F "\"id\":\"$1\"" "$out/workers.txt" | grep -oE "\"$2\":(\"[^\"]*\"|[^,}]*)" | head -1 \
    | cut -d: -f2- | tr -d '"'
}
# Every worker registered under its instance name, connected, with the pool of its own file.
all_registered() {
  status_workers || return 1
  [ "$(wc -l < "$out/workers.txt")" = "${#workers[@]}" ] || return 2
  local w
  for w in "${workers[@]}"; do
    [ "$(field "$w" connected)" = true ] || return 3
    [ "$(field "$w" role)" = "${w%%-*}" ] || return 4
    [ "$(field "$w" pool_pages)" = "${pool[$w]}" ] || return 5
  done
}
# gen NAME ARGS...: kvctl --json generate ARGS into NAME.json (stderr NAME.err), shown.
gen() {
  local name=$1 rc
  shift
  timeout 60 $bin/kvctl --json generate --tenant t "$@" > "$out/$name.json" 2> "$out/$name.err"
  rc=$?
  cat "$out/$name.json" "$out/$name.err"
  [ "$rc" = 0 ] || return "$rc"
  grep -q '"output":"' "$out/$name.json" || { echo "no output"; return 10; }
}
served_by() { # NAME PREFILL DECODE
  grep -qF "\"prefill_worker\":\"$2\"" "$out/$1.json" && grep -qF "\"decode_worker\":\"$3\"" "$out/$1.json" \
    || { echo "$1 not served by $2 and $3"; return 1; }
}
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
  # the config written for this host (tests/install.rs checks what it holds) starts here
  $bin/kvctld --check-config /etc/kvfence/kvfence.toml || return 6
  # the default pair's configs are links to kvctld's file
  [ "$(readlink /etc/kvfence/prefill-0.toml)" = kvfence.toml ] || return 7
  [ "$(readlink /etc/kvfence/decode-0.toml)" = kvfence.toml ] || return 8
}

# The test's own files replace the installed config and the links; a second install keeps
# them all.
config_kept() {
  local w
  install -m 644 "$out/kvfence-vm.toml" /etc/kvfence/kvfence.toml
  for w in "${workers[@]}"; do
    rm -f "/etc/kvfence/$w.toml"
    install -m 644 "$out/$w.toml" "/etc/kvfence/$w.toml"
  done
  timeout 120 "$src/scripts/install.sh" --no-build || return 1
  cmp "$out/kvfence-vm.toml" /etc/kvfence/kvfence.toml || { echo "install.sh replaced the config"; return 2; }
  for w in "${workers[@]}"; do
    [ ! -L "/etc/kvfence/$w.toml" ] && cmp "$out/$w.toml" "/etc/kvfence/$w.toml" \
      || { echo "install.sh replaced /etc/kvfence/$w.toml"; return 3; }
  done
}

check_config() {
  local w d
  timeout 20 runuser -u kvfence -- $bin/kvctld --config /etc/kvfence/kvfence.toml --check-config \
    || { echo "kvctld --check-config failed"; return 1; }
  for w in "${workers[@]}"; do
    case $w in prefill-*) d=prefilld ;; *) d=decoded ;; esac
    timeout 20 runuser -u kvfence -- $bin/$d --id "$w" --config "/etc/kvfence/$w.toml" --check-config \
      || { echo "$d --id $w --check-config failed"; return 2; }
  done
}

enable_units() {
  timeout 60 systemctl enable kvfence.target kvctld.socket "${worker_units[@]}" || return 1
  local u
  for u in "${worker_units[@]}"; do
    [ -L "/etc/systemd/system/kvfence.target.wants/$u" ] || { echo "$u not wanted by kvfence.target"; return 2; }
  done
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
  timeout 200 systemctl start kvfence.target || { show "${worker_units[@]}"; return 1; }
  local u
  for u in "${units[@]}"; do
    is_state "$u" active || { echo "$u not active"; show "$u"; return 2; }
  done
}

# kvctld lists all four workers, connected, under their instance names, each with the pool
# of its own file.
registered() {
  wait_for 30 all_registered
  local rc=$?
  cat "$out/status.json"
  timeout 30 $bin/kvctl status
  [ "$rc" = 0 ] || { echo "not every worker registered with its own config"; cat "$out/workers.txt"; return 1; }
}

generate() {
  local i rc
  timeout 60 $bin/kvctl -v generate --tenant t "hello" > "$out/generate.txt" 2> "$out/generate.err"
  rc=$?
  cat "$out/generate.txt" "$out/generate.err"
  [ "$rc" = 0 ] || return "$rc"
  [ -s "$out/generate.txt" ] || { echo "no output"; return 10; }
  grep -q 'served by prefill worker prefill-[01] and decode worker decode-[01]' "$out/generate.err" \
    || { echo "kvctl -v did not name the serving pair"; return 11; }
  for i in 1 2 3 4; do
    gen "generate-$i" --max-new 8 "request $i" || return 12
  done
  timeout 30 $bin/kvctl status > "$out/status-running.txt" 2>&1
  cat "$out/status-running.txt"
}

# openaid under its hardened unit: it starts (READY=1 once bound), finds kvctld and the
# workers (/health 200), and stops cleanly on SIGTERM.
openai_endpoint() {
  local reply
  timeout 60 systemctl start openaid.service || { show openaid.service; return 1; }
  is_state openaid.service active || { show openaid.service; return 2; }
  # its own user with the kvfence group: a client of kvctld, never a worker
  local pid ids; pid=$(systemctl show -P MainPID openaid.service)
  ids=$(awk '/^Uid:/ { u = $2 } /^Gid:/ { g = $2 } END { print u ":" g }' "/proc/$pid/status")
  [ "$ids" = "$(id -u kvfence-openai):$(getent group kvfence | cut -d: -f3)" ] \
    || { echo "openaid runs as uid:gid $ids"; return 7; }
  reply=$(timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/8000
    printf "GET /health HTTP/1.0\r\nHost: kvfence\r\n\r\n" >&3; cat <&3') || { show openaid.service; return 3; }
  echo "$reply"
  grep -q '"status":"ok"' <<<"$reply" || { echo "openaid is not healthy"; show openaid.service; return 4; }
  timeout 60 systemctl stop openaid.service || return 5
  [ "$(systemctl show -P ExecMainStatus openaid.service)" = 0 ] || { echo "openaid did not exit 0"; show openaid.service; return 6; }
}

# Draining prefill-0 and decode-0 sends every new request to prefill-1 and decode-1.
drain_pair() {
  timeout 60 $bin/kvctl drain prefill-0 --wait --timeout-ms 30000 || return 1
  timeout 60 $bin/kvctl drain decode-0 --wait --timeout-ms 30000 || return 2
  status_workers || return 3
  cat "$out/workers.txt"
  local w
  for w in prefill-0 decode-0; do
    [ "$(field "$w" state)" = "safe to stop" ] || { echo "$w is $(field "$w" state)"; return 4; }
  done
  for w in 1 2 3; do
    gen "elsewhere-$w" --max-new 8 "drained $w" || return 5
    served_by "elsewhere-$w" prefill-1 decode-1 || return 6
  done
}

# A drained worker stops on its own (exit 0), the others keep serving, and it comes back
# under the same id; undrained, the pair takes requests again.
restart_drained() {
  local u=prefilld@prefill-0.service w
  timeout 60 systemctl stop "$u" || return 1
  show "$u"
  [ "$(systemctl show -P Result "$u")" = success ] && [ "$(systemctl show -P ExecMainStatus "$u")" = 0 ] \
    || { echo "$u did not stop cleanly"; return 2; }
  wait_for 30 eval 'status_workers && [ "$(field prefill-0 connected)" != true ]' \
    || { echo "prefill-0 still listed as connected"; return 3; }
  gen stopped --max-new 8 "one prefill worker stopped" || return 4
  served_by stopped prefill-1 decode-1 || return 5
  timeout 120 systemctl start "$u" || { show "$u"; return 6; }
  wait_for 30 all_registered || { echo "prefill-0 did not register again"; cat "$out/workers.txt"; return 7; }
  for w in prefill-0 decode-0; do
    timeout 30 $bin/kvctl undrain "$w" || return 8
  done
  status_workers || return 9
  for w in "${workers[@]}"; do
    [ "$(field "$w" drain)" = false ] || { echo "$w still drained"; return 10; }
  done
  gen again --max-new 8 "all four again" || return 11
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
step registered needs=start-workers -- registered
step generate needs=start-workers -- generate
step openai-endpoint needs=generate -- openai_endpoint
step drain-pair needs=generate -- drain_pair
step restart-drained needs=drain-pair -- restart_drained
step graceful-stop needs=socket-listening -- graceful_stop

journalctl -b --no-pager -o short-monotonic > "$out/journal.txt" 2>&1
journalctl -b --no-pager -o short-monotonic -u 'kvctld*' -u 'prefilld@*' -u 'decoded@*' \
  > "$out/kvfence-journal.txt" 2>&1
echo "=== kvfence journal"
cat "$out/kvfence-journal.txt"

step uninstall needs=install -- uninstall_stack
echo "guest: $failed failed step(s) at $(now) s"
exit "$failed"
