"""SDK hooks inside training processes and the per-node agent daemon.

vigil.agent must not import vigil.collector (import-linter contract). Its public API is
re-exported here as it lands.
"""

__all__: list[str] = []
