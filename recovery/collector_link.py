"""The controller's link to the collector: findings in, actions out (HTTP, vigil's wire codec).

`CollectorFindings` polls the analyzer's findings for one job; `CollectorActions` posts each
action's new state (and the controller's own crash findings) through ingest, where the collector
upserts them by id. Both are best effort:
a collector that is down costs visibility, never the recovery (the journal is the truth).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from vigil import api, codec
from vigil.schema import Action, Finding

log = logging.getLogger(__name__)

# 5 s: a poll that takes longer than this is a collector in trouble; the next poll tries again.
DEFAULT_TIMEOUT_S = 5.0


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass(kw_only=True)
class CollectorFindings:
    url: str
    job_id: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: httpx.Client = field(default_factory=httpx.Client)

    def fetch(self) -> Sequence[Finding]:
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/jobs/{self.job_id}/findings"
        try:
            response = self.client.get(path, headers=_headers(self.token), timeout=self.timeout_s)
            response.raise_for_status()
            rows: list[dict[str, Any]] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not fetch findings from %s: %s", path, exc)
            return []
        findings = []
        for row in rows:
            try:
                clean = {k: v for k, v in row.items() if v is not None}
                findings.append(msgspec.convert(clean, Finding))
            except msgspec.ValidationError as exc:
                log.warning("skipping a finding the collector sent: %s", exc)
        return findings


@dataclass(kw_only=True)
class CollectorActions:
    url: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: httpx.Client = field(default_factory=httpx.Client)

    def publish(self, record: Action | Finding) -> None:
        if isinstance(record, Action):
            batch_id = f"action-{record.action_id}-{record.state.value}"
        else:
            batch_id = f"finding-{record.finding_id}"
        frame = codec.encode_batch([record], batch_id=batch_id, source="controller")
        headers = {
            "Content-Type": api.BATCH_MEDIA_TYPE,
            api.BATCH_ID_HEADER: batch_id,
            **_headers(self.token),
        }
        response = self.client.post(
            f"{self.url.rstrip('/')}{api.INGEST_PATH}",
            content=frame,
            headers=headers,
            timeout=self.timeout_s,
        )
        response.raise_for_status()
