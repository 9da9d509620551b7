#!/usr/bin/env bash
# One command to set up a fresh machine for vigil development and CI:
# system packages the tests start for real, a virtual environment in .venv, and vigil with its
# dev extras installed editable. torch is pinned by constraints.txt to the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt_packages=(
    prometheus # the agent tests scrape the real exporter with a throwaway Prometheus
    postgresql # the collector tests start a throwaway PostgreSQL cluster (initdb/pg_ctl)
    chromium # the web UI's browser tests drive Debian's headless Chromium through Playwright
  )
  if [ ${#apt_packages[@]} -gt 0 ]; then
    missing=()
    for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
  fi
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,triton]'
# checkov (tests/helm/test_checkov.py) in an environment of its own: its pins (packaging,
# networkx) would downgrade what vigil's environment installs.
[ -x .venv/checkov/bin/checkov ] || "$python" -m venv .venv/checkov
.venv/checkov/bin/python -m pip install -q checkov==3.3.30
.venv/bin/vigil version
