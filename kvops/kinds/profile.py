"""What kvops knows about one kind of inference server, in one object: `EngineProfile`.

Each module of `kvops.kinds` (kvops.py, vllm.py, sglang.py, ...) defines exactly one profile, and is the
only place that knows its kind: how to recognise its server, its metric names per version, the flag that
sets each setting and the remedy wording that names it, and what it can do. Rules, doctor and the supervisor
ask the profile of a snapshot's source; none of them branches on a kind's name. A profile is data and a scrape
reader: how kvops starts a kind it manages is its launcher's (kvops.supervisor.launchers), and how it polls a
live server is kvops.watching's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvops.adapters.names import MetricSource
from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import Snapshot

# A scrape read into a snapshot: (scrape, time, the first model of /v1/models, first seen) -> Snapshot.
ScrapeReader = Callable[[Scrape, float, dict[str, Any] | None, float | None], Snapshot]


class Capability(StrEnum):
    """What a kind of server lets kvops see or do beyond its aggregate metrics."""

    ADMIN_API = "admin_api"  # kvops's /admin knobs: live fixes, knobs, tenants' quotas
    PROFILES = "profiles"  # /admin/profile/* (block-size and KV quantization error profiles) on demand
    STATS = "stats"  # the whole snapshot from /stats: block map, tenants, steps
    SHADOW_CACHE = "shadow_cache"  # measures what prefix caching or normalization would have served
    LIVE_NORMALIZATION = "live_normalization"  # prompt normalization switched live
    MANAGED = "managed"  # kvops can start, restart with new settings and drain it
    KV_EVENTS = "kv_events"  # publishes KV cache events (block stored / removed)
    # Stores KV in kvops's own dtypes (int8, int4, fp8 with scales): doctor checks the dtype works on its device.
    KV_QUANTIZATION = "kv_quantization"


class Remedy(StrEnum):
    """The situations whose remedy a profile words in its own flags (`EngineProfile.remedies`)."""

    QUEUEING = "queueing"  # admit more of the queue
    LONG_PROMPTS = "long_prompts"  # cap or route prompts that crowd the pool
    PREFIX_CACHING_ON = "prefix_caching_on"  # turn prefix caching on
    POOL_SIZE_LOG = "pool_size_log"  # where the server's log states the KV pool size
    START = "start"  # how to start one on a port ({port})
    # Fewer requests at once or a larger KV pool: {to_fit} is " to N" when the concurrency that fits is known,
    # {pool} the pool's flag on the engine's device (its notes "kv_pool_flag_cpu", "_cuda", or "kv_pool_flag").
    CAPACITY = "capacity"


@dataclass(frozen=True, slots=True)
class Recognition:
    """How a server of this kind is recognised: the prefix of its metric names (the kind with the most series
    wins, since a proxy may add a few of another's), else a word in `/v1/models`' `owned_by`."""

    metric_prefixes: tuple[str, ...]
    owned_by: tuple[str, ...] = ()
    # Metric names that mark a server borrowing this kind's names (counted against the prefix's series).
    borrowed_markers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineProfile:
    kind: str  # the one name of this kind: a snapshot's `source`, an `[[engines]] kind`
    title: str  # as people write it: "vLLM"
    recognition: Recognition
    read_scrape: ScrapeReader | None  # None: read by other means (a kvops engine's /stats)
    metrics: Mapping[str, MetricSource] = field(default_factory=dict)  # snapshot field -> names per version
    flags: Mapping[str, str] = field(default_factory=dict)  # kvops setting name -> this kind's flag
    remedies: Mapping[Remedy, str] = field(default_factory=dict)
    capabilities: frozenset[Capability] = frozenset()
    block_sizes: tuple[int, ...] = ()  # the block sizes it takes (empty: token-granular or not settable)
    # Where the sizes it takes depend on the device (a prefix of `engine.device`: "cpu", "cuda"); `block_sizes`
    # is then what every device takes, for a snapshot that does not say which.
    block_sizes_by_device: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)  # kind-specific wording doctor and rules quote
    # Where its Prometheus text is served, tried in order: the first whose answer has samples is read (trtllm-serve
    # answers `/metrics` with JSON iteration stats and serves the text at `/prometheus/metrics`).
    metrics_paths: tuple[str, ...] = ("/metrics",)

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def block_sizes_on(self, device: str) -> tuple[int, ...]:
        """The block sizes it takes on `device` ("" when unknown)."""
        return next((sizes for prefix, sizes in self.block_sizes_by_device.items() if device.startswith(prefix)),
                    self.block_sizes) if device else self.block_sizes

    def flag(self, setting: str, value: object | None = None) -> str:
        """This kind's flag for a kvops setting (with its value when given); the setting's own name when the
        kind has no flag for it."""
        flag = self.flags.get(setting, setting)
        return flag if value is None else f"{flag} {value}" if flag.startswith("-") else f"{flag}={value}"

    def remedy(self, situation: Remedy, **values: object) -> str:
        text = self.remedies.get(situation, "")
        return text.format(**values) if values else text

    def missing_metric(self, field_path: str) -> str:
        """What would report `field_path` on this kind: its metric names and the version or flag that has them;
        "" when kvops has no name for it here."""
        source = self.metrics.get(field_path)
        return "" if source is None else f"{' or '.join(source.names)}, from {source.provided_by}"
