#!/usr/bin/env bash
# Stop the one-machine Slurm cluster started by slurm/local/start.sh (jobs are cancelled).
set -u
STATE=${MOE_SLURM_STATE:-/var/tmp/moe-slurm}
scancel --user="$(id -un)" 2>/dev/null || true
pkill -x slurmd 2>/dev/null || true
pkill -x slurmctld 2>/dev/null || true
sleep 1
rm -rf "$STATE"/ctld/* "$STATE"/run/*
echo "slurm: stopped"
