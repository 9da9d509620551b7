"""`python -m vigil.trainer ARGS`: one rank of the trainer (what torchrun and `--nproc` launch)."""

from __future__ import annotations

import sys

from vigil.trainer import cli

if __name__ == "__main__":  # guard: DCP's PROCESS-mode async save re-imports __main__
    sys.exit(cli.main())
