"""vigil's Grafana dashboards and Prometheus rules, generated from code (`vigil dashboards`).

`dashboards` holds the four dashboards, `rules` the recording and alerting rules, `builder` the
JSON shapes, `export` the folder layout with Grafana provisioning files, `push` the upload
through Grafana's API. Imports nothing of the collector's service code.
"""

from vigil.collector.grafana import builder, dashboards, export, ops_dashboards, panels, push, rules

__all__ = ["builder", "dashboards", "export", "ops_dashboards", "panels", "push", "rules"]
