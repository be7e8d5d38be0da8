#!/usr/bin/env bash
# Installs kvfence on a host: the daemons and the client, the systemd units, the service
# account, the runtime directories and an example configuration. Enables and starts nothing.
#
# Usage: scripts/install.sh [--prefix DIR] [--destdir DIR] [--no-build]
#   --prefix DIR   binaries go to DIR/bin, docs to DIR/share/doc/kvfence (default /usr/local)
#   --destdir DIR  stage everything under DIR instead of / (packaging); runs no systemd tool
#   --no-build     install target/release/* as built ($CARGO_TARGET_DIR is honoured) instead of
#                  running `cargo build --release` first
#
# What goes where (DESTDIR prefixes each path):
#   PREFIX/bin/{kvctld,kvctl,prefilld,decoded}
#   /etc/systemd/system/{kvctld.socket,kvctld.service,kvfence.target,prefilld@.service,decoded@.service}
#     (ExecStart= rewritten to PREFIX/bin when PREFIX is not /usr/local)
#   /etc/kvfence/kvfence.toml          the commented example; an existing file is never replaced
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
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
    --destdir=*) destdir=${1#*=}; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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

bins=(kvctld kvctl prefilld decoded)
units=(kvctld.socket kvctld.service kvfence.target prefilld@.service decoded@.service)
target=${CARGO_TARGET_DIR:-$root/target}
if [ "$build" = 1 ]; then
  echo "install: cargo build --release"
  (cd "$root" && cargo build --release --locked -p kvctld -p prefilld -p decoded --bins)
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
install -d -m 755 "$d/etc/kvfence"
if [ -e "$d/etc/kvfence/kvfence.toml" ]; then
  echo "install: keeping the existing /etc/kvfence/kvfence.toml"
else
  install -m 644 "$root/libkv/kvfence.example.toml" "$d/etc/kvfence/kvfence.toml"
  echo "install: wrote /etc/kvfence/kvfence.toml from the example: edit it for this host"
fi
echo "install: binaries in $d$prefix/bin, units in $d/etc/systemd/system"

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
cat <<EOT
install: next steps
  $prefix/bin/kvctld --check-config /etc/kvfence/kvfence.toml
  systemctl enable --now kvfence.target kvctld.socket prefilld@kvfence.service decoded@kvfence.service
  $prefix/bin/kvctl status
EOT
