#!/bin/sh
# Slurm epilog for V-IPU partitions on the IPU emulator daemon: removes the job's
# partition (made by vipu_prolog.sh; same variables). A partition a process of the job
# still uses is not removed: the reason is on stderr and the exit status is not 0.
set -eu
: "${SLURM_JOB_ID:?the epilog runs for a Slurm job: SLURM_JOB_ID is not set}"
name="${VIPU_PARTITION_PREFIX:-slurm-}${SLURM_JOB_ID}"
${IPU_EMULATOR:-ipu-emulator} vipu remove partition "$name" >&2
