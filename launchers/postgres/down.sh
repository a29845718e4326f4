#!/usr/bin/env bash
# Stop the PostgreSQL server started by up.sh. Idempotent: a server that is not running is left alone.
# The cluster under $ROOT is kept, so up.sh starts the same one again; `rm -rf $ROOT` to forget it.
set -euo pipefail

ROOT="${KDSWEEP_PG_ROOT:-/tmp/kdsweep-pg}"
DATA="$ROOT/data"

log() { echo "down.sh: $*" >&2; }

if [[ -s "$DATA/postmaster.pid" ]]; then
    BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
    # pg_ctl checks the pid file's process itself; -m fast ends open sessions instead of waiting for them.
    if (cd / && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1); then
        log "stopping postgres"
        (cd / && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -m fast -w -t 60 stop >&2)
    fi
fi
log "stopped"
