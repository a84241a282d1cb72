"""Expected registry failures: each is an `AdaFlashError`, so the CLI prints one line and exits 2."""

from __future__ import annotations

from adaflash.errors import AdaFlashError


class RegistryError(AdaFlashError):
    """A registry action cannot be carried out as asked."""


class RegistryUnavailableError(RegistryError):
    """The MLflow tracking/registry server cannot be reached or started."""


class UnknownVersionError(RegistryError):
    """The model version (or alias) does not exist in this target's registered model."""


class NothingToRollBackError(RegistryError):
    """There is no champion, or no previous champion to restore."""
