"""Exit codes of `vigil train`, so a supervisor can tell why a rank stopped (no torch here)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1  # an unexpected error (a collective timeout, a crashed peer)
    BAD_CONFIG = 2  # the recipe or flags are wrong: restarting will not help
    NONFINITE_LOSS = 3  # loss stayed NaN/inf: restart from an older checkpoint or fix the recipe
    INJECTED_CRASH = 13  # an injected crash (vigil.trainer.faults), told apart from real ones
    STOPPED = 75  # stopped on request after a checkpoint (EX_TEMPFAIL): resume later
