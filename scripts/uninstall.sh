#!/usr/bin/env bash
# Undoes scripts/install.sh: stops and disables the kvfence units (when systemd is PID 1 and
# no --destdir is given), then removes the binaries, units, sysusers.d and tmpfiles.d
# snippets and the docs. Keeps /etc/kvfence (your configuration), /var/lib/kvfence (state)
# and the kvfence user and group unless --purge is given.
#
# Usage: scripts/uninstall.sh [--prefix DIR] [--destdir DIR] [--purge]
#   --prefix and --destdir must be those given to install.sh (default /usr/local and none).
set -euo pipefail
prefix=/usr/local
destdir=
purge=0
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
    --destdir=*) destdir=${1#*=}; shift ;;
    --purge) purge=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "uninstall: unknown argument $1 (see --help)" >&2; exit 1 ;;
  esac
done
case $prefix in /*) ;; *) echo "uninstall: --prefix must be absolute, got $prefix" >&2; exit 1 ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || prefix=/usr
if [ -z "$destdir" ] && [ "$(id -u)" != 0 ]; then
  echo "uninstall: removing from / needs root (or use --destdir DIR)" >&2
  exit 1
fi
d=$destdir
live=0
[ -z "$destdir" ] && [ -d /run/systemd/system ] && live=1

if [ "$live" = 1 ]; then
  # Workers first (they drain), then kvctld and its socket. Bounded: each unit's own
  # TimeoutStopSec= applies, and the whole stop is cut off after 120 s.
  mapfile -t instances < <(systemctl list-units --all --plain --no-legend 'prefilld@*.service' \
    'decoded@*.service' 2>/dev/null | awk '{print $1}')
  if [ ${#instances[@]} -gt 0 ]; then
    timeout 120 systemctl stop "${instances[@]}" || echo "uninstall: stopping the workers failed" >&2
  fi
  timeout 120 systemctl stop openaid.service kvfence.target kvctld.service kvctld.socket 2>/dev/null \
    || echo "uninstall: stopping kvctld failed" >&2
  # Enabled worker instances are symlinks in kvfence.target.wants; disable them all.
  mapfile -t enabled < <(find /etc/systemd/system \( -name 'prefilld@?*.service' -o -name 'decoded@?*.service' \) \
    -type l -printf '%f\n' 2>/dev/null | sort -u)
  systemctl disable openaid.service kvfence.target kvctld.service kvctld.socket "${enabled[@]}" 2>/dev/null || true
fi

for b in kvctld kvctl prefilld decoded openaid; do rm -f "$d$prefix/bin/$b"; done
for u in kvctld.socket kvctld.service kvfence.target prefilld@.service decoded@.service \
  openaid.service; do
  rm -f "$d/etc/systemd/system/$u"
done
rm -f "$d/usr/lib/sysusers.d/kvfence.conf" "$d/usr/lib/tmpfiles.d/kvfence.conf"
rm -rf "$d$prefix/share/doc/kvfence"
rmdir "$d/etc/systemd/system/kvfence.target.wants" 2>/dev/null || true

if [ "$purge" = 1 ]; then
  rm -rf "$d/etc/kvfence" "$d/var/lib/kvfence" "$d/run/kvfence"
  if [ "$live" = 1 ] && getent passwd kvfence >/dev/null; then
    userdel kvfence 2>/dev/null || echo "uninstall: could not delete user kvfence" >&2
    if getent passwd kvfence-openai >/dev/null; then
      userdel kvfence-openai 2>/dev/null || echo "uninstall: could not delete user kvfence-openai" >&2
    fi
    getent group kvfence >/dev/null && { groupdel kvfence 2>/dev/null || true; }
  fi
  echo "uninstall: purged configuration, state and the kvfence account"
else
  echo "uninstall: kept /etc/kvfence, /var/lib/kvfence and the kvfence account (--purge removes them)"
fi
[ "$live" = 1 ] && systemctl daemon-reload
echo "uninstall: done"
