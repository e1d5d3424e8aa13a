#!/bin/sh
# Slurm epilog for V-IPU partitions on the IPU emulator daemon: removes the job's
# partition (made by vipu_prolog.sh; same variables). A partition still in use (a job
# process that was killed is released by the daemon within a moment) is retried once a
# second, VIPU_REMOVE_TRIES times (default 10); then, or on any other refusal, the
# reason is on stderr and the exit status is not 0.
set -eu
: "${SLURM_JOB_ID:?the epilog runs for a Slurm job: SLURM_JOB_ID is not set}"
name="${VIPU_PARTITION_PREFIX:-slurm-}${SLURM_JOB_ID}"
tries="${VIPU_REMOVE_TRIES:-10}"
while :; do
    if out=$(${IPU_EMULATOR:-ipu-emulator} vipu remove partition "$name" 2>&1); then
        echo "$out" >&2
        exit 0
    fi
    tries=$((tries - 1))
    case "$out" in
        *"is in use"*) [ "$tries" -gt 0 ] && { sleep 1; continue; } ;;
    esac
    echo "$out" >&2
    exit 1
done
