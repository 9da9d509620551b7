"""Recovery policy: a pure table from findings to actions.

Pure by contract (import-linter, pyproject.toml): no web framework, database, Kubernetes client or
torch here; executors carry out what the policy decides. The table itself arrives with the recovery
controller; this module exists now so the purity contract is enforced from the first line.
"""

from __future__ import annotations

__all__: list[str] = []
