#!/usr/bin/env bash
# Builds the LLM engine (xllamacpp, the version pyproject.toml pins) for this machine's CPU
# from its PyPI sdist with the local C++ compiler, and installs it into the venv in place
# of the PyPI wheel. Called by scripts/setup.sh when ELBOWROOM_ENGINE_BUILD=source
# (docs/runners.md, "A faster CPU engine"). Why: the PyPI wheel is built with an older
# compiler; on this project's machine the same sources built with GCC 12 decode ~10 %
# faster (benchmarks/results/engine_speed_source_build.md). It takes ~14 minutes on 2
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

# The instruction sets: on x86 the ones the PyPI wheel uses when this CPU has them (the
# compiler, not AVX-512, made the difference here), spelled out rather than GGML_NATIVE:
# a native build also compiles ggml's AMX path, which crashes on VMs that report AMX
# without granting its tile state. Elsewhere (ARM) the native build.
cpu_flags() {
    local flags
    if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
        flags=$(grep -m1 '^flags' /proc/cpuinfo)
        local opts="-DGGML_NATIVE=OFF"
        for pair in avx:AVX avx2:AVX2 f16c:F16C fma:FMA bmi2:BMI2; do
            if grep -qw "${pair%%:*}" <<<"$flags"; then
                opts="$opts -DGGML_${pair##*:}=ON"
            fi
        done
        echo "$opts"
    else
        echo "-DGGML_NATIVE=ON"
    fi
}

if ! ls "$CACHE"/xllamacpp-*.whl >/dev/null 2>&1; then
    command -v "${CXX:-c++}" >/dev/null && command -v cmake >/dev/null ||
        die "building the engine needs a C++ compiler and cmake (apt-get install build-essential" \
            "cmake); or leave ELBOWROOM_ENGINE_BUILD unset for the PyPI wheel"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    say "building xllamacpp $VERSION for this CPU from source ($(${CXX:-c++} --version | head -1));" \
        "~14 min on 2 cores, once (kept in $CACHE)"
    sdist_wheel "$tmp" "$(cpu_flags)"
    mkdir -p "$CACHE"
    cp "$tmp"/wheel/xllamacpp-*.whl "$CACHE"/
fi
"$PY" -m pip install -q --force-reinstall --no-deps "$CACHE"/xllamacpp-*.whl
"$PY" -c "import xllamacpp; print('elbowroom setup (engine): installed', xllamacpp.__file__)" >&2
