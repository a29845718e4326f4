#!/usr/bin/env bash
# Bring up a real PostgreSQL server for development and CI: one cluster under $KDSWEEP_PG_ROOT, listening on
# 127.0.0.1:$KDSWEEP_PG_PORT, with a role `kdsweep` that must give its password over TCP (scram-sha-256) and may
# create databases, and a database `kdsweep`.
# Idempotent: installs PostgreSQL if missing, runs initdb once, starts the server only if it is not alive.
# Progress goes to stderr; stdout is only the environment to use: KDSWEEP_TEST_PG_URL=postgresql+psycopg2://...
# Needs root on Debian (initdb and the server run as the `postgres` OS user). Stop it with down.sh.
set -euo pipefail

ROOT="${KDSWEEP_PG_ROOT:-/tmp/kdsweep-pg}"
PORT="${KDSWEEP_PG_PORT:-55432}"
DATA="$ROOT/data"
SOCKETS="$ROOT/run"   # the unix socket: only the postgres OS user talks to it (peer authentication)
ROLE=kdsweep
DB=kdsweep

log() { echo "up.sh: $*" >&2; }

# 1. Packages.
mkdir -p "$ROOT/log"
if [[ "$(dpkg-query -W -f='${Status}' postgresql 2>/dev/null)" != "install ok installed" ]]; then
    log "installing postgresql (log: $ROOT/log/apt.log)"
    # The lock timeout lets a concurrent apt/dpkg finish instead of failing this script.
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=120 \
            postgresql; } >"$ROOT/log/apt.log" 2>&1; then
        tail -n 20 "$ROOT/log/apt.log" >&2
        exit 1
    fi
fi
BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
as_postgres() { (cd / && runuser -u postgres -- "$@"); }   # cd /: postgres may not read the caller's directory

# 2. The cluster, made once. initdb refuses root, so it runs as postgres; TCP logins need a password.
chown postgres: "$ROOT/log"
mkdir -p "$SOCKETS" && chown postgres: "$SOCKETS"
if [[ ! -s "$DATA/PG_VERSION" ]]; then
    log "initdb $DATA"
    rm -rf "$DATA" && install -d -o postgres -g postgres -m 700 "$DATA"
    if ! as_postgres "$BIN/initdb" -D "$DATA" -U postgres --auth-local=peer --auth-host=scram-sha-256 \
            >"$ROOT/log/initdb.log" 2>&1; then
        tail -n 20 "$ROOT/log/initdb.log" >&2
        exit 1
    fi
fi
# The role's password, made once; root-only, like the munge key of launchers/slurm.
if [[ ! -s "$ROOT/password" ]]; then
    (umask 077 && od -An -tx1 -N12 /dev/urandom | tr -d ' \n' >"$ROOT/password")
fi
PASSWORD="$(cat "$ROOT/password")"

# 3. The server, if not alive. Alive = the pid of postmaster.pid runs postgres and is not a zombie.
alive() {
    local pid stat
    pid="$(head -n 1 "$DATA/postmaster.pid" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    [[ "${stat%% *}" != Z ]] || return 1
    [[ "$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -n 1)" == *postgres ]]
}
running_port="$(sed -n 4p "$DATA/postmaster.pid" 2>/dev/null || true)"
if alive && [[ "$running_port" != "$PORT" ]]; then
    log "the server under $ROOT already runs on port $running_port, not $PORT: stop it with down.sh first"
    exit 1
fi
if ! alive; then
    log "starting postgres on 127.0.0.1:$PORT (log: $ROOT/log/postgres.log)"
    if ! as_postgres "$BIN/pg_ctl" -D "$DATA" -l "$ROOT/log/postgres.log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $PORT -k $SOCKETS" start >&2; then
        tail -n 20 "$ROOT/log/postgres.log" >&2
        exit 1
    fi
fi

# 4. Role and database; the password is (re)set each time, so it always matches $ROOT/password.
psql_() { as_postgres "$BIN/psql" -h "$SOCKETS" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qAt "$@"; }
psql_ -c "DO \$\$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$ROLE') THEN CREATE ROLE $ROLE; END IF;
          END \$\$;" \
      -c "ALTER ROLE $ROLE WITH LOGIN CREATEDB PASSWORD '$PASSWORD'" >&2
if [[ -z "$(psql_ -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]]; then
    psql_ -c "CREATE DATABASE $DB OWNER $ROLE" >&2
fi
log "postgres is up on 127.0.0.1:$PORT (role $ROLE, database $DB)"
echo "KDSWEEP_TEST_PG_URL=postgresql+psycopg2://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
