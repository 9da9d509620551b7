"""Settings come from VIGIL_* variables and refuse bad values with a message."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil import env, settings


def test_defaults_and_env_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setenv(env.EnvVar.LOG_LEVEL, "debug")
    monkeypatch.setenv(env.EnvVar.COLLECTOR_URL, "http://collector:8080/")
    s = settings.CommonSettings()
    assert s.log_level == "DEBUG"
    assert s.collector_url == "http://collector:8080"
    assert s.data_dir == tmp_path / "vigil"
    assert s.output_dir is None


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        (env.EnvVar.LOG_LEVEL, "chatty", "chatty"),
        (env.EnvVar.COLLECTOR_URL, "collector:8080", "http://"),
        (env.EnvVar.LOG_FORMAT, "xml", "log_format"),
    ],
)
def test_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=needle):
        settings.CommonSettings()


def test_every_settings_field_is_a_declared_env_var() -> None:
    declared = {v.value for v in env.EnvVar}
    for name in settings.CommonSettings.model_fields:
        assert f"VIGIL_{name.upper()}" in declared, name
