"""Per-tenant accounting: the gateway's own Prometheus metrics (a private registry, label `tenant`) and the same
numbers as JSON for `GET /stats/tenants`.

Tenants come from the key file and the environment variable (or are the single `default`), so the label's values
are bounded by the configuration: no cap like the engine's `--max-tenant-labels` is needed. A request refused
before its tenant is known (no key, an unknown key) is counted under `tenant="unauthenticated"`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, Field

from kvops.gateway.policy import TenantPolicy
from kvops.gateway.shadow import Reuse

UNAUTHENTICATED = "unauthenticated"
# Time to first token on CPU engines runs from tens of milliseconds to minutes under load.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class TenantStats(BaseModel):
    """One tenant's numbers since the gateway started."""

    tenant: str
    requests: dict[str, int] = Field(default_factory=dict, description="requests by HTTP status")
    in_flight: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_token_share: float | None = Field(default=None, description="cached / prompt tokens")
    ttft_count: int = 0
    ttft_sum_s: float = 0.0
    errors: dict[str, int] = Field(default_factory=dict, description="errors by reason")
    client_disconnects: int = 0
    # What the supervisor's fixes through the gateway read and change (kvops.rules, docs/gateway.md).
    estimated_tokens: int = Field(0, description="the token-rate limit's charges of the admitted requests")
    prompt_chars: int = Field(0, description="characters of the admitted requests' text prompts")
    reusable_prompt_chars: int = Field(0, description="... that a prefix cache of the prompts as sent would reuse "
                                                      "(kvops/gateway/shadow.py)")
    normalized_reusable_prompt_chars: int = Field(0, description="... of the same prompts whitespace-normalized")
    masked_reusable_prompt_chars: int = Field(0, description="... normalized and every volatile value masked")
    volatile_prompt_chars: dict[str, int] = Field(default_factory=dict, description="characters of each volatile "
                                                  "pattern (kvops/gateway/volatile.py) in the prompts as sent")
    shareable_prompt_chars: dict[str, int] = Field(default_factory=dict, description="namespace (a cache salt, or "
                                                   "'shared' for none) -> characters only sharing it would reuse")
    policy: TenantPolicy | None = Field(default=None, description="the tenant's policy now")


class TenantStatsList(BaseModel):
    """`GET /stats/tenants`."""

    time: float
    tenants: list[TenantStats]


class Usage(BaseModel):
    """What an upstream's `usage` says about one request (OpenAI's fields)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_body(cls, usage: object) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(prompt_tokens=_count(usage.get("prompt_tokens")),
                   completion_tokens=_count(usage.get("completion_tokens")), cached_tokens=_count(cached))


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for key, count in counts.items():
        into[key] = into.get(key, 0) + count


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class Accounting:
    """Counts requests, tokens, errors, disconnects and time to first token per tenant."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvops_gateway_requests", "requests answered, by tenant and HTTP status",
                                ["tenant", "status"], registry=r)
        self.prompt_tokens = Counter("kvops_gateway_prompt_tokens", "prompt tokens (the upstream's usage)",
                                     ["tenant"], registry=r)
        self.cached_prompt_tokens = Counter(
            "kvops_gateway_cached_prompt_tokens",
            "prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)", ["tenant"],
            registry=r)
        self.completion_tokens = Counter("kvops_gateway_completion_tokens", "completion tokens (the upstream's usage)",
                                         ["tenant"], registry=r)
        self.ttft = Histogram("kvops_gateway_time_to_first_token_seconds",
                              "seconds from the request to its first streamed chunk (the whole answer when not "
                              "streamed)", ["tenant"], buckets=TTFT_BUCKETS, registry=r)
        self.errors = Counter("kvops_gateway_errors", "requests that failed, by tenant and reason",
                              ["tenant", "reason"], registry=r)
        self.disconnects = Counter("kvops_gateway_client_disconnects", "clients that hung up before the answer ended",
                                   ["tenant"], registry=r)
        self.in_flight = Gauge("kvops_gateway_in_flight_requests", "requests in flight", ["tenant"], registry=r)
        self.prompt_chars = Counter("kvops_gateway_prompt_chars", "characters of text prompts admitted", ["tenant"],
                                    registry=r)
        self.reusable_prompt_chars = Counter(
            "kvops_gateway_reusable_prompt_chars", "prompt characters a prefix cache would reuse, of the prompts as "
            "sent (form=\"sent\"), whitespace-normalized (\"normalized\") or normalized with every volatile value "
            "masked (\"masked\")", ["tenant", "form"], registry=r)
        self.volatile_prompt_chars = Counter(
            "kvops_gateway_volatile_prompt_chars", "prompt characters of a volatile pattern (a timestamp, an id)",
            ["tenant", "pattern"], registry=r)
        self.shareable_prompt_chars = Counter(
            "kvops_gateway_shareable_prompt_chars", "prompt characters a prefix cache would reuse only if the "
            "tenant shared the cache salt of `namespace` (shared: no salt)", ["tenant", "namespace"], registry=r)
        self._lock = threading.Lock()
        self._stats: dict[str, TenantStats] = {}

    def _tenant(self, tenant: str) -> TenantStats:
        return self._stats.setdefault(tenant, TenantStats(tenant=tenant))

    def request_done(self, tenant: str, status: int) -> None:
        self.requests.labels(tenant, str(status)).inc()
        with self._lock:
            requests = self._tenant(tenant).requests
            requests[str(status)] = requests.get(str(status), 0) + 1

    def usage(self, tenant: str, usage: Usage) -> None:
        self.prompt_tokens.labels(tenant).inc(usage.prompt_tokens)
        self.cached_prompt_tokens.labels(tenant).inc(usage.cached_tokens)
        self.completion_tokens.labels(tenant).inc(usage.completion_tokens)
        with self._lock:
            stats = self._tenant(tenant)
            stats.prompt_tokens += usage.prompt_tokens
            stats.cached_prompt_tokens += usage.cached_tokens
            stats.completion_tokens += usage.completion_tokens

    def first_token(self, tenant: str, seconds: float) -> None:
        self.ttft.labels(tenant).observe(seconds)
        with self._lock:
            stats = self._tenant(tenant)
            stats.ttft_count += 1
            stats.ttft_sum_s += seconds

    def error(self, tenant: str, reason: str) -> None:
        self.errors.labels(tenant, reason).inc()
        with self._lock:
            errors = self._tenant(tenant).errors
            errors[reason] = errors.get(reason, 0) + 1

    def disconnect(self, tenant: str) -> None:
        self.disconnects.labels(tenant).inc()
        with self._lock:
            self._tenant(tenant).client_disconnects += 1

    def admitted(self, tenant: str, estimated_tokens: int, reuse: Reuse) -> None:
        """A request past its limits: its charge, and what the shadow caches found of its prompt."""
        self.prompt_chars.labels(tenant).inc(reuse.chars)
        self.reusable_prompt_chars.labels(tenant, "sent").inc(reuse.reused)
        self.reusable_prompt_chars.labels(tenant, "normalized").inc(reuse.normalized_reused)
        self.reusable_prompt_chars.labels(tenant, "masked").inc(reuse.masked_reused)
        for pattern, chars in reuse.volatile.items():
            self.volatile_prompt_chars.labels(tenant, pattern).inc(chars)
        for namespace, chars in reuse.shareable.items():
            self.shareable_prompt_chars.labels(tenant, namespace).inc(chars)
        with self._lock:
            stats = self._tenant(tenant)
            stats.estimated_tokens += estimated_tokens
            stats.prompt_chars += reuse.chars
            stats.reusable_prompt_chars += reuse.reused
            stats.normalized_reusable_prompt_chars += reuse.normalized_reused
            stats.masked_reusable_prompt_chars += reuse.masked_reused
            _add(stats.volatile_prompt_chars, reuse.volatile)
            _add(stats.shareable_prompt_chars, reuse.shareable)

    def started(self, tenant: str) -> None:
        self.in_flight.labels(tenant).inc()
        with self._lock:
            self._tenant(tenant).in_flight += 1

    def finished(self, tenant: str) -> None:
        self.in_flight.labels(tenant).dec()
        with self._lock:
            self._tenant(tenant).in_flight -= 1

    def snapshot(self, policy: Callable[[str], TenantPolicy] | None = None) -> TenantStatsList:
        """Every tenant seen so far, with its policy now when `policy` gives it."""
        with self._lock:
            tenants = [stats.model_copy(deep=True) for _, stats in sorted(self._stats.items())]
        for stats in tenants:
            if stats.prompt_tokens:
                stats.cached_prompt_token_share = stats.cached_prompt_tokens / stats.prompt_tokens
            if policy is not None and stats.tenant != UNAUTHENTICATED:
                stats.policy = policy(stats.tenant)
        return TenantStatsList(time=time.time(), tenants=tenants)
