#!/usr/bin/env bash
# A one-node Slurm on this machine, to try launch/slurm.sbatch and for the tests marked `slurm`.
#
#   launch/local_slurm.sh start DIR   # installs Debian's slurm-wlm if needed (root), starts munged, slurmctld and
#                                     # slurmd with their config, state and logs under DIR; prints SLURM_CONF=...
#   export SLURM_CONF=DIR/slurm.conf  # then sbatch, squeue, scontrol use this cluster
#   launch/local_slurm.sh stop DIR    # stops what `start` started
#
# No systemd and no cgroups: processes are tracked through /proc (proctrack/linuxproc), daemons run as root.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$(realpath -m "$2")

stop() {
    for daemon in slurmd slurmctld munged; do
        if [[ -f $dir/$daemon.pid ]]; then
            pid=$(cat "$dir/$daemon.pid")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            rm -f "$dir/$daemon.pid"
        fi
    done
}

start() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }
    fi
    mkdir -p "$dir/state" "$dir/spool"

    # munge authenticates every Slurm message; the package made its key. A munged already running is used.
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        install -d -o munge -g munge -m 0755 /run/munge
        runuser -u munge -- /usr/sbin/munged  # forks; its pid file is /run/munge/munged.pid
        for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
        cp /run/munge/munged.pid "$dir/munged.pid"
    fi

    local host node
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=...: what this machine has
    cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobRequeue=1
ReturnToService=2
# one node, a job or two: a scheduling pass every second costs nothing, and a job told to start at a time starts
# then, not at the next pass of the default 60 s
SchedulerParameters=sched_interval=1
# finished jobs stay visible to scontrol for an hour (there is no accounting storage for sacct)
MinJobAge=3600
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 100); do
        if [[ $(sinfo --noheader --format=%t 2>/dev/null) == idle ]]; then
            echo "SLURM_CONF=$SLURM_CONF"
            return
        fi
        sleep 0.2
    done
    echo "error: the local Slurm did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
    stop
    exit 1
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
