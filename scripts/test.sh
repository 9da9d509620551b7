#!/usr/bin/env bash
# Runs the whole test suite (unit, integration, e2e; gpu tests skip without CUDA).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest "$@"
