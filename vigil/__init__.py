"""vigil: profiling, monitoring and fault recovery for distributed PyTorch training.

The core package holds the wire contract (`vigil.schema`, `vigil.codec`), settings, the CLI entry
point and small utilities. It imports none of the subsystems (agent, collector, analyzer, recovery,
trainer, kernels). Importing it has no side effects: no logging setup, no threads, no engines.
"""

from vigil._version import __version__

__all__ = ["__version__"]
