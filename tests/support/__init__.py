"""Test support, not product: helpers that tests and benchmarks share and the wheel never ships.

`pgcluster` starts a throwaway PostgreSQL cluster (initdb/pg_ctl in a temp dir); `simulator`
generates seeded multi-rank fault scenarios for the analyzer at scales no real job here reaches.
Tests import them as `tests.support.<module>` (pytest puts the repository root on `sys.path`);
bench scripts, run as `python bench/<name>.py` from the root, put the root on `sys.path` first.
Nothing under `vigil` may import this package.
"""
