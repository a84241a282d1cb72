"""The drafter registry (MLflow): versions, champion/challenger aliases, approvals, rollback, events."""

from adaflash.registry.client import (
    ALIASES,
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    ActionRecord,
    Lineage,
    RegistryClient,
    VersionInfo,
    model_name_for,
)
from adaflash.registry.errors import (
    NothingToRollBackError,
    RegistryError,
    RegistryUnavailableError,
    UnknownVersionError,
)
from adaflash.registry.server import RegistryServer

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
