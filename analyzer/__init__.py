"""Pure detection logic (stragglers, hangs, MFU drops, node health) and trace importers.

No web framework, database, Kubernetes or torch imports (import-linter contract). Its public API
is re-exported here as it lands.
"""

__all__: list[str] = []
