"""Upload vigil's dashboards to a running Grafana through grafana-client (Grafana's HTTP API).

Makes sure the folder exists (`GET /api/folders/<uid>`, else `POST /api/folders`), then posts
each dashboard to `POST /api/dashboards/db` with `overwrite: true`, so a push is repeatable.
Failures become one `PushError` line naming what went wrong; the token never appears in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vigil.collector.grafana import dashboards


class PushError(Exception):
    """A push that did not complete; the message is one line for the CLI."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushConfig:
    url: str
    token: str
    folder: str = "vigil"
    folder_uid: str = "vigil"
    timeout_s: float = 10.0  # one API call; Grafana answers these in milliseconds

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"Grafana URL must start with http:// or https://, got {self.url!r}")
        if not self.token:
            raise ValueError("a Grafana token is needed (--token or VIGIL_GRAFANA_TOKEN)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def _api(config: PushConfig) -> Any:
    try:
        from grafana_client.api import GrafanaApi
    except ImportError as exc:
        raise PushError("grafana-client is not installed: pip install 'vigil[grafana]'") from exc
    return GrafanaApi.from_url(config.url, credential=config.token, timeout=config.timeout_s)


def push(
    config: PushConfig,
    *,
    boards: dict[str, dict[str, Any]] | None = None,
    api_factory: Callable[[PushConfig], Any] = _api,
) -> list[str]:
    """Upload the dashboards; returns the uids pushed. Raises PushError."""
    try:
        from grafana_client.client import GrafanaException, GrafanaUnauthorizedError
    except ImportError as exc:
        raise PushError("grafana-client is not installed: pip install 'vigil[grafana]'") from exc
    boards = boards if boards is not None else dashboards.all_dashboards()
    api = api_factory(config)
    pushed = []
    try:
        _ensure_folder(api, config)
        for board in boards.values():
            api.dashboard.update_dashboard(
                {
                    "dashboard": {**board, "id": None},
                    "folderUid": config.folder_uid,
                    "overwrite": True,
                    "message": "vigil dashboards push",
                }
            )
            pushed.append(str(board["uid"]))
    except GrafanaUnauthorizedError as exc:
        raise PushError(f"Grafana at {config.url} refused the token (401)") from exc
    except GrafanaException as exc:
        detail = " ".join(str(exc.message).split())[:200]
        if not exc.status_code:  # no HTTP answer: refused, unresolvable, timed out
            raise PushError(f"cannot reach Grafana at {config.url}: {detail}") from exc
        raise PushError(f"Grafana at {config.url} answered {exc.status_code}: {detail}") from exc
    except OSError as exc:
        raise PushError(f"cannot reach Grafana at {config.url}: {exc}") from exc
    return pushed


def _ensure_folder(api: Any, config: PushConfig) -> None:
    from grafana_client.client import GrafanaClientError

    try:
        api.folder.get_folder(config.folder_uid)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(config.folder, uid=config.folder_uid)
