#!/usr/bin/env bash
# The GPU check: one program on one GPU, under 8 minutes, ending in a table (one row per check:
# the sglang backend against the megatron actor, weight sync, sleep/wake, offload, bf16, GB/s,
# agent sessions continuing from input_ids),
# then the mixture-of-experts program (tests/gpu/test_moe_sglang.py, its own table, under 5
# minutes): SGLang's routed experts returned and replayed in the actor on one GPU, and EP=2
# weight sync into SGLang on two GPUs (a SKIP row, not a failure, when only one is present),
# then context parallelism on transformer-engine's attention (tests/gpu/test_context_parallel_te.py,
# CP=2 = CP=1 on two GPUs; a SKIP row with one; MEGARL_GPU_CP_TIMEOUT, default 240), then DeepSeek-V3
# and GLM-4.5 on TE and SGLang (tests/gpu/test_frontier_sglang.py; MEGARL_GPU_FRONTIER_TIMEOUT, default 300).
# Exit status 0 only if every row passed (or was skipped).  Run it in the Docker image (see Dockerfile):
#
#   docker run --gpus all --ipc=host --shm-size=16g megarl:gpu bash tests/gpu/run.sh
#
# MEGARL_GPU_CHECK_JSON=path also writes the rows as JSON (default: $OUT/gpu_check.json if $OUT
# is set); MEGARL_GPU_CHECK_TIMEOUT (seconds, default 470) bounds the dense program,
# MEGARL_GPU_MOE_TIMEOUT (default 300) the MoE one (its rows: $OUT/gpu_moe_check.json);
# MEGARL_GPU_EP_DEVICES (default 0,1 when two GPUs are visible) the GPUs of the EP=2 row.
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
# one more check program on one GPU: its rows' JSON beside the dense one's, bounded by its timeout
run_program() {  # NAME SUFFIX TIMEOUT_SECONDS SCRIPT
    local json="${MEGARL_GPU_CHECK_JSON:+${MEGARL_GPU_CHECK_JSON%.json}_$2.json}"
    json="${json:-${OUT:+$OUT/gpu_$2_check.json}}"
    local args=()
    [ -n "$json" ] && args+=(--json "$json")
    timeout --signal=TERM --kill-after=20 "$3" python3 "$4" "${args[@]}"
    local prc=$?
    if [ "$prc" -eq 124 ]; then
        echo "$1 GPU check: timed out after $3 s (rows printed above finished)"
    fi
    [ "$rc" -eq 0 ] && rc=$prc
}
if [ -z "${MEGARL_GPU_EP_DEVICES:-}" ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    export MEGARL_GPU_EP_DEVICES=0,1
fi
run_program MoE moe "${MEGARL_GPU_MOE_TIMEOUT:-300}" tests/gpu/test_moe_sglang.py
cp_json="${MEGARL_GPU_CHECK_JSON:+${MEGARL_GPU_CHECK_JSON%.json}_cp.json}"
cp_json="${cp_json:-${OUT:+$OUT/gpu_cp_check.json}}"
cp_args=()
[ -n "$cp_json" ] && cp_args+=(--json "$cp_json")
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES="${MEGARL_GPU_EP_DEVICES:-0,1}" timeout --signal=TERM --kill-after=20 \
        "${MEGARL_GPU_CP_TIMEOUT:-240}" python3 -m torch.distributed.run --nproc-per-node 2 \
        tests/gpu/test_context_parallel_te.py "${cp_args[@]}"
else
    python3 tests/gpu/test_context_parallel_te.py "${cp_args[@]}"  # a SKIP row: one GPU
fi
cp_rc=$?
[ "$rc" -eq 0 ] && rc=$cp_rc
run_program frontier-family frontier "${MEGARL_GPU_FRONTIER_TIMEOUT:-300}" tests/gpu/test_frontier_sglang.py
exit "$rc"
