#!/usr/bin/env bash
# Installs kvfence on a host: the daemons and the client, the systemd units, the service
# account, the runtime directories and a configuration that starts on this host. Enables and
# starts nothing.
#
# Usage: scripts/install.sh [--prefix DIR] [--destdir DIR] [--no-build] [--example-config]
#   --prefix DIR   binaries go to DIR/bin, docs to DIR/share/doc/kvfence (default /usr/local)
#   --destdir DIR  stage everything under DIR instead of / (packaging); runs no systemd tool
#   --no-build     install target/release/* as built ($CARGO_TARGET_DIR is honoured) instead of
#                  running `cargo build --release` first
#   --example-config
#                  install the commented example (GPU pools, backend = "cuda") unchanged instead
#                  of the host configuration; it does not start until edited (see below)
#
# What goes where (DESTDIR prefixes each path):
#   PREFIX/bin/{kvctld,kvctl,prefilld,decoded,openaid}
#   /etc/systemd/system/{kvctld.socket,kvctld.service,kvfence.target,prefilld@.service,decoded@.service,
#     openaid.service} (openaid is installed, not enabled)
#     (ExecStart= rewritten to PREFIX/bin when PREFIX is not /usr/local)
#   /etc/kvfence/kvfence.toml          the commented example made to start on this host: host
#                                      pools (backend = "host") sized to 1/16 of its memory each,
#                                      at most 4 GiB, with max_context and max_new_tokens to fit;
#                                      an existing file is never replaced. Either way the file is
#                                      then checked with `kvctld --check-config`, which says what
#                                      to edit if it would not start.
#   /etc/kvfence/{prefill-0,decode-0}.toml
#                                      symlinks to kvfence.toml, the configs of the default
#                                      worker pair prefilld@prefill-0 and decoded@decode-0;
#                                      an existing file or link is never replaced
#   /usr/lib/sysusers.d/kvfence.conf   user and group kvfence
#   /usr/lib/tmpfiles.d/kvfence.conf   /run/kvfence, /var/lib/kvfence
#   PREFIX/share/doc/kvfence/systemd/README.md
# Then, without --destdir and when systemd is PID 1: systemd-sysusers, systemd-tmpfiles
# --create and systemctl daemon-reload. scripts/uninstall.sh (same options) undoes it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
prefix=/usr/local
destdir=
build=1
example=0
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
    --destdir=*) destdir=${1#*=}; shift ;;
    --no-build) build=0; shift ;;
    --example-config) example=1; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "install: unknown argument $1 (see --help)" >&2; exit 1 ;;
  esac
done
case $prefix in /*) ;; *) echo "install: --prefix must be absolute, got $prefix" >&2; exit 1 ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || prefix=/usr
if [ -n "$destdir" ]; then
  mkdir -p "$destdir"
  destdir=$(cd "$destdir" && pwd)
elif [ "$(id -u)" != 0 ]; then
  echo "install: installing into / needs root (or use --destdir DIR)" >&2
  exit 1
fi

bins=(kvctld kvctl prefilld decoded openaid)
units=(kvctld.socket kvctld.service kvfence.target prefilld@.service decoded@.service
  openaid.service)
target=${CARGO_TARGET_DIR:-$root/target}
if [ "$build" = 1 ]; then
  echo "install: cargo build --release"
  (cd "$root" && cargo build --release --locked -p kvctld -p prefilld -p decoded -p openaid --bins)
fi
for b in "${bins[@]}"; do
  [ -x "$target/release/$b" ] || {
    echo "install: $target/release/$b is missing (build it, or drop --no-build)" >&2
    exit 1
  }
done

d=$destdir
install -d -m 755 "$d$prefix/bin" "$d/etc/systemd/system" "$d/usr/lib/sysusers.d" \
  "$d/usr/lib/tmpfiles.d" "$d$prefix/share/doc/kvfence/systemd"
for b in "${bins[@]}"; do
  install -m 755 "$target/release/$b" "$d$prefix/bin/$b"
done
for u in "${units[@]}"; do
  sed "s|/usr/local/|$prefix/|g" "$root/systemd/$u" > "$d/etc/systemd/system/$u.tmp"
  chmod 644 "$d/etc/systemd/system/$u.tmp"
  mv "$d/etc/systemd/system/$u.tmp" "$d/etc/systemd/system/$u"
done
install -m 644 "$root/systemd/kvfence.sysusers" "$d/usr/lib/sysusers.d/kvfence.conf"
install -m 644 "$root/systemd/kvfence.tmpfiles" "$d/usr/lib/tmpfiles.d/kvfence.conf"
install -m 644 "$root/systemd/README.md" "$d$prefix/share/doc/kvfence/systemd/README.md"
# The example sized for this host: host pools of 1/16 of the memory each (at most 4 GiB),
# max_new_tokens at most one page per 16 pool pages (and 8192), max_context what two
# requests of the largest size leave (and at most the example's). Prints the config on stdout.
host_config() {
  local example=$1 mem_kib cg page_bytes pool_bytes pages tokens max_new max_context tpp
  mem_kib=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)
  cg=$(awk -F'::' '/^0::/ { print $2 }' /proc/self/cgroup 2>/dev/null || true)
  if [ -n "$cg" ] && [ -r "/sys/fs/cgroup$cg/memory.max" ]; then
    limit=$(cat "/sys/fs/cgroup$cg/memory.max")
    if [ "$limit" != max ] && [ $((limit / 1024)) -lt "$mem_kib" ]; then mem_kib=$((limit / 1024)); fi
  fi
  # bytes_per_page = tokens_per_page * layers * 2 * kv_heads * head_dim * dtype size (bf16)
  geometry() { awk -v k="$1" '$1 == k { print $3; exit }' "$example"; }
  tpp=$(geometry tokens_per_page)
  page_bytes=$((tpp * $(geometry layers) * 2 * $(geometry kv_heads) * $(geometry head_dim) * 2))
  pool_bytes=$((mem_kib * 1024 / 16))
  [ "$pool_bytes" -le $((4 << 30)) ] || pool_bytes=$((4 << 30))
  pages=$((pool_bytes / page_bytes))
  tokens=$((pages * tpp))
  max_new=$((pages < 8192 ? pages : 8192))
  max_context=$(((tokens / 2 - max_new) / tpp * tpp))
  [ "$max_context" -le 131072 ] || max_context=131072
  if [ "$max_context" -lt "$tpp" ]; then
    echo "install: this host's memory ($((mem_kib / 1024)) MiB) is too small for pools of the" \
      "example's model (pages of $page_bytes bytes); install with --example-config and set" \
      "[geometry], [limits] and pool_pages in /etc/kvfence/kvfence.toml by hand" >&2
    return 1
  fi
  cat <<EOT
# Installed by scripts/install.sh for this host ($((mem_kib / 1024)) MiB of memory): the
# commented example below, with the pools in host memory (backend = "host"), $pages pages
# ($((pages * page_bytes >> 20)) MiB) each, max_context = $max_context and
# max_new_tokens = $max_new so that two of the largest requests fit. Numbers in the comments
# are the example's (a GPU host with 40 and 48 GiB pools). backend = "cuda" (with cuda_device
# in each worker's file) needs the NVIDIA driver and NVRTC, and a model that runs on the GPU;
# the models built in run on the CPU. Check with: kvctld --check-config /etc/kvfence/kvfence.toml
#
EOT
  sed -E \
    -e "s/^max_context = [0-9]+/max_context = $max_context/" \
    -e "s/^max_new_tokens = [0-9]+/max_new_tokens = $max_new/" \
    -e "s/^pool_pages = [0-9]+/pool_pages = $pages/" \
    -e 's/^backend = "cuda"/backend = "host"/' \
    "$example"
}

install -d -m 755 "$d/etc/kvfence"
if [ -e "$d/etc/kvfence/kvfence.toml" ]; then
  echo "install: keeping the existing /etc/kvfence/kvfence.toml"
elif [ "$example" = 1 ]; then
  install -m 644 "$root/libkv/kvfence.example.toml" "$d/etc/kvfence/kvfence.toml"
  echo "install: wrote /etc/kvfence/kvfence.toml from the example (GPU pools): edit it for this host"
else
  host_config "$root/libkv/kvfence.example.toml" > "$d/etc/kvfence/kvfence.toml.tmp"
  chmod 644 "$d/etc/kvfence/kvfence.toml.tmp"
  mv "$d/etc/kvfence/kvfence.toml.tmp" "$d/etc/kvfence/kvfence.toml"
  echo "install: wrote /etc/kvfence/kvfence.toml for this host: $(grep -m1 '^pool_pages' "$d/etc/kvfence/kvfence.toml") per worker, host memory"
fi
# Each worker instance NAME reads /etc/kvfence/NAME.toml. The default pair shares kvctld's
# file through symlinks; give a worker a file of its own to set its pool (see
# systemd/README.md, "Instances").
for w in prefill-0 decode-0; do
  if [ -e "$d/etc/kvfence/$w.toml" ] || [ -L "$d/etc/kvfence/$w.toml" ]; then
    echo "install: keeping the existing /etc/kvfence/$w.toml"
  else
    ln -s kvfence.toml "$d/etc/kvfence/$w.toml"
    echo "install: /etc/kvfence/$w.toml -> kvfence.toml (the config of worker $w)"
  fi
done
echo "install: binaries in $d$prefix/bin, units in $d/etc/systemd/system"
# What start would refuse, said now: the daemons read this file (the default pair through
# its links).
config_ok=1
if ! check=$("$d$prefix/bin/kvctld" --check-config "$d/etc/kvfence/kvfence.toml" 2>&1); then
  config_ok=0
  echo "install: /etc/kvfence/kvfence.toml would not start; do not enable the units before editing it:" >&2
  printf '%s\n' "$check" | sed 's/^/install:   /' >&2
else
  echo "install: kvctld --check-config: /etc/kvfence/kvfence.toml would start on this host"
fi

if [ -n "$destdir" ]; then
  echo "install: staged under $destdir; on the target run: systemd-sysusers; systemd-tmpfiles --create; systemctl daemon-reload"
  exit 0
fi
if [ -d /run/systemd/system ]; then
  systemd-sysusers /usr/lib/sysusers.d/kvfence.conf
  systemd-tmpfiles --create /usr/lib/tmpfiles.d/kvfence.conf
  systemctl daemon-reload
  echo "install: user kvfence, /run/kvfence and /var/lib/kvfence created; systemd reloaded"
else
  echo "install: systemd is not PID 1 here: run systemd-sysusers, systemd-tmpfiles --create and" \
    "systemctl daemon-reload once it is"
fi
if [ "$config_ok" = 0 ]; then
  cat <<EOT
install: next steps
  edit /etc/kvfence/kvfence.toml as said above, then
  $prefix/bin/kvctld --config /etc/kvfence/kvfence.toml --check-config
  and only once it says "configuration is valid":
  systemctl enable --now kvfence.target kvctld.socket prefilld@prefill-0.service decoded@decode-0.service
EOT
  exit 0
fi
cat <<EOT
install: next steps
  $prefix/bin/kvctld --config /etc/kvfence/kvfence.toml --check-config
  systemctl enable --now kvfence.target kvctld.socket prefilld@prefill-0.service decoded@decode-0.service
  $prefix/bin/kvctl status
  (one worker per GPU: /etc/kvfence/NAME.toml and prefilld@NAME or decoded@NAME each; see
  $prefix/share/doc/kvfence/systemd/README.md)
EOT
