#!/usr/bin/env bash
# A real one-node Slurm cluster (munge, slurmctld, slurmd) in a directory of its own, for the tests that
# submit examples/slurm/*.sbatch (tests/runtime/test_slurm_scripts.py). Debian's slurm-wlm and munge, as root.
#
#   tests/runtime/slurm_cluster.sh start DIR   # prints the line to source: export SLURM_CONF=DIR/slurm.conf
#   tests/runtime/slurm_cluster.sh stop DIR
#
# Everything lives under DIR (config, state, spool, logs, munge key and socket) and on free ports, so the
# host's own /etc/slurm and /etc/munge, and any Slurm already running, are left alone. Exit status 3 with
# one line on stderr: this host cannot run it (not root, binaries missing, a daemon did not come up);
# the tests skip with that line.
set -euo pipefail

cannot() { echo "slurm_cluster: $*" >&2; exit 3; }

start() {
    local dir=$1
    [ "$(id -u)" = 0 ] || cannot "needs root (slurmd starts jobs as their user)"
    local tool
    for tool in munged slurmctld slurmd sbatch srun scontrol; do
        command -v "$tool" >/dev/null || cannot "$tool not found: apt-get install slurm-wlm munge"
    done
    mkdir -p "$dir"/{munge,state,spool,log}
    dir=$(cd "$dir" && pwd)
    chmod 755 "$dir"  # munged refuses a key or socket under a directory others may write to
    chmod 700 "$dir/munge"
    head -c 1024 /dev/urandom >"$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    # --force: munged declines to run as root without it; here root is the only user there is.
    munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" \
        || cannot "munged did not start: $(tail -n 1 "$dir/log/munged.log" 2>/dev/null)"
    write_config "$dir"
    export SLURM_CONF=$dir/slurm.conf
    # -c: no state from an earlier cluster; -i: ignore a lost state file.
    slurmctld -c -i -f "$SLURM_CONF" || cannot "slurmctld did not start: $(tail -n 1 "$dir/log/slurmctld.log")"
    slurmd -f "$SLURM_CONF" || cannot "slurmd did not start: $(tail -n 1 "$dir/log/slurmd.log")"
    wait_idle "$dir"
    echo "export SLURM_CONF=$SLURM_CONF"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_config() {
    local dir=$1 node
    node=$(hostname -s)  # slurmd finds its NodeName by the short host name
    # CPUs: the cores this process may use (nproc would also obey OMP_NUM_THREADS, which tests set to 1).
    # proctrack/linuxproc and task/none: no cgroups, which containers rarely offer; select/cons_tres as
    # GPU clusters use. One partition, the default, so the scripts need no --partition. MinJobAge=4 (s before a
    # finished job may be forgotten; 300 by default) keeps `sbatch --wait` polling every 2 s: it waits up to
    # 32 s between polls while that leaves the job known.
    cat >"$dir/slurm.conf" <<EOF
ClusterName=shardwise-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=4
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_idle() {
    local dir=$1 tries
    for tries in $(seq 100); do
        if scontrol show nodes 2>/dev/null | grep -q "State=IDLE"; then return 0; fi
        sleep 0.2
    done
    cannot "the node did not become idle in 20 s: $(tail -n 1 "$dir/log/slurmd.log")"
}

stop() {
    # All three at once (slurmctld alone takes seconds to save its state, which nobody will read), then
    # SIGKILL whatever is still there after 5 s.
    local dir=$1 pids=() pidfile pid
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -s "$pidfile" ] && pid=$(cat "$pidfile") && kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 1 ] || return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

case "${1:-}" in
    start) start "${2:?a directory}" ;;
    stop) stop "${2:?a directory}" ;;
    *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
