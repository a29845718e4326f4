#!/usr/bin/env bash
# Stop the one-node SLURM cluster started by up.sh. Idempotent: a daemon that is not alive is skipped.
# Daemons are found by their pid files only (never by name: other clusters or zombies may share the name).
# State ($ROOT/spool, the munge key) is kept, so up.sh resumes the same cluster; `rm -rf $ROOT` to forget it.
set -euo pipefail

ROOT="${KDSWEEP_SLURM_ROOT:-/tmp/kdsweep-slurm}"
export SLURM_CONF="$ROOT/etc/slurm.conf"

log() { echo "down.sh: $*" >&2; }

source "$(dirname "${BASH_SOURCE[0]}")/alive.sh"

# Cancel jobs first, so no job process outlives the daemons that manage it.
if alive "$ROOT/run/slurmctld.pid" slurmctld; then
    jobs="$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')"
    if [[ -n "${jobs// }" ]]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086  # one argument per job id
        scancel $jobs || true
        for _ in $(seq 1 60); do   # KillWait=5: jobs are gone in a few seconds
            [[ -z "$(squeue -h -t running,completing -o %A 2>/dev/null)" ]] && break
            sleep 0.25
        done
    fi
fi

stop() {  # stop NAME: TERM, wait up to 10 s, then KILL
    local pidfile="$ROOT/run/$1.pid"
    if alive "$pidfile" "$1"; then
        local pid
        pid="$(cat "$pidfile")"
        log "stopping $1 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 40); do alive "$pidfile" "$1" || break; sleep 0.25; done
        if alive "$pidfile" "$1"; then
            log "$1 ignored TERM; killing"
            kill -KILL "$pid" 2>/dev/null || true
            for _ in $(seq 1 20); do alive "$pidfile" "$1" || break; sleep 0.25; done
        fi
    fi
    rm -f "$pidfile"
}

# Reverse start order: munged last, since slurmd and slurmctld talk through it while shutting down.
stop slurmd
stop slurmctld
stop munged
log "stopped"
