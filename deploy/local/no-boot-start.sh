#!/usr/bin/env bash
# Keeps Debian's own services of packages setup.sh has just installed (redis-server, postgresql)
# from starting at boot. Their postinst enables them, and after a reboot Debian's redis-server would
# hold 6379 (make up: exit 3); the local stack runs servers of its own (deploy/local/stack.py).
# Usage: no-boot-start.sh SERVICE...   (a Debian package whose unit and init script share its name)
# With systemd running: `systemctl disable --now`. Otherwise the unit's links are removed offline
# (systemctl --root, or deb-systemd-helper without systemctl) and the SysV links turned off
# (update-rc.d). Honours DPKG_ROOT (an image prepared from outside: only its files change). Never
# fails: a missing tool or a refusal is a warning, since the stack runs either way.
set -uo pipefail

root="${DPKG_ROOT:-}"
warn() { printf 'setup: warning: %s\n' "$*" >&2; }
have() { command -v "$1" >/dev/null 2>&1; }

# systemctl would hand the SysV side to systemd-sysv-install, which chroots into DPKG_ROOT; the
# update-rc.d call below does that part (Debian's update-rc.d sets this variable for the same reason).
export SYSTEMCTL_SKIP_SYSV=1

for service in "$@"; do
  unit="$service.service"
  if [[ -z "$root" && -d /run/systemd/system ]] && have systemctl; then
    systemctl disable --now --quiet "$unit" ||
      warn "could not disable $unit; after a reboot it may hold a port the stack needs (systemctl disable --now $unit)"
  elif have systemctl; then
    systemctl --root="${root:-/}" disable --quiet "$unit" >/dev/null 2>&1 ||
      warn "systemctl --root=${root:-/} disable $unit failed"
  elif have deb-systemd-helper; then
    # deb-systemd-helper acts only when told which package it works for.
    DPKG_MAINTSCRIPT_PACKAGE="$service" deb-systemd-helper disable "$unit" >/dev/null 2>&1 ||
      warn "deb-systemd-helper disable $unit failed"
  fi
  if [[ -e "$root/etc/init.d/$service" ]] && have update-rc.d; then
    update-rc.d "$service" disable >/dev/null 2>&1 || warn "update-rc.d $service disable failed"
  fi
done
exit 0
