"""The collector service: ingest, storage, query API, web UI and /metrics.

vigil.collector: its public API is re-exported here as it lands.
"""

__all__: list[str] = []
