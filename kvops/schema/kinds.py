"""The kinds of inference server kvops reads, defined once.

A snapshot's `source`, the supervisor's `[[engines]] kind`, the adapters' detection and doctor's
per-server advice all take their kinds from here, so adding a server means adding it here first.
"""

from __future__ import annotations

from typing import Literal, get_args

# A kvops engine (its /stats), or a vLLM or SGLang server (its /metrics, through kvops.adapters).
EngineKind = Literal["kvops", "vllm", "sglang"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
# The servers kvops only watches: it cannot run them, and their remedies are their own flags.
EXTERNAL_KINDS: tuple[EngineKind, ...] = tuple(kind for kind in ENGINE_KINDS if kind != "kvops")

# What a watched engine is configured as: one of ENGINE_KINDS, or auto (recognised at the first poll).
WatchKind = Literal["auto", EngineKind]
WATCH_KINDS: tuple[str, ...] = get_args(WatchKind)
