#!/usr/bin/env bash
# The full test suite: install everything, then lint, type-check and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check elbowroom tests benchmarks
.venv/bin/ruff format --check elbowroom tests benchmarks
.venv/bin/mypy
.venv/bin/pytest -q -p no:cacheprovider "$@"
