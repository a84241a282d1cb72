"""The drafter registry (MLflow): versions, champion/challenger aliases, approvals, rollback, events."""

from adaflash.registry.client import RegistryClient
from adaflash.registry.errors import (
    NothingToRollBackError,
    RegistryError,
    RegistryUnavailableError,
    UnknownVersionError,
)
from adaflash.registry.server import RegistryServer
from adaflash.registry.versions import (
    ALIASES,
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    ActionRecord,
    Lineage,
    VersionInfo,
    model_name_for,
)

__all__ = [
    "ALIASES",
    "CHALLENGER",
    "CHAMPION",
    "PREVIOUS_CHAMPION",
    "ActionRecord",
    "Lineage",
    "NothingToRollBackError",
    "RegistryClient",
    "RegistryError",
    "RegistryServer",
    "RegistryUnavailableError",
    "UnknownVersionError",
    "VersionInfo",
    "model_name_for",
]
