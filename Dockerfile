# GPU image for megarl: NGC PyTorch (CUDA torch, transformer-engine, apex, NCCL) + SGLang + megarl.
#
#   docker build -t megarl:gpu .
#   docker run --gpus all --ipc=host --shm-size=16g megarl:gpu \
#       torchrun --nproc-per-node 8 -m megarl.train --config configs/...
#
# The NGC image already provides a CUDA build of torch and transformer-engine; megarl's
# requirements are satisfied by them (no torch reinstall).  SGLang pins its own torch version:
# pick the NGC release whose torch matches the SGLang release (see SGLang's install docs) or
# the install below replaces torch.  CUDA IPC weight sync needs --ipc=host.
ARG NGC_TAG=25.04-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ENV PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/megarl
# Dependencies first, for layer caching.
COPY setup.py README.md ./
COPY megarl/__init__.py megarl/__init__.py
RUN pip install "sglang[srt]>=0.5" \
 && pip install -e ".[gpu,dev]" \
 && python -c "import transformer_engine, megatron.core, sglang; print('megarl gpu deps ok')"

COPY . .
RUN pip install --no-deps -e .
