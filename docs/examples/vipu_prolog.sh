#!/bin/sh
# Slurm prolog (TaskProlog style) for V-IPU partitions on the IPU emulator daemon:
# creates one partition per job and prints the line that gives the job its name.
#
#   SLURM_JOB_ID          the job (required); the partition is "${VIPU_PARTITION_PREFIX}${SLURM_JOB_ID}"
#   VIPU_PARTITION_SIZE   IPUs for the job (a power of 2; default 1)
#   VIPU_PARTITION_PREFIX name prefix (default "slurm-")
#   VIPU_RECONFIGURABLE   non-empty: --reconfigurable
#   IPU_EMULATOR          the command to run (default "ipu-emulator")
#   IPU_EMULATOR_DAEMON   the daemon's socket (default $IPU_EMULATOR_HOME/daemon.sock)
#
# Output on success: "export IPUOF_VIPU_API_PARTITION_ID=<name>" (Slurm's TaskProlog
# puts it into the job's environment). On failure: the reason on stderr, exit status != 0.
set -eu
: "${SLURM_JOB_ID:?the prolog runs for a Slurm job: SLURM_JOB_ID is not set}"
name="${VIPU_PARTITION_PREFIX:-slurm-}${SLURM_JOB_ID}"
size="${VIPU_PARTITION_SIZE:-1}"
${IPU_EMULATOR:-ipu-emulator} vipu create partition "$name" --size "$size" \
    ${VIPU_RECONFIGURABLE:+--reconfigurable} >&2
echo "export IPUOF_VIPU_API_PARTITION_ID=$name"
