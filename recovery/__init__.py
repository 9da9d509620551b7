"""The recovery controller: pure policy, checkpoint management and executors.

Executors: a local supervisor and, later, Kubernetes. Its public API is re-exported here as it
lands.
"""

__all__: list[str] = []
