"""Errors whose message is meant for a person: each says what was wrong and what to do.

Defined here, below everything, because both sides raise and catch them: the engine (bad settings,
a model it cannot load) and kvops's tools that read config files (`kvops.config_files`, the
supervisor's config, vLLM's flags). The engine's own errors (`kvops.engine.errors`) derive from
`EngineError`."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: the message is meant for the person running the engine."""


class ConfigError(EngineError, ValueError):
    """A setting is invalid (bad value, model path missing, architecture unsupported)."""
