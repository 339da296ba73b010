"""Settings models shared by all pdgate processes."""

from config.settings import (
    ClusterSettings,
    DispatchMode,
    GatewaySettings,
    PrefillAdmission,
    QueueOrder,
    RegistrySettings,
    Role,
    ShimSettings,
)

__all__ = [
    "ClusterSettings",
    "DispatchMode",
    "GatewaySettings",
    "PrefillAdmission",
    "QueueOrder",
    "RegistrySettings",
    "Role",
    "ShimSettings",
]
