# GPU image for megarl: SGLang's own image (CUDA 13, and the torch, transformers and kernels that
# SGLang pins, built by SGLang), plus transformer-engine and megatron-core for that torch, plus
# megarl.  Every version is pinned in docker/requirements-gpu.txt, and the base image's tag is its
# sglang pin; tests/test_gpu_requirements.py resolves that set with pip on CPU in CI, so a
# conflicting pin fails there rather than in this build.  Details: docs/gpu.md.
#
#   docker build -t megarl:gpu .
#   docker run --gpus all --ipc=host --shm-size=16g megarl:gpu bash tests/gpu/run.sh
#   docker run --gpus all --ipc=host --shm-size=16g megarl:gpu \
#       torchrun --nproc-per-node 8 -m megarl.train --config configs/grpo_qwen2_7b.yaml ...
#
# CUDA IPC weight sync needs --ipc=host.  For a byte-identical base, pass the tag's digest:
#   docker build --build-arg SGLANG_IMAGE=lmsysorg/sglang@sha256:<digest> -t megarl:gpu .
# (an image whose sglang, torch or transformers differ from the pins fails the check below).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    NVTE_FRAMEWORK=pytorch \
    CUDA_DEVICE_MAX_CONNECTIONS=1

# bubblewrap: the private root reward.fn=code_exec runs candidate programs in (docs/rewards.md)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/megarl
COPY docker/requirements-gpu.txt docker/check_pins.py docker/
COPY setup.py README.md ./
COPY megarl/__init__.py megarl/__init__.py
# One resolution of the pins together with megarl's own requirements.  The image already holds
# sglang, torch and transformers at their pinned versions, so pip keeps them (and fails rather
# than replace them).  --no-build-isolation: transformer-engine-torch is an sdist and must build
# against the image's torch (and CUDA toolkit), not against a torch fetched into a build env.
RUN python3 -m pip install --no-build-isolation -r docker/requirements-gpu.txt -e ".[gpu,dev]" \
 && python3 docker/check_pins.py docker/requirements-gpu.txt

COPY . .
RUN python3 -m pip install --no-deps --no-build-isolation -e . \
 && python3 docker/check_pins.py docker/requirements-gpu.txt
