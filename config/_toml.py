"""A pydantic-settings source that reads one table of a TOML file.

All pdgate processes can share one file (``[registry]``, ``[gateway]``, ``[shim]``,
``[cluster]`` tables); each settings model reads only its own table.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource


class TomlTableSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None, table: str) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        if path is not None:
            with path.open("rb") as fh:
                doc = tomllib.load(fh)
            section = doc.get(table, {})
            if not isinstance(section, dict):
                raise ValueError(f"{path}: [{table}] must be a table")
            self._data = section

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)
