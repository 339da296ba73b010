from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pdgate.config import GatewaySettings, RegistrySettings, Role, ShimSettings


def test_defaults_are_usable() -> None:
    gw = GatewaySettings()
    assert gw.port == 8000
    assert gw.prefill_policy == "least_sse"
    assert RegistrySettings().url is None


def test_precedence_flags_over_env_over_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "pdgate.toml"
    cfg.write_text(
        '[gateway]\nport = 9000\nttft_timeout_s = 3.5\nprefill_policy = "round_robin"\n'
        '[shim]\nrole = "decode"\ncapacity = 3\n'
        '[registry]\nurl = "redis://example:6379/0"\n'
    )
    monkeypatch.setenv("PDGATE_GATEWAY_TTFT_TIMEOUT_S", "7")
    gw = GatewaySettings.load(cfg, prefill_policy="power_of_two")
    assert gw.port == 9000  # from TOML
    assert gw.ttft_timeout_s == 7  # env beats TOML
    assert gw.prefill_policy == "power_of_two"  # flag beats both
    shim = ShimSettings.load(cfg)
    assert shim.role is Role.DECODE
    assert shim.capacity == 3
    assert RegistrySettings.load(cfg).url == "redis://example:6379/0"
    # Loading with a file never leaks into a later load without one.
    assert GatewaySettings.load().port == 8000


def test_registry_url_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_REGISTRY_URL", "redis://127.0.0.1:6379/2")
    assert RegistrySettings.load().url == "redis://127.0.0.1:6379/2"


def test_invalid_values_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        GatewaySettings(ttft_timeout_s=0)
    with pytest.raises(ValidationError):
        RegistrySettings(heartbeat_interval_s=2, ttl_s=1)
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[gateway]\nno_such_setting = 1\n")
    with pytest.raises(ValidationError):
        GatewaySettings.load(cfg)


def test_the_configuration_page_documents_every_setting() -> None:
    from pdgate.config._docs import BEGIN, MODELS, settings_markdown

    for _table, model in MODELS:
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    # The page carries the generated table verbatim: `make docs` regenerates it
    # (`python -m pdgate.config._docs --update docs/configuration.md`).
    assert f"{BEGIN}\n{settings_markdown()}" in page
