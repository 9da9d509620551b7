"""The collector service: ingest, storage (SQLite/PostgreSQL), query API and /metrics.

`create_app(settings, analyzer=...)` builds the FastAPI app; `vigil collector` serves it. The
analyzer plugs in through the `StreamAnalyzer` protocol.
"""

from vigil.collector.analyzer_runner import DueAnalyzer, StreamAnalyzer, TickingAnalyzer
from vigil.collector.app import create_app
from vigil.collector.settings import CollectorSettings
from vigil.collector.store import IngestResult, Store, StoreConfig

__all__ = [
    "CollectorSettings",
    "DueAnalyzer",
    "IngestResult",
    "Store",
    "StoreConfig",
    "StreamAnalyzer",
    "TickingAnalyzer",
    "create_app",
]
