#!/usr/bin/env bash
# Bring up a real one-node SLURM cluster (munged + slurmctld + slurmd) for development and CI.
# Idempotent: installs what is missing, starts only the daemons that are not alive, and ends once the node
# accepts jobs. Progress goes to stderr; stdout is only the environment to use, so `eval "$(bash up.sh)"` works.
# Needs root on Debian (no systemd: the daemons are started by hand). Stop it with down.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${KDSWEEP_SLURM_ROOT:-/tmp/kdsweep-slurm}"
CONF="$ROOT/etc/slurm.conf"
SOCKET="$ROOT/munge/munge.socket"
NODE=localhost   # the node's name in slurm.conf; slurmd is told it with -N because the real hostname differs
CPUS=16          # advertised, not real: several 2-task jobs run at once on a 2-core machine (see README)

log() { echo "up.sh: $*" >&2; }

source "$(dirname "${BASH_SOURCE[0]}")/alive.sh"

# 1. Packages. No slurmdbd/MariaDB: the sacct shim answers submitit from scontrol instead.
mkdir -p "$ROOT"/{etc,munge,log,run,bin,spool/ctld,spool/d}
installed() { [[ "$(dpkg-query -W -f='${Status}\n' "$@" 2>/dev/null | grep -c '^install ok installed$')" == "$#" ]]; }
if ! installed slurm-wlm slurm-client munge; then
    log "installing slurm-wlm slurm-client munge (log: $ROOT/log/apt.log)"
    # The lock timeout lets a concurrent apt/dpkg finish instead of failing this script.
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=120 \
            slurm-wlm slurm-client munge; } >"$ROOT/log/apt.log" 2>&1; then
        tail -n 20 "$ROOT/log/apt.log" >&2
        exit 1
    fi
fi

# 2. Files, all under $ROOT. The munge key is made once: daemons and clients must share it.
if [[ ! -s "$ROOT/munge/munge.key" ]]; then
    # umask 077: never readable by others, not even between its creation and the chmod
    (umask 077 && dd if=/dev/urandom of="$ROOT/munge/munge.key" bs=1024 count=1 status=none)
    chmod 400 "$ROOT/munge/munge.key"
fi
MEM_MB=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))
cat >"$CONF.new" <<EOF
# Written by launchers/slurm/up.sh: a one-node development cluster. Edits are overwritten.
ClusterName=kdsweep
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Our own munged; cred_expire=5 (its least) lets a requeued job restart after ~6-10 s instead of ~150 s.
AuthInfo=socket=$SOCKET,cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MailProg=/bin/true
# Schedule within ~2 s of a submission; keep finished jobs visible to scontrol (and so sacct) for an hour.
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=3600
KillWait=5
ReturnToService=2
JobRequeue=1
# Trust the node lines below over the hardware, so the node can advertise $CPUS CPUs.
SlurmdParameters=config_overrides
StateSaveLocation=$ROOT/spool/ctld
SlurmdSpoolDir=$ROOT/spool/d
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
conf_changed=0
if cmp -s "$CONF.new" "$CONF"; then rm "$CONF.new"; else mv "$CONF.new" "$CONF"; conf_changed=1; fi

# The sacct shim goes first on PATH: Debian's real sacct only says "accounting storage is disabled".
ln -sfn "$HERE/sacct" "$ROOT/bin/sacct"
cat >"$ROOT/env.sh" <<EOF
export SLURM_CONF=$CONF
case ":\$PATH:" in *":$ROOT/bin:"*) ;; *) export PATH="$ROOT/bin:\$PATH" ;; esac
EOF

# 3. Daemons, in dependency order, each only if not alive. They daemonize themselves.
export SLURM_CONF="$CONF"
if (( conf_changed )) && alive "$ROOT/run/slurmctld.pid" slurmctld; then
    # scontrol reconfigure does not apply every setting (AuthInfo's cred_expire among them): start again
    log "slurm.conf changed: restarting the running cluster"
    bash "$HERE/down.sh"
fi
if ! alive "$ROOT/run/munged.pid" munged; then
    log "starting munged"
    # --force: as root munged refuses our /tmp directories as "insecure" otherwise.
    munged --force --socket="$SOCKET" --key-file="$ROOT/munge/munge.key" --pid-file="$ROOT/run/munged.pid" \
        --log-file="$ROOT/log/munged.log" --seed-file="$ROOT/munge/munged.seed"
fi
if ! alive "$ROOT/run/slurmctld.pid" slurmctld; then
    log "starting slurmctld"
    slurmctld -f "$CONF"
fi
slurmd_since=0   # when we start slurmd, wait for it to register: the saved node state may already say idle
if ! alive "$ROOT/run/slurmd.pid" slurmd; then
    log "starting slurmd"
    slurmd_since="$(date +%s)"
    slurmd -f "$CONF" -N "$NODE"
fi

# 4. Wait until the node takes jobs. A drained/down node (e.g. after an unkillable job) is resumed.
ready() {
    state="$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)"
    case "$state" in
        idle|mixed|allocated|completing) ;;
        drain*|down*) scontrol update NodeName="$NODE" State=RESUME >&2 || true; return 1 ;;
        *) return 1 ;;
    esac
    local started
    started="$(scontrol show node -o "$NODE" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')"
    [[ -n "$started" && "$(date -d "$started" +%s 2>/dev/null || echo 0)" -ge "$slurmd_since" ]]
}
for _ in $(seq 1 120); do ready && break; sleep 0.25; done
if ! ready; then
    log "node not ready after 30 s (state: '${state:-no answer}'); logs in $ROOT/log"
    tail -n 20 "$ROOT"/log/*.log >&2 || true
    exit 1
fi
log "node $NODE is $state; to use the cluster: source $ROOT/env.sh"
cat "$ROOT/env.sh"
