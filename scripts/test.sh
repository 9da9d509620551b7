#!/usr/bin/env bash
# Runs the whole test suite (unit, integration, e2e; gpu tests skip without CUDA).
# Without arguments it runs in two parts: the tests that stay in one process, on every core at
# once (pytest-xdist, two workers), then the multi-process jobs (`e2e`) and the tests that judge
# CPU time on an idle core (`serial`) one at a time, since each of those uses every core or
# needs one to itself, and several judge what their jobs' timings show.
# Arguments go to a single pytest run as they are, e.g. `scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [ "$#" -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi
status=0
"$py" -m pytest -m "not e2e and not serial" -n 2 || status=$?
"$py" -m pytest -m "e2e or serial" || { e2e=$?; [ "$status" -ne 0 ] || status=$e2e; }
exit "$status"
