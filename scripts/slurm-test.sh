#!/usr/bin/env bash
# The Slurm launcher against a real Slurm: a one-node cluster on this machine (munged,
# slurmctld and slurmd, configured under target/slurm/, stopped again at the end), then
#   1. a short CPU search whose worker is started through srun: the run must finish with
#      evaluations, and its worker must have run as a Slurm job step (the worker says so in the
#      run's isolation line; slurmctld lists the job);
#   2. a search killed with SIGKILL while its srun-started worker waits on a kernel that never
#      returns: the worker (whose parent is slurmd's step daemon, not the search) must be gone
#      within a few seconds, and the job step with it.
# Needs root (the daemons, and Debian's slurm-wlm and munge are installed with apt-get when
# missing). Without root or without a way to install them it says why and exits 0, or 1 when
# KSEARCH_REQUIRE_SLURM=1 (scripts/test.sh sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

missing() {
    echo "slurm-test: $*" >&2
    if [[ ${KSEARCH_REQUIRE_SLURM:-0} == 1 ]]; then
        exit 1
    fi
    echo "slurm-test: skipped (set KSEARCH_REQUIRE_SLURM=1 to make this a failure)" >&2
    exit 0
}

if [[ $(id -u) -ne 0 ]]; then
    missing "needs root to run slurmctld, slurmd and munged (and to install slurm-wlm and munge)"
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
    || ! command -v munged >/dev/null || ! command -v mungekey >/dev/null; then
    echo "== installing slurm-wlm and munge (apt-get) =="
    command -v apt-get >/dev/null || missing "slurm-wlm and munge are not installed and there is no apt-get to install them"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || missing "apt-get could not install slurm-wlm and munge"
fi

D=$ROOT/target/slurm
rm -rf "$D"
mkdir -p "$D"/state "$D"/spool "$D"/munge "$D"/tasks
chmod 700 "$D"/munge
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
PORT_CTLD=${KSEARCH_SLURM_PORT:-16817}

# Munge: our own key and socket, so a system munged (if any) is left alone.
mungekey --create --keyfile="$D/munge/munge.key" --force >/dev/null
chmod 600 "$D/munge/munge.key"
munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"

stop_daemons() {
    for p in "$D/slurmd.pid" "$D/slurmctld.pid" "$D/munge/munged.pid"; do
        if [[ -s $p ]]; then
            kill "$(cat "$p")" 2>/dev/null || true
        fi
    done
}
trap stop_daemons EXIT

# One node, no cgroups (works in a container): processes tracked through /proc, no task
# plugin, no accounting database.
cat >"$D/slurm.conf" <<EOF
ClusterName=ksearch-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT_CTLD
SlurmdPort=$((PORT_CTLD + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=test Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$D/slurm.conf

slurmctld -f "$D/slurm.conf"
slurmd -f "$D/slurm.conf" -N "$HOST"
echo "== waiting for node $HOST to be idle =="
for _ in $(seq 1 60); do
    if [[ $(sinfo -h -N -o '%T' 2>/dev/null | head -1) == idle ]]; then
        break
    fi
    sleep 1
done
state=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
if [[ $state != idle ]]; then
    echo "slurm-test: node $HOST is '$state', not idle; logs:" >&2
    tail -n 20 "$D/slurmctld.log" "$D/slurmd.log" >&2 || true
    exit 1
fi
srun --ntasks=1 true || { tail -n 20 "$D/slurmctld.log" "$D/slurmd.log" >&2; exit 1; }

# The binary scripts/test.sh built ($KSEARCH_BIN), else one built here in the same profile.
if [[ -z ${KSEARCH_BIN:-} ]]; then
    cargo build -q --release -p ksearch
fi
KS=${KSEARCH_BIN:-$ROOT/target/release/ksearch}

echo "== 1. a CPU search whose worker runs through srun =="
out=$("$KS" --store "$D/store.db" --tasks-dir "$ROOT/tasks" --kb-dir "$ROOT/kb" \
    run softmax --backend cpu --launcher slurm --rounds 2 --max-reps 3 2>&1) || {
    code=$?
    # Exit 1 is a finished run without a faster kernel: still a finished run.
    if [[ $code -ne 1 ]]; then
        echo "$out" >&2
        echo "slurm-test: the search failed (exit $code)" >&2
        exit 1
    fi
}
echo "$out" | tail -n 12
evals=$("$KS" --store "$D/store.db" runs | awk '$1 == 1 {for (i = 1; i <= NF; i++) if ($i == "evals") print $(i - 1)}')
status=$("$KS" --store "$D/store.db" best 1 --json | python3 -c 'import json, sys; print(json.load(sys.stdin).get("evaluations", 0))' 2>/dev/null || true)
if [[ -z $evals || $evals -lt 3 ]]; then
    echo "slurm-test: run 1 has '${evals:-no}' evaluations" >&2
    "$KS" --store "$D/store.db" runs >&2
    exit 1
fi
echo "run 1: $evals evaluations (report: ${status:-?})"
if ! grep -q "Slurm job" <<<"$out"; then
    echo "slurm-test: the run's isolation line does not name a Slurm job step:" >&2
    echo "$out" | grep -i isolation >&2 || echo "$out" | head -20 >&2
    exit 1
fi
jobs=$(scontrol show job -o 2>/dev/null | grep -c 'JobName=ksearch-worker' || true)
if [[ $jobs -lt 1 ]]; then
    echo "slurm-test: slurmctld knows no ksearch-worker job" >&2
    scontrol show job -o >&2 || true
    exit 1
fi
echo "workers ran as $jobs Slurm job(s): $(grep -o 'Slurm job [^;]*' <<<"$out" | head -1)"

echo "== 2. the search killed with SIGKILL while its srun-started worker hangs =="
cp -r "$ROOT/crates/cli/tests/fixtures/sleeper" "$D/tasks/"
"$KS" --quiet --store "$D/sleeper.db" --tasks-dir "$D/tasks" \
    run sleeper --backend cpu --launcher slurm --rounds 3 --run-timeout 600s --max-reps 3 >"$D/sleeper.log" 2>&1 &
search=$!
# The sleeper search's worker processes (and the srun starting them), from /proc (no procps needed).
workers() {
    local f p
    for f in /proc/[0-9]*/cmdline; do
        if { tr '\0' ' ' <"$f"; } 2>/dev/null | grep -q "ksearch worker --backend cpu --cache $D/cache"; then
            p=${f#/proc/}
            echo "${p%/cmdline}"
        fi
    done
}
running=""
for _ in $(seq 1 300); do
    running=$(sqlite3 "$D/sleeper.db" "SELECT count(*) FROM nodes WHERE id = 2 AND status = 'running'" 2>/dev/null \
        || python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM nodes WHERE id = 2 AND status = \"running\"").fetchone()[0])' "$D/sleeper.db" 2>/dev/null || true)
    if [[ $running == 1 && -n $(workers) ]]; then
        break
    fi
    sleep 0.2
done
if [[ $running != 1 || -z $(workers) ]]; then
    echo "slurm-test: the hanging candidate never ran through srun" >&2
    cat "$D/sleeper.log" >&2
    kill -9 "$search" 2>/dev/null || true
    exit 1
fi
sleep 1
before=$(workers | tr '\n' ' ')
{
    kill -9 "$search"
    wait "$search"
} 2>/dev/null || true
gone=""
for _ in $(seq 1 50); do
    if [[ -z $(workers) ]]; then
        gone=1
        break
    fi
    sleep 0.1
done
if [[ -z $gone ]]; then
    echo "slurm-test: worker(s) $(workers | tr '\n' ' ') outlived the killed search by 5 s (were: $before)" >&2
    for p in $(workers); do tr '\0' ' ' <"/proc/$p/cmdline" >&2; echo >&2; done
    exit 1
fi
echo "worker(s) $before gone after the search's SIGKILL"
for _ in $(seq 1 50); do
    if [[ -z $(squeue -h -n ksearch-worker -t running 2>/dev/null) ]]; then
        break
    fi
    sleep 0.2
done
if [[ -n $(squeue -h -n ksearch-worker -t running 2>/dev/null) ]]; then
    echo "slurm-test: a ksearch-worker job is still running:" >&2
    squeue >&2
    exit 1
fi
echo "slurm-test: ok"
