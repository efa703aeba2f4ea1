#!/usr/bin/env bash
# The GPU check: one program on one GPU, under 8 minutes, ending in a table (one row per check:
# the sglang backend against the megatron actor, weight sync, sleep/wake, offload, bf16, GB/s).
# Exit status 0 only if every row passed.  Run it in the Docker image (see Dockerfile):
#
#   docker run --gpus all --ipc=host --shm-size=16g megarl:gpu bash tests/gpu/run.sh
#
# MEGARL_GPU_CHECK_JSON=path also writes the rows as JSON (default: $OUT/gpu_check.json if $OUT
# is set); MEGARL_GPU_CHECK_TIMEOUT (seconds, default 470) bounds the whole run.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
json="${MEGARL_GPU_CHECK_JSON:-${OUT:+$OUT/gpu_check.json}}"
args=()
[ -n "$json" ] && args+=(--json "$json")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c 'import sglang, torch; print(f"sglang {sglang.__version__}, torch {torch.__version__}")' 2>/dev/null || true
timeout --signal=TERM --kill-after=20 "${MEGARL_GPU_CHECK_TIMEOUT:-470}" \
    python3 tests/gpu/test_sglang_backend.py "${args[@]}"
rc=$?
if [ "$rc" -eq 124 ]; then
    echo "GPU check: timed out after ${MEGARL_GPU_CHECK_TIMEOUT:-470} s (rows printed above finished)"
fi
exit "$rc"
