#!/usr/bin/env bash
# Quick start: install everything, then serve the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The default model is loaded at start-up so the first request does not wait for it.
exec .venv/bin/elbowroom serve --preload smollm2-135m "$@"
