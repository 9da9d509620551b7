"""The collector's web UI: jobs, a job's figures, findings and recovery, the rank x step heat map,
drill-down, timelines and trace download, served under /ui by `vigil collector`.

`mount(app, ctx)` adds it to the collector's FastAPI app. Reads through the collector's query
layer; must not write to the store, and imports nothing outside the collector and the core.
"""

from __future__ import annotations

from vigil.collector.ui.routes import mount

__all__ = ["mount"]
