"""Settings shared by every vigil process, read from VIGIL_* variables (see `vigil.env`).

Build them in `main()` or `create_app(settings)`, never at import time. Subsystems subclass
`CommonSettings` for their own fields so one prefix and one validation style hold everywhere.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class LogFormat(enum.StrEnum):
    PLAIN = "plain"
    JSON = "json"


def default_data_dir() -> Path:
    """The user's data directory (XDG), where the embedded store and spools live."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "vigil"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VIGIL_", extra="ignore", frozen=True)

    # INFO: one line per lifecycle event; per-record logging would swamp a 1,000-rank job.
    log_level: str = "INFO"
    log_format: LogFormat = LogFormat.PLAIN
    data_dir: Path = Path()
    dev_mode: bool = False
    collector_url: str | None = None
    token: str | None = None
    output_dir: Path | None = None

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(
                f"log level {value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
            )
        return level

    @field_validator("data_dir")
    @classmethod
    def _data_dir_default(cls, value: Path) -> Path:
        return value if str(value) not in ("", ".") else default_data_dir()

    @field_validator("collector_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"collector URL {value!r} must start with http:// or https://")
        return value.rstrip("/")
