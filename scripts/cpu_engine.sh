#!/usr/bin/env bash
# Builds the LLM engine (xllamacpp, the version pyproject.toml pins) for this machine's CPU
# from its PyPI sdist with the local C++ compiler, and installs it into the venv in place
# of the PyPI wheel. Called by scripts/setup.sh when ELBOWROOM_ENGINE_BUILD=source
# (docs/runners.md, "A faster CPU engine"). Why: the PyPI wheel is built with an older
# compiler (GCC 10) for AVX2 only; on this project's machine the same sources built with
# GCC 12 for every instruction set of the CPU decode as fast as llama-server built the same
# way (benchmarks/results/engine_speed_source_build.md). It takes ~12-14 minutes on 2
# cores, once: the wheel is kept in ~/.cache/elbowroom/wheels and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ELBOWROOM_VENV:-.venv}
PY="$VENV/bin/python"
VERSION=$(sed -n 's/.*"xllamacpp==\([^"]*\)".*/\1/p' pyproject.toml)
CACHE=${ELBOWROOM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elbowroom}/wheels/xllamacpp-$VERSION-cpu-$(uname -m)

# shellcheck source=scripts/engine_sdist.sh
. scripts/engine_sdist.sh

say() { echo "elbowroom setup (engine): $*" >&2; }
die() { say "$*"; exit 1; }

[ -n "$VERSION" ] || die "cannot find the xllamacpp pin in pyproject.toml"
[ -x "$PY" ] || die "no venv at $VENV: run scripts/setup.sh"

# The instruction sets: on x86 every set this CPU has that ggml uses (what the benchmark's
# llama-server:native is built with), spelled out rather than GGML_NATIVE: a native build
# also compiles ggml's AMX path, which crashes on VMs that report AMX without granting its
# tile state. Elsewhere (ARM) the native build.
cpu_flags() {
    if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
        local flags opts="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
        local entry on need n
        for entry in SSE42:sse4_2 AVX:avx AVX2:avx2 F16C:f16c FMA:fma BMI2:bmi2 \
            AVX_VNNI:avx_vnni AVX512:avx512f,avx512cd,avx512vl,avx512dq,avx512bw \
            AVX512_VBMI:avx512vbmi AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
            on=ON
            IFS=, read -ra need <<<"${entry#*:}"
            for n in "${need[@]}"; do
                [[ $flags == *" $n "* ]] || on=OFF
            done
            opts="$opts -DGGML_${entry%%:*}=$on"
        done
        echo "$opts"
    else
        echo "-DGGML_NATIVE=ON"
    fi
}
FLAGS=$(cpu_flags)
# The cached wheel is for this version and these instruction sets.
CACHE=$CACHE-$(printf %s "$FLAGS" | cksum | cut -d' ' -f1)

if ! ls "$CACHE"/xllamacpp-*.whl >/dev/null 2>&1; then
    command -v "${CXX:-c++}" >/dev/null && command -v cmake >/dev/null ||
        die "building the engine needs a C++ compiler and cmake (apt-get install build-essential" \
            "cmake); or leave ELBOWROOM_ENGINE_BUILD unset for the PyPI wheel"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    say "building xllamacpp $VERSION for this CPU from source ($(${CXX:-c++} --version | head -1);" \
        "$FLAGS);" \
        "~14 min on 2 cores, once (kept in $CACHE)"
    sdist_wheel "$tmp" "$FLAGS"
    mkdir -p "$CACHE"
    cp "$tmp"/wheel/xllamacpp-*.whl "$CACHE"/
fi
"$PY" -m pip install -q --force-reinstall --no-deps "$CACHE"/xllamacpp-*.whl
"$PY" -c "import xllamacpp; print('elbowroom setup (engine): installed', xllamacpp.__file__)" >&2
