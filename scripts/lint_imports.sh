#!/usr/bin/env bash
# Checks the dependency contracts in pyproject.toml with import-linter.
# The subpackages live in top-level folders mapped onto `vigil` at install time, which
# import-linter cannot see through an editable install; lay the package out as a wheel would
# (vigil/ with each folder inside it) in a temp dir and lint that.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
cp -r vigil "$tree/vigil"
for part in agent collector analyzer recovery trainer kernels integrations; do
  cp -r "$part" "$tree/vigil/$part"
done
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
root=$PWD
(cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/lint-imports" --no-cache "$root/pyproject.toml")
