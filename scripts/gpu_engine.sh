#!/usr/bin/env bash
# Puts a GPU build of the LLM engine (xllamacpp, the version pyproject.toml pins) into the
# venv, replacing the CPU wheel. Called by scripts/setup.sh when ELBOWROOM_GPU is set;
# docs/gpu.md explains it.
#
#   scripts/gpu_engine.sh cuda     NVIDIA: the binding's CUDA wheel index when it has this
#                                  version for the driver, else a source build with nvcc
#   scripts/gpu_engine.sh metal    macOS: nothing to do, the PyPI wheel runs on Metal
#
# The source build is the recipe verified on an H200 (CUDA 13.0): the PyPI sdist, cython
# and versioneer as build dependencies, ~7 min on 16 cores. CUDA_ARCHITECTURES (default
# "native": the GPUs of this machine) and NPROC pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ELBOWROOM_VENV:-.venv}
PY="$VENV/bin/python"
KIND=${1:-}
VERSION=$(sed -n 's/.*"xllamacpp==\([^"]*\)".*/\1/p' pyproject.toml)
INDEX=https://xorbitsai.github.io/xllamacpp/whl

# shellcheck source=scripts/engine_sdist.sh
. scripts/engine_sdist.sh

say() { echo "elbowroom setup (gpu): $*" >&2; }
die() { say "$*"; exit 1; }

sees_a_gpu() {
    "$PY" - <<'EOF'
import sys
import xllamacpp

gpus = [d for d in xllamacpp.get_device_info() if str(d.get("name", "")).startswith("CUDA")]
print(", ".join(f"{d['name']} {d['description']}" for d in gpus) or "no CUDA device")
sys.exit(0 if gpus else 1)
EOF
}

cuda_wheel() {
    # nvidia-smi prints "CUDA Version: 13.0": the newest CUDA the driver runs.
    local driver need index
    driver=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\)\.\([0-9]\).*/\1\2/p' | head -1)
    for index in cu132 cu128; do
        need=${index#cu}
        [ "${driver:-0}" -ge "$need" ] || continue
        say "trying the $index wheel of xllamacpp $VERSION (driver supports CUDA ${driver:0:-1}.${driver: -1})"
        if "$PY" -m pip install -q --force-reinstall --no-deps --index-url "$INDEX/$index" \
            "xllamacpp==$VERSION" && sees_a_gpu; then
            return 0
        fi
    done
    return 1
}

cuda_source() {
    command -v nvcc >/dev/null ||
        die "no CUDA wheel of xllamacpp $VERSION works here and nvcc (the CUDA toolkit's" \
            "compiler) is not on PATH: install the CUDA toolkit 12.x or 13.x (or add its bin" \
            "folder to PATH) and run again, or leave ELBOWROOM_GPU unset for the CPU engine"
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    say "building xllamacpp $VERSION for CUDA from source with $(nvcc --version | tail -1) (~7 min)"
    sdist_wheel "$tmp" "" XLLAMACPP_BUILD_CUDA=1 \
        CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}"
    "$PY" -m pip install -q --force-reinstall --no-deps "$tmp"/wheel/xllamacpp-*.whl
    sees_a_gpu >&2 || die "the CUDA build of xllamacpp sees no GPU: check the driver (nvidia-smi)"
}

[ -n "$VERSION" ] || die "cannot find the xllamacpp pin in pyproject.toml"
[ -x "$PY" ] || die "no venv at $VENV: run scripts/setup.sh"
case "$KIND" in
metal)
    [ "$(uname -s)" = Darwin ] || die "ELBOWROOM_GPU=metal is for macOS on Apple Silicon"
    say "the PyPI wheel of xllamacpp runs on Metal already: nothing to install"
    ;;
cuda)
    [ "$(uname -s)" != Darwin ] ||
        die "macOS has no CUDA: leave ELBOWROOM_GPU unset (or metal), the PyPI wheel uses Metal"
    command -v nvidia-smi >/dev/null ||
        die "ELBOWROOM_GPU=cuda needs an NVIDIA driver (nvidia-smi not found): install it," \
            "or leave ELBOWROOM_GPU unset for the CPU engine"
    if cuda_wheel; then
        say "installed a prebuilt CUDA wheel"
    else
        cuda_source
    fi
    ;;
*)
    die "ELBOWROOM_GPU must be cuda or metal, not '$KIND'"
    ;;
esac
