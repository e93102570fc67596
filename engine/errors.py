"""Errors the engine reports to people: each says what was wrong and what to do."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: the message is meant for the person running the engine."""


class ConfigError(EngineError, ValueError):
    """A setting is invalid (bad value, model path missing, architecture unsupported)."""


class CapacityError(EngineError):
    """The KV budget cannot hold what the configuration asks for."""


class InvalidRequestError(EngineError, ValueError):
    """A request is malformed or exceeds a limit; `field` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
