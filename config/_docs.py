"""The settings reference in README.md is generated from the models, so it cannot drift."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from config.settings import ClusterSettings, GatewaySettings, RegistrySettings, ShimSettings

MODELS: list[tuple[str, type[BaseSettings]]] = [
    ("gateway", GatewaySettings),
    ("registry", RegistrySettings),
    ("shim", ShimSettings),
    ("cluster", ClusterSettings),
]


def env_name(model: type[BaseSettings], field: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{field}".upper()


def settings_markdown() -> str:
    lines: list[str] = []
    for table, model in MODELS:
        lines += [
            f"#### `[{table}]`",
            "",
            "| setting | environment | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, info in model.model_fields.items():
            default = info.get_default(call_default_factory=True)
            shown = "unset" if default is None else f"`{getattr(default, 'value', default)}`"
            doc = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{name}` | `{env_name(model, name)}` | {shown} | {doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(settings_markdown())
