"""Settings models shared by all pdgate processes."""

from config.settings import (
    ClusterSettings,
    GatewaySettings,
    PrefillAdmission,
    RegistrySettings,
    Role,
    ShimSettings,
)

__all__ = [
    "ClusterSettings",
    "GatewaySettings",
    "PrefillAdmission",
    "RegistrySettings",
    "Role",
    "ShimSettings",
]
