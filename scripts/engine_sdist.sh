# Sourced by scripts/cpu_engine.sh and scripts/gpu_engine.sh (needs PY and VERSION set).
#
#   sdist_wheel DIR "CMAKE OPTIONS" [NAME=VALUE ...]
#
# Builds the pinned xllamacpp from its PyPI sdist into DIR/wheel/, with the extra cmake
# options and environment (e.g. XLLAMACPP_BUILD_CUDA=1); NPROC jobs (default: all cores).
sdist_wheel() {
    local dir=$1 cmake=$2
    shift 2
    "$PY" -m pip install -q "cython>=3.1" versioneer
    "$PY" -m pip download -q --no-binary :all: --no-deps -d "$dir" "xllamacpp==$VERSION"
    tar xzf "$dir"/xllamacpp-*.tar.gz -C "$dir"
    # BoringSSL and llguidance would be cloned from the network at build time: off.
    (cd "$dir"/xllamacpp-"$VERSION" &&
        env "$@" NPROC="${NPROC:-$(nproc)}" \
            CMAKE_ARGS="-DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_LLGUIDANCE=OFF $cmake" \
            "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$dir/wheel" .)
}
