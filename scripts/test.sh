#!/usr/bin/env bash
# The full test suite: install everything, then lint, type-check and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The dashboard browser test drives Debian's headless Chromium through Playwright
# (which must not download a browser of its own). Installed where we are root with apt;
# elsewhere that test skips and says why. Checked on every run: it is not part of the venv.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "elbowroom test: installing chromium (for the dashboard's browser test)" >&2
        if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
            >/dev/null 2>&1; then
            echo "elbowroom test: could not install chromium; the browser test will skip" >&2
        fi
    else
        echo "elbowroom test: no chromium (installing it needs root and apt); the browser test will skip" >&2
    fi
fi
.venv/bin/ruff check elbowroom tests benchmarks
.venv/bin/ruff format --check elbowroom tests benchmarks
.venv/bin/mypy
# -rs: every skip prints its reason (a broken install must not hide as a skip)
.venv/bin/pytest -q -rs -p no:cacheprovider "$@"
