#!/usr/bin/env bash
# A real Slurm cluster on one machine: slurmctld plus N node daemons (n1..nN), for tests, CI
# and trying the Slurm path on a laptop. Debian's Slurm (22.05) is built with
# MULTIPLE_SLURMD, so one host can run several slurmd. Needs root and Debian's packages:
#   apt-get install -y slurmctld slurmd slurm-client munge
# Idempotent: a running cluster is left alone. Stop it with slurm/local/stop.sh.
set -euo pipefail
STATE=${MOE_SLURM_STATE:-/var/tmp/moe-slurm}
NODES=${MOE_SLURM_NODES:-2}
CPUS=${MOE_SLURM_CPUS_PER_NODE:-1}
HOST=$(hostname -s)

# Nodes that take jobs: up and answering, busy or not (a node running a job counts; a down, drained,
# failed or silent one, shown with a '*', does not).
usable() { sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /^(idle|allocated|mixed|completing|planned)$/ {print $1}' | sort -u | wc -l; }

if sinfo -h >/dev/null 2>&1 && [ "$(usable)" -ge "$NODES" ]; then
  echo "slurm: already running"; sinfo; exit 0
fi

mkdir -p "$STATE"/{ctld,spool,log,run} /etc/slurm /run/munge
# munge: one key, daemon as user munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key /run/munge && chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# node names resolve to this machine
names=$(seq -f "n%g" 1 "$NODES" | paste -sd' ')
grep -q "moe-slurm" /etc/hosts || echo "127.0.0.1 $names # moe-slurm" >> /etc/hosts

cat > /etc/slurm/slurm.conf <<CONF
ClusterName=moe
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=15
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001-$((17000 + NODES)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
CONF

# -c: a controller this script starts begins with no jobs (none of an earlier run come back)
pgrep -x slurmctld >/dev/null || slurmctld -c
for i in $(seq 1 "$NODES"); do
  pgrep -f "slurmd -N n$i\b" >/dev/null || slurmd -N "n$i"
done
for _ in $(seq 1 60); do
  [ "$(usable)" -ge "$NODES" ] && { sinfo; exit 0; }
  sleep 1
done
echo "slurm: $NODES nodes did not come up; see $STATE/log" >&2
sinfo >&2 || true
squeue >&2 || true
exit 1
