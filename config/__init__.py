"""What every pdgate process shares, importing nothing else of pdgate's: the settings models
(settings.py), the wire protocol (wire.py, openai_api.py), asyncio helpers (aio.py) and the
uvicorn runner (server.py)."""

from pdgate.config.settings import (
    ClusterSettings,
    DispatchMode,
    GatewaySettings,
    PrefillAdmission,
    QueueOrder,
    RegistrySettings,
    ScenarioGroup,
    ServingStrategy,
    ShimSettings,
)
from pdgate.config.wire import Role

__all__ = [
    "ClusterSettings",
    "DispatchMode",
    "GatewaySettings",
    "PrefillAdmission",
    "QueueOrder",
    "RegistrySettings",
    "Role",
    "ScenarioGroup",
    "ServingStrategy",
    "ShimSettings",
]
