#!/usr/bin/env bash
# Type-checks the whole `vigil` package (core and every subsystem), and the test support that
# tests and benchmarks share (tests/support/), with mypy --strict settings from pyproject.toml.
# The subpackages live in top-level folders mapped onto `vigil` at install time, which mypy
# cannot see through an editable install; lay the package out as a wheel would (vigil/ with each
# folder inside it, as symlinks, so error paths name the real modules) under build/, with
# tests/support beside it, and check that.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=$root/build/typecheck
rm -rf "$tree"
mkdir -p "$tree/vigil"
for entry in vigil/*; do
  ln -s "$root/$entry" "$tree/vigil/"
done
for part in agent collector analyzer recovery trainer kernels integrations; do
  ln -s "$root/$part" "$tree/vigil/$part"
done
mkdir -p "$tree/tests"
ln -s "$root/tests/__init__.py" "$root/tests/support" "$tree/tests/"
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p vigil -p tests.support
