#!/usr/bin/env bash
# Quick start: install everything, then serve the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/elbowroom serve "$@"
