"""Pure detection logic (stragglers, hangs, MFU drops, imbalance) and trace importers.

No web framework, database, Kubernetes or torch imports (import-linter contract). Streaming use:
`StreamingAnalyzer` (the collector's `StreamAnalyzer` hook); offline use: `analyze_path` (what
`vigil analyze` runs), `analyze_records` and `analyze_arrays`; importers: `kineto`,
`flight_recorder`. (The seeded fault-scenario simulator that feeds tests and benchmarks is test
support, `tests/support/simulator.py`, and does not ship.)
"""

from vigil.analyzer import flight_recorder, kineto, kineto_analysis
from vigil.analyzer.arrays import StepArrays, from_records
from vigil.analyzer.config import AnalyzerConfig, HangConfig, MfuConfig, StragglerConfig
from vigil.analyzer.engine import analyze_arrays, analyze_records
from vigil.analyzer.offline import Report, analyze_path
from vigil.analyzer.streaming import StreamingAnalyzer

__all__ = [
    "AnalyzerConfig",
    "HangConfig",
    "MfuConfig",
    "Report",
    "StepArrays",
    "StragglerConfig",
    "StreamingAnalyzer",
    "analyze_arrays",
    "analyze_path",
    "analyze_records",
    "flight_recorder",
    "from_records",
    "kineto",
    "kineto_analysis",
]
