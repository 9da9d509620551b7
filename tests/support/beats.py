"""Feeding heartbeats to a hang tracker the two ways the analyzer does."""

from __future__ import annotations

from collections.abc import Sequence

from vigil import schema
from vigil.analyzer import hangs


def feed(tracker: hangs.HangTracker, beats: Sequence[schema.Heartbeat], *, batched: bool) -> None:
    """`beats` as one streaming batch (`observe_heartbeats`, vectorised) or one by one."""
    if batched:
        tracker.observe_heartbeats(beats)
    else:
        for beat in beats:
            tracker.observe_heartbeat(beat)
