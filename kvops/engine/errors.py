"""Errors the engine reports to people: each says what was wrong and what to do. The base class and
`ConfigError` live in `kvops.schema.errors`, where kvops's config-file readers see them too."""

from __future__ import annotations

from kvops.schema.errors import EngineError


class CapacityError(EngineError):
    """The KV budget cannot hold what the configuration asks for."""


class InvalidRequestError(EngineError, ValueError):
    """A request is malformed or exceeds a limit; `field` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
