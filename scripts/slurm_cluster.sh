#!/usr/bin/env bash
# Start, stop or inspect a real single-machine Slurm cluster (1 or 2 nodes) without systemd.
#
#   bash scripts/slurm_cluster.sh start [--nodes N]   # N = 1 or 2 (default 2); restarts if already up
#   bash scripts/slurm_cluster.sh stop                # safe to call when nothing runs
#   bash scripts/slurm_cluster.sh status              # prints sinfo; exit 0 only if every node is up
#
# Needs root: it installs the Debian packages, writes /etc/slurm/slurm.conf (the path every Slurm
# command reads by default, so jobs and tests need no SLURM_CONF) and may append "127.0.0.1 n1 n2"
# to /etc/hosts. Daemon state, pid files and logs live in $SLURM_CLUSTER_DIR
# (default /var/tmp/cookbook-slurm). Authentication is real munge, as on a production cluster.
set -euo pipefail

# The daemons live in /usr/sbin, which non-login root shells (su without -) may lack.
PATH=$PATH:/usr/sbin:/sbin

CONF=/etc/slurm/slurm.conf
CONF_MARKER="# Written by scripts/slurm_cluster.sh; regenerated on every start, edits are lost."
NODE_CPUS=4
START_TIMEOUT_S=30
STOP_TIMEOUT_S=15

die() {
    echo "slurm_cluster.sh: $*" >&2
    exit 1
}

usage() {
    echo "usage: bash scripts/slurm_cluster.sh start [--nodes 1|2] | stop | status" >&2
    exit 2
}

# The state dir of the cluster that is configured now: stop/status must find the daemons that
# start launched, even when SLURM_CLUSTER_DIR differs between the calls.
configured_dir() {
    if [[ -f $CONF ]] && grep -qxF "$CONF_MARKER" "$CONF"; then
        dirname "$(sed -n 's/^StateSaveLocation=//p' "$CONF")"
    else
        echo "${SLURM_CLUSTER_DIR:-/var/tmp/cookbook-slurm}"
    fi
}

install_packages() {
    if command -v slurmctld slurmd sinfo munged >/dev/null && [[ -f /etc/munge/munge.key ]]; then
        return
    fi
    local pkgs=(slurmctld slurmd slurm-client munge) out
    echo "installing ${pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be missing or stale (fresh containers): refresh once and retry.
    if ! apt-get install -y --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
        out=$({ apt-get update && apt-get install -y --no-install-recommends "${pkgs[@]}"; } 2>&1) \
            || { tail -n 20 <<<"$out" >&2; die "apt-get install ${pkgs[*]} failed"; }
    fi
}

# Append the node names to /etc/hosts if they do not already map to 127.0.0.1. Slurm addresses
# nodes by NodeAddr, but srun connects to step daemons by node name; without this line the lookup
# falls through to DNS and every job hangs for about two minutes before failing.
ensure_hosts() {
    local missing=() name
    for name in "$@"; do
        awk -v n="$name" '$1 == "127.0.0.1" { for (i = 2; i <= NF; i++) if ($i == n) f = 1 }
                          END { exit !f }' /etc/hosts || missing+=("$name")
    done
    if ((${#missing[@]})); then
        echo "127.0.0.1 ${missing[*]}" >>/etc/hosts
    fi
}

write_conf() {
    local dir=$1 nodes=$2 host i
    host=$(hostname -s)
    mkdir -p "$(dirname "$CONF")"
    {
        echo "$CONF_MARKER"
        echo "ClusterName=cookbook"
        # Must be the short hostname or slurmctld refuses to start; the address avoids DNS.
        echo "SlurmctldHost=$host(127.0.0.1)"
        # Everything runs as root on one box: no slurm user, no privilege separation.
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # A requeued job waits until its previous run's credential has expired (cred_expire, default
        # 120 s, + 1) before it may start again; 10 s is plenty on one box.
        echo "AuthInfo=cred_expire=10"
        # No cgroup v1/v2 delegation without systemd: track processes by parent pid, bind nothing.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        # Nodes declare CPUs=$NODE_CPUS whatever the hardware has; without this slurmd reports
        # the real count and the controller drains a node that claims more.
        echo "SlurmdParameters=config_overrides"
        # No mail, accounting or job accounting daemons on a test box.
        echo "MailProg=/bin/true"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        # scancel sends SIGTERM, then SIGKILL after KillWait (default 30 s); keep stuck jobs short.
        echo "KillWait=5"
        # sbatch jobs may wait batch_sched_delay (default 3 s) before being scheduled; with 0 a
        # trivial batch job is done ~1 s after submission instead of ~3 s.
        echo "SchedulerParameters=batch_sched_delay=0"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        # %n = node name: several slurmd run on this one host and need their own files.
        echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
        echo "SlurmdSpoolDir=$dir/spool/slurmd-%n"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        # Each node gets its own slurmd port on 127.0.0.1 (Debian builds multiple-slurmd support).
        # 4 CPUs per node fit `srun -N2 --ntasks-per-node=2` next to a one-task-per-node job that
        # spawns 2 processes (-c 2), so two such test jobs can run at once.
        for ((i = 1; i <= nodes; i++)); do
            echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$NODE_CPUS" \
                "RealMemory=1000 Port=$((17000 + i)) State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

munge_works() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

# Reuse a munged that already runs (e.g. a system service): stop leaves it alone. Otherwise start
# one and keep its pid in $dir/run so that stop ends it. (Asking munge itself whether a daemon
# runs costs ~2 s of client retries when a killed munged left its socket behind.)
start_munge() {
    local dir=$1
    if [[ -z $(live_pids "munged $(cat /run/munge/munged.pid 2>/dev/null)") ]]; then
        install -d -o munge -g munge -m 0755 /run/munge
        # --force: start even though a killed munged left its socket behind.
        runuser -u munge -- munged --force
        cp /run/munge/munged.pid "$dir/run/munged.pid"
    fi
    munge_works || fail_start "$dir" "munged runs but munge -n | unmunge fails"
}

log_tails() {
    local dir=$1 f
    for f in "$dir"/log/*.log /var/log/munge/munged.log; do
        [[ -f $f ]] || continue
        echo "==> $f <==" >&2
        tail -n 20 "$f" >&2
    done
}

fail_start() {
    local dir=$1
    shift
    log_tails "$dir"
    (stop_cluster) >/dev/null 2>&1 || true
    die "$*"
}

# "program pid" lines read from the given pid files. Read them before shutting down: slurmd
# deletes its pid file early in its shutdown, while it still runs.
daemons() {
    local f name
    for f in "$@"; do
        [[ -f $f ]] || continue
        name=$(basename "$f" .pid)
        echo "${name%%-*} $(<"$f")"
    done
}

# Pids of the given daemons that still run the named program (a check against reused pids).
# Zombies do not count: PID 1 may be slow to reap a daemon that has exited.
live_pids() {
    local name pid comm state
    while read -r name pid; do
        [[ -n $pid ]] || continue
        read -r comm state < <(ps -o comm=,stat= -p "$pid") || continue
        if [[ $comm == "$name" && $state != Z* ]]; then
            echo "$pid"
        fi
    done <<<"$1"
}

# SIGTERM (a clean shutdown for all three daemons) the given daemons, wait for them to exit,
# SIGKILL whatever is left after STOP_TIMEOUT_S.
terminate() {
    local deadline pids
    pids=$(live_pids "$1")
    [[ -n $pids ]] || return 0
    # shellcheck disable=SC2086  # one pid per word
    kill -TERM $pids 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while [[ -n $(live_pids "$1") ]] && ((SECONDS < deadline)); do
        sleep 0.1
    done
    pids=$(live_pids "$1")
    [[ -n $pids ]] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.5
    pids=$(live_pids "$1")
    [[ -z $pids ]] || die "could not stop pids ${pids//$'\n'/ }"
}

stop_cluster() {
    local dir slurm munged jobs deadline
    dir=$(configured_dir)
    slurm=$(daemons "$dir"/run/slurm*.pid)
    munged=$(daemons "$dir"/run/munged.pid)
    if [[ -f $CONF ]] && scontrol ping 2>/dev/null | grep -q 'is UP'; then
        # Cancel jobs first: slurmstepd and the job's processes outlive slurmd by design.
        jobs=$(squeue -h -o %A)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs
            deadline=$((SECONDS + STOP_TIMEOUT_S))
            while [[ -n $(squeue -h -o %A) ]] && ((SECONDS < deadline)); do
                sleep 0.2
            done
        fi
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    terminate "$slurm"
    # munged last: slurmd still authenticates while it shuts down.
    terminate "$munged"
    rm -f "$dir"/run/*.pid
}

# Wait until every node is idle. The daemons fork before they bind their ports, so a daemon that
# dies at startup (e.g. port taken) is caught here by its command line, not by its exit status.
wait_idle() {
    local dir=$1 nodes=$2 deadline states cmd
    shift 2
    deadline=$((SECONDS + START_TIMEOUT_S))
    while :; do
        states=$(sinfo -h -N -o %t 2>/dev/null | sort | uniq -c | awk '{print $2 "=" $1}' | paste -sd,)
        [[ $states == "idle=$nodes" ]] && return
        for cmd in "$@"; do
            pgrep -fx -- "$cmd" >/dev/null || fail_start "$dir" "'$cmd' exited during startup"
        done
        ((SECONDS < deadline)) || fail_start "$dir" \
            "nodes not idle after ${START_TIMEOUT_S}s (states: ${states:-none})"
        sleep 0.1
    done
}

start_cluster() {
    local nodes=$1 dir names=() name i cmds cmd
    for ((i = 1; i <= nodes; i++)); do
        names+=("n$i")
    done
    install_packages
    if [[ -f $CONF ]] && ! grep -qxF "$CONF_MARKER" "$CONF"; then
        die "$CONF was not written by this script; move it away first"
    fi
    stop_cluster
    dir=${SLURM_CLUSTER_DIR:-/var/tmp/cookbook-slurm}
    # Fresh state every start; only our own subdirectories, never the (user-chosen) dir itself.
    rm -rf "$dir/state" "$dir/spool" "$dir/run" "$dir/log"
    mkdir -p "$dir/state" "$dir/run" "$dir/log"
    for name in "${names[@]}"; do
        mkdir -p "$dir/spool/slurmd-$name"
    done
    ensure_hosts "${names[@]}"
    write_conf "$dir" "$nodes"
    start_munge "$dir"
    # -c: cold start, forget node and job state from any earlier cluster.
    cmds=("slurmctld -c")
    for name in "${names[@]}"; do
        cmds+=("slurmd -N $name")
    done
    for cmd in "${cmds[@]}"; do
        # shellcheck disable=SC2086  # the command line is the daemon and its arguments
        $cmd || fail_start "$dir" "'$cmd' failed to start"
    done
    wait_idle "$dir" "$nodes" "${cmds[@]}"
    sinfo
}

status_cluster() {
    local dir node rc=0
    [[ -f $CONF ]] || die "no cluster configured ($CONF missing); run: bash scripts/slurm_cluster.sh start"
    # scontrol ping answers at once; sinfo retries a dead controller for ~9 s.
    scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld is not running"
    sinfo -N
    # Up = responding and usable: idle, or running/finishing jobs (mix/alloc/comp). Down,
    # drained or not responding (a trailing *) is not.
    sinfo -h -N -o %t | grep -qvxE 'idle|mix|alloc|comp' && rc=1
    # slurmctld notices a dead slurmd only after SlurmdTimeout (300 s): check the processes too.
    dir=$(configured_dir)
    for node in $(sinfo -h -N -o %N); do
        if [[ -z $(live_pids "$(daemons "$dir/run/slurmd-$node.pid")") ]]; then
            echo "slurm_cluster.sh: slurmd of node $node is not running" >&2
            rc=1
        fi
    done
    return "$rc"
}

main() {
    (($# >= 1)) || usage
    local cmd=$1 nodes=2
    shift
    [[ $cmd == start ]] || (($# == 0)) || usage
    while (($#)); do
        case $1 in
            --nodes) (($# >= 2)) || usage; nodes=$2; shift 2 ;;
            --nodes=*) nodes=${1#--nodes=}; shift ;;
            *) usage ;;
        esac
    done
    [[ $nodes == 1 || $nodes == 2 ]] || die "--nodes must be 1 or 2, got '$nodes'"
    case $cmd in
        start | stop) ((EUID == 0)) || die "needs root to install packages and start daemons" ;;
        status) ;;
        *) usage ;;
    esac
    case $cmd in
        start) start_cluster "$nodes" ;;
        stop) stop_cluster ;;
        status) status_cluster ;;
    esac
}

main "$@"
