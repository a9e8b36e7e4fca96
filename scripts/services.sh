#!/usr/bin/env bash
# The system services some tests need, for CI (.ci/run) and by hand:
#   scripts/services.sh install         apt-get install postgresql chromium, only what is missing
#   scripts/services.sh start-postgres  a throw-away cluster on 127.0.0.1; prints its URI on stdout
#   scripts/services.sh stop-postgres   stop that cluster (its files stay, the next start reuses them)
#   scripts/services.sh uri             the URI start-postgres prints
# Settings: QPIPE_PG_DIR (default /tmp/qpipe-pg), QPIPE_PG_PORT (default 55432).
# The cluster trusts every local and 127.0.0.1 connection and runs with fsync off: it is for
# tests, never for data. Messages go to stderr, so that `uri=$(scripts/services.sh start-postgres)`
# captures the URI alone.
set -euo pipefail

PG_DIR=${QPIPE_PG_DIR:-/tmp/qpipe-pg}
PG_PORT=${QPIPE_PG_PORT:-55432}
PG_USER=postgres                      # the cluster's superuser (initdb -U)
CHROMIUM=/usr/bin/chromium

say() { printf '[services] %s\n' "$*" >&2; }
fail() { printf '[services] FAILED: %s\n' "$*" >&2; exit 1; }

uri() { echo "postgresql://$PG_USER@127.0.0.1:$PG_PORT/postgres"; }

# root (CI) runs privileged commands as is, anyone else through sudo if there is one.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else fail "'$*' needs root and there is no sudo"
  fi
}

# --- install ------------------------------------------------------------------------------

pg_bindir() {
  # Debian keeps initdb and pg_ctl out of PATH, under /usr/lib/postgresql/<major>/bin.
  local dir
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then echo "$dir"; return; fi
  if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"; return
  fi
  return 1
}

# Debian packages to install: the ones whose program is missing.
missing_packages() {
  local missing=()
  pg_bindir >/dev/null || missing+=(postgresql)
  [ -x "$CHROMIUM" ] || missing+=(chromium)
  echo "${missing[@]:-}"
}

# True when apt knows an installable version of every package named.
apt_has_candidates() {
  local pkg candidate
  for pkg in "$@"; do
    candidate=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
    if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then return 1; fi
  done
}

# apt-get install, its output kept out of the way but for its tail on failure.
apt_install() {
  local log rc=0
  log=$(mktemp)
  as_root apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then tail -n 20 "$log" >&2; fi
  rm -f "$log"
  return "$rc"
}

install() {
  local missing
  read -r -a missing <<<"$(missing_packages)"
  if [ "${#missing[@]}" -eq 0 ]; then
    say "postgresql ($(pg_bindir)) and chromium ($CHROMIUM) are installed already"
    return
  fi
  command -v apt-get >/dev/null 2>&1 || fail "missing ${missing[*]} and no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt_has_candidates "${missing[@]}"; then
    say "apt-get update (the package lists do not know ${missing[*]})"
    as_root apt-get update -qq || fail "apt-get update failed (see above)"
  fi
  say "apt-get install --no-install-recommends ${missing[*]} (first time on a machine: ~30 s)"
  if ! apt_install "${missing[@]}"; then
    # Stale lists name versions the mirror no longer has: refresh them once and retry.
    say "apt-get install failed; apt-get update and one retry"
    as_root apt-get update -qq || fail "apt-get update failed (see above)"
    apt_install "${missing[@]}" || fail "apt-get install ${missing[*]} failed (see above)"
  fi
  read -r -a missing <<<"$(missing_packages)"
  [ "${#missing[@]}" -eq 0 ] || fail "installed, yet still missing: ${missing[*]}"
  say "installed: $("$(pg_bindir)/postgres" --version), $("$CHROMIUM" --version 2>/dev/null || echo chromium)"
}

# --- PostgreSQL ---------------------------------------------------------------------------

# initdb and postgres refuse to run as root: as root, the cluster belongs to the postgres user.
pg_run() {
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || fail "no 'postgres' OS user to run PostgreSQL as (is the postgresql package installed?)"
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_running() { pg_run "$BIN/pg_ctl" -D "$PG_DIR" status >/dev/null 2>&1; }

start_postgres() {
  BIN=$(pg_bindir) || fail "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): run '$0 install'"
  if [ -f "$PG_DIR/PG_VERSION" ] && pg_running; then
    say "PostgreSQL is already running in $PG_DIR"
  else
    if [ ! -f "$PG_DIR/PG_VERSION" ]; then
      if [ -e "$PG_DIR" ] && [ -n "$(ls -A "$PG_DIR" 2>/dev/null)" ]; then
        fail "$PG_DIR exists, is not empty and holds no PostgreSQL cluster: remove it or set QPIPE_PG_DIR"
      fi
      say "initdb: a new cluster in $PG_DIR ($("$BIN/postgres" --version))"
      mkdir -p "$PG_DIR"
      chmod 700 "$PG_DIR"
      if [ "$(id -u)" -eq 0 ]; then chown postgres: "$PG_DIR"; fi
      local log
      log=$(mktemp)
      if ! pg_run "$BIN/initdb" -D "$PG_DIR" -U "$PG_USER" --auth=trust -E UTF8 \
          --locale=C.UTF-8 >"$log" 2>&1 \
         && ! pg_run "$BIN/initdb" -D "$PG_DIR" -U "$PG_USER" --auth=trust -E UTF8 \
          --locale=C >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        rm -f "$log"
        fail "initdb failed in $PG_DIR (see above; as root, the postgres user must be able to reach it)"
      fi
      rm -f "$log"
      # Loopback only, socket in the cluster's own directory (Debian's /var/run/postgresql may
      # not exist), and no fsync: the databases are throw-away test fixtures.
      pg_run tee -a "$PG_DIR/postgresql.conf" >/dev/null <<EOF

# scripts/services.sh: a test cluster
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PG_DIR'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
EOF
      pg_run tee "$PG_DIR/pg_hba.conf" >/dev/null <<'EOF'
# scripts/services.sh: trust local and loopback connections (a test cluster)
local all all               trust
host  all all 127.0.0.1/32  trust
host  all all ::1/128       trust
EOF
    else
      say "starting the cluster in $PG_DIR"
    fi
    # pg_ctl fails on a stale postmaster.pid only if its process lives; -w waits until ready.
    if ! pg_run "$BIN/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/server.log" -o "-p $PG_PORT" -w -t 60 \
        start >/dev/null; then
      tail -n 20 "$PG_DIR/server.log" >&2 || true
      fail "PostgreSQL did not start on 127.0.0.1:$PG_PORT (see its log above; is the port in use?)"
    fi
  fi
  # The port it listens on is the one asked for, and it answers queries.
  local i
  for i in $(seq 1 60); do
    if "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres; then break; fi
    [ "$i" -lt 60 ] || fail "PostgreSQL runs in $PG_DIR but does not answer on 127.0.0.1:$PG_PORT (another QPIPE_PG_PORT than the one it started with?)"
    sleep 0.5
  done
  "$BIN/psql" -X -q -At -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -c 'select 1' \
    >/dev/null || fail "PostgreSQL on 127.0.0.1:$PG_PORT answers but rejects queries (see above)"
  say "PostgreSQL ready on 127.0.0.1:$PG_PORT (data and log in $PG_DIR)"
  uri
}

stop_postgres() {
  BIN=$(pg_bindir) || { say "PostgreSQL is not installed: nothing to stop"; return; }
  if [ -f "$PG_DIR/PG_VERSION" ] && pg_running; then
    pg_run "$BIN/pg_ctl" -D "$PG_DIR" -m fast -w -t 60 stop >/dev/null \
      || fail "pg_ctl stop failed in $PG_DIR"
    say "PostgreSQL in $PG_DIR stopped"
  else
    say "no PostgreSQL running in $PG_DIR"
  fi
}

case "${1:-}" in
  install) install ;;
  start-postgres) start_postgres ;;
  stop-postgres) stop_postgres ;;
  uri) uri ;;
  *) echo "usage: $0 install|start-postgres|stop-postgres|uri" >&2; exit 2 ;;
esac
