#!/bin/bash
# Multi-node megarl job on Slurm: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch launch/multinode.sh CONFIG.yaml [key=value ...]
#   sbatch --nodes=4 launch/multinode.sh configs/grpo_qwen2_7b.yaml parallel.tp=4
#
# The job's log is <job name>-<job id>.out in the directory you submit from (Slurm opens it before
# this script runs, so it must be a directory that exists at submission; a requeued job appends
# to it).  To put logs elsewhere, create the directory first:
#   mkdir -p logs && sbatch --output=logs/%x-%j.out launch/multinode.sh CONFIG.yaml ...
#
# CPU nodes (gloo; what the two-node cluster in CI runs): GPUS_PER_NODE=0, and the directives that
# name GPUs and cores overridden on the command line, e.g.
#   GPUS_PER_NODE=0 MEGARL_PROCS_PER_NODE=1 sbatch --gpus-per-node=0 --cpus-per-task=2 launch/multinode.sh CONFIG.yaml
#
# Environment knobs: GPUS_PER_NODE (default 8), MEGARL_PROCS_PER_NODE (processes per node: default
# GPUS_PER_NODE, or 1 on CPU nodes), MASTER_PORT (29500), MEGARL_ENTRY (the python
# module to run, default megarl.train), MEGARL_EXTRA_TORCHRUN_ARGS, MEGARL_RUN_DIR (default
# runs/<job name>-<job id>), MEGARL_MAX_REQUEUES (after a crash; default 3).
#
# Time limits and requeues: the run directory is fixed by the job id, which a requeued job keeps,
# and the trainer runs with trainer.resume=auto, so a requeued job continues from the last
# checkpoint.  Slurm signals this script (USR1) 10 minutes before the time limit; the script
# writes <run dir>/STOP, the trainer checkpoints at its next commit and exits, and the script
# requeues the job.  A run that finished writes <run dir>/DONE and is never requeued; a crash is
# requeued at most MEGARL_MAX_REQUEUES times (SLURM_RESTART_COUNT counts them).  A node lost
# mid-run is named by the surviving ranks within parallel.peer_timeout_s (they exit 75); Slurm sets
# the node down after SlurmdTimeout and requeues the job, which resumes once it has its nodes.
#SBATCH --job-name=megarl
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: sbatch launch/multinode.sh CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
if [ ! -f "$CONFIG" ]; then
  echo "error: config file '$CONFIG' not found" >&2
  exit 2
fi

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [ "$GPUS_PER_NODE" = 0 ]; then
  PROCS_PER_NODE=${MEGARL_PROCS_PER_NODE:-1}
  DEVICES="$PROCS_PER_NODE CPU processes (gloo)"
  # the node's cores shared by its processes (torchrun would otherwise leave each one thread)
  CPU_THREADS=$(( ${SLURM_CPUS_PER_TASK:-1} / PROCS_PER_NODE ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPU_THREADS > 0 ? CPU_THREADS : 1 ))}
else
  PROCS_PER_NODE=${MEGARL_PROCS_PER_NODE:-$GPUS_PER_NODE}
  DEVICES="$GPUS_PER_NODE GPUs"
fi
RUN_DIR=${MEGARL_RUN_DIR:-runs/${SLURM_JOB_NAME:-megarl}-${SLURM_JOB_ID:?run under sbatch/salloc (SLURM_JOB_ID is unset)}}
MAX_REQUEUES=${MEGARL_MAX_REQUEUES:-3}

# Slurm's warning of the time limit (USR1) from here on: bash's default for USR1 would end the job.
# The trainer removes a STOP older than this launch's stamp as the last stop's, and honours one
# written since (a warning that came while it started).
export MEGARL_LAUNCH_TIME=$(date +%s.%N)
STOP_REQUESTED=0
on_time_limit() {
  STOP_REQUESTED=1
  mkdir -p "$RUN_DIR" && touch "$RUN_DIR/STOP"
  echo "megarl: time limit near; asked the trainer to checkpoint and stop ($RUN_DIR/STOP)"
}
trap on_time_limit USR1

MASTER_PORT=${MASTER_PORT:-29500}
MEGARL_ENTRY=${MEGARL_ENTRY:-megarl.train}
NNODES=${SLURM_NNODES:?run under sbatch/salloc (SLURM_NNODES is unset)}
# awk reads to the end: `head` would close the pipe early and pipefail would turn SIGPIPE into a failure
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk '{print $1}')

echo "megarl: $NNODES nodes x $DEVICES, rendezvous $HEAD_ADDR:$MASTER_PORT, entry $MEGARL_ENTRY, run dir $RUN_DIR (restart ${SLURM_RESTART_COUNT:-0})"
# NCCL over the node's fabric; CUDA_DEVICE_MAX_CONNECTIONS=1 is what megatron's TP overlap expects.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# srun in the background: bash runs a trap only between commands, and `wait` returns on a signal
# shellcheck disable=SC2086
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$PROCS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_ADDR:$MASTER_PORT" \
    ${MEGARL_EXTRA_TORCHRUN_ARGS:-} \
    -m "$MEGARL_ENTRY" --config "$CONFIG" "trainer.run_dir=$RUN_DIR" trainer.resume=auto "$@" &
SRUN_PID=$!
RC=0
while true; do
  wait "$SRUN_PID" && RC=0 || RC=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break  # still running: wait was interrupted by the signal
done

if [ -f "$RUN_DIR/DONE" ]; then
  echo "megarl: run finished ($RUN_DIR/DONE)"
  exit "$RC"
fi
if [ "$STOP_REQUESTED" = 1 ] || { [ "$RC" != 0 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; }; then
  echo "megarl: requeueing job $SLURM_JOB_ID (exit status $RC); it resumes from $RUN_DIR/checkpoints/latest"
  scontrol requeue "$SLURM_JOB_ID"
elif [ "$RC" != 0 ]; then
  echo "megarl: not requeued: the trainer failed (exit status $RC) after ${SLURM_RESTART_COUNT:-0} requeues (MEGARL_MAX_REQUEUES=$MAX_REQUEUES); the reason is above"
fi
exit "$RC"
