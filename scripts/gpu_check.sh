#!/usr/bin/env bash
# `make gpu-check`: the GPU check on a machine with one NVIDIA GPU and no network. It needs the offline
# bundle, .gpu-bundle/ (`make gpu-bundle`, on a machine that reaches PyPI), travelling with the tree.
#
# 1. checks that this is the machine pyproject.toml describes ([tool.conf-kv.gpu-machine]: python3,
#    its torch, triton and transformers, a CUDA device), and stops saying how it differs otherwise;
# 2. installs the bundle's wheels into a scratch folder on PYTHONPATH, offline, never replacing a
#    package of the machine's own (its torch stays);
# 3. runs benchmarks/gpu_check/run.py with this script's arguments, the bundle's random-weight models as
#    the model cache.
#
# --dry-run (first argument), on any machine: the machine's differences are warnings, the wheels are
# installed for the GPU machine's python into a scratch folder (not used: they may not fit this
# python), and the check runs its parts with tiny shapes on the CPU with this python's packages.
#
#   PYTHON   the interpreter (default: python3, the machine's own)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-$PWD/.gpu-bundle}  # GPU_BUNDLE: another folder holding it
DRY_RUN=""
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
started=$SECONDS

stage() {  # stage NAME COMMAND...: run it and print how long it took
    local name=$1 since=$SECONDS
    shift
    echo "== $name"
    "$@"
    echo "== $name: $((SECONDS - since)) s"
}

if [ ! -f "$BUNDLE/manifest.json" ]; then
    echo "no offline bundle at $BUNDLE: run \`make gpu-bundle\` where PyPI is reachable and bring .gpu-bundle/ along" >&2
    exit 2
fi
stage "machine" "$PYTHON" -m scripts.gpu_bundle check-machine ${DRY_RUN:+--warn --no-cuda}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
stage "bundle" "$PYTHON" -m scripts.gpu_bundle install --bundle "$BUNDLE" --target "$SITE" ${DRY_RUN:+--cross}
if [ -z "$DRY_RUN" ]; then
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# The bundle's models; results name the commit the bundle recorded where the tree came without git.
export CONFKV_MODEL_CACHE="$BUNDLE/models" CONFKV_SOURCE="$BUNDLE/source.json" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
status=0
stage "gpu check" "$PYTHON" benchmarks/gpu_check/run.py ${DRY_RUN:+--dry-run} "$@" || status=$?
echo "== all: $((SECONDS - started)) s"
exit "$status"
