#!/usr/bin/env bash
# Installs what the local stack and the tests need, idempotently: Debian packages when absent,
# uv (pinned), the workspace venv from uv.lock, and the Kafka broker jars. Safe to re-run.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${TETHER_STATE_DIR:-$REPO/.state}"
UV_VERSION=0.13.9
UV_HOME="$STATE/tools/uv"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

uv_ok() { [[ -x "$1" || -n "$(command -v "$1" 2>/dev/null)" ]] && "$1" --version 2>/dev/null | grep -qx "uv $UV_VERSION.*"; }

# -- which uv ----------------------------------------------------------------------------------
UV=""
if uv_ok uv; then
  UV="$(command -v uv)"
elif uv_ok "$UV_HOME/bin/uv"; then
  UV="$UV_HOME/bin/uv"
fi

# -- Debian packages ---------------------------------------------------------------------------
missing=()
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if [[ -z "$UV" ]] && ! python3 -m pip --version >/dev/null 2>&1; then missing+=(python3-pip); fi
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
# The JDK, not only the runtime: the bench's broker profile (TETHER_BENCH_PROFILE, and its test
# in bench/tests/test_profile.py) records with jcmd and reads the recording with jfr.
{ command -v java && command -v jcmd && command -v jfr; } >/dev/null 2>&1 || missing+=(default-jdk-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)

if ((${#missing[@]})); then
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to install: ${missing[*]}"
    SUDO=(sudo)
    [[ -t 0 ]] || SUDO=(sudo -n)
  fi
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install these by hand: ${missing[*]}"
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if [[ " ${missing[*]} " == *" postgresql "* ]]; then
    # Debian's postgresql package would create and start a "main" cluster on 5432; the stack
    # runs its own cluster (deploy/local/stack.py), so ask postgresql-common not to.
    "${SUDO[@]}" mkdir -p /etc/postgresql-common/createcluster.d
    echo 'create_main_cluster = false' |
      "${SUDO[@]}" tee /etc/postgresql-common/createcluster.d/tether-no-main-cluster.conf >/dev/null
  fi
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    # Keep package scripts from starting Debian's own redis/postgres services on our ports
    # during the install (the usual Debian/Docker switch); removed again on exit.
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${SUDO[@]}" chmod 755 /usr/sbin/policy-rc.d
    trap '"${SUDO[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  "${SUDO[@]}" apt-get update -q
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
  # Their postinst enabled Debian's own services, which after a reboot would take the stack's
  # ports (make up: exit 3); the stack runs servers of its own, so they stay off.
  services=()
  for pkg in redis-server postgresql; do
    if [[ " ${missing[*]} " == *" $pkg "* ]]; then services+=("$pkg"); fi
  done
  if ((${#services[@]})); then
    say "disabling Debian's own services at boot: ${services[*]}"
    "${SUDO[@]}" "$REPO/deploy/local/no-boot-start.sh" "${services[@]}"
  fi
fi

# -- uv, pinned --------------------------------------------------------------------------------
if [[ -z "$UV" ]]; then
  say "installing uv $UV_VERSION into $UV_HOME"
  rm -rf "$UV_HOME"
  # --target keeps uv out of the system site-packages (and outside Debian's PEP 668 guard).
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --disable-pip-version-check --no-input -q \
    --target "$UV_HOME" "uv==$UV_VERSION"
  UV="$UV_HOME/bin/uv"
  uv_ok "$UV" || die "uv $UV_VERSION did not install into $UV_HOME"
fi

# -- the workspace venv from uv.lock -----------------------------------------------------------
cd "$REPO"
UV_PYTHON_DOWNLOADS=never "$UV" sync --frozen --quiet
say "virtualenv $REPO/.venv matches uv.lock"

# -- Kafka broker jars (re-resolved when deploy/local/kafka/pom.xml changes) -------------------
python3 "$REPO/deploy/local/stack.py" fetch-kafka | sed 's/^/setup: /'
