#!/bin/bash
# Multi-node megarl job on Slurm: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch launch/multinode.sh CONFIG.yaml [key=value ...]
#   sbatch --nodes=4 launch/multinode.sh configs/grpo_qwen2_7b.yaml parallel.tp=4
#
# Environment knobs: GPUS_PER_NODE (default 8), MASTER_PORT (29500), MEGARL_ENTRY (the python
# module to run, default megarl.train), MEGARL_EXTRA_TORCHRUN_ARGS.
#SBATCH --job-name=megarl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
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
MASTER_PORT=${MASTER_PORT:-29500}
MEGARL_ENTRY=${MEGARL_ENTRY:-megarl.train}
NNODES=${SLURM_NNODES:?run under sbatch/salloc (SLURM_NNODES is unset)}
# awk reads to the end: `head` would close the pipe early and pipefail would turn SIGPIPE into a failure
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk '{print $1}')
mkdir -p logs

echo "megarl: $NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $HEAD_ADDR:$MASTER_PORT, entry $MEGARL_ENTRY"
# NCCL over the node's fabric; CUDA_DEVICE_MAX_CONNECTIONS=1 is what megatron's TP overlap expects.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# shellcheck disable=SC2086
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_ADDR:$MASTER_PORT" \
    ${MEGARL_EXTRA_TORCHRUN_ARGS:-} \
    -m "$MEGARL_ENTRY" --config "$CONFIG" "$@"
