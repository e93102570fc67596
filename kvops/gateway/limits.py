"""Per-tenant admission: a concurrency limit and a token-rate limit, both answered with 429 and Retry-After.

Tokens are estimated before the request runs, without a tokenizer: `ceil(prompt characters / 4) + max_tokens`
(`max_completion_tokens` for chat; 0 when neither is sent). The rate limit is a token bucket per tenant holding
`tokens_per_minute`, refilled continuously at `tokens_per_minute / 60` per second; a limit set (in the policy file
or live) starts with the bucket at the limit less what the tenant was charged in the last minute, never below zero,
so a limit put on a flooding tenant holds at once. A request is admitted while the bucket is above zero and takes
its estimate, which may drive the bucket below zero (so a request larger than the
whole minute's budget still runs, alone, and the tenant then waits for the debt to refill); a request that finds
the bucket at or below zero gets 429 with `Retry-After` = the seconds until it is above zero again, rounded up.
The estimate is what is charged: the bucket is not corrected by the real usage afterwards.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvops.gateway.errors import GatewayError
from kvops.gateway.policy import TenantPolicy

WINDOW_S = 60.0  # a rate limit's minute


def rate_limited(tenant: str, message: str, retry_after_s: float, reason: str) -> GatewayError:
    seconds = max(1, math.ceil(retry_after_s))
    return GatewayError(429, f"tenant {tenant!r}: {message}; retry after {seconds} s", "rate_limit_error", reason,
                        headers={"Retry-After": str(seconds)})


@dataclass
class _Bucket:
    level: float
    updated: float


@dataclass
class TenantLimits:
    """In-flight counts and token buckets of every tenant; `admit` then `release` around each request."""

    clock: Callable[[], float] = time.monotonic
    in_flight: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    # Each tenant's charges of the last minute, limited or not: a limit set later starts from them.
    _recent: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, tenant: str, policy: TenantPolicy, tokens: int) -> None:
        """Count the request in, or raise a 429 GatewayError (nothing is counted then)."""
        with self._lock:
            running = self.in_flight.get(tenant, 0)
            if policy.max_concurrency is not None and running >= policy.max_concurrency:
                raise rate_limited(tenant, f"{running} requests in flight, the limit is {policy.max_concurrency}",
                                   1, "concurrency_limit")
            if policy.tokens_per_minute is not None:
                self._take(tenant, policy.tokens_per_minute, tokens)
            self.in_flight[tenant] = running + 1
            self._charged(tenant, tokens)

    def release(self, tenant: str) -> None:
        with self._lock:
            self.in_flight[tenant] = max(0, self.in_flight.get(tenant, 0) - 1)

    def _charged(self, tenant: str, tokens: int) -> None:
        now = self.clock()
        recent = self._recent.setdefault(tenant, deque())
        recent.append((now, tokens))
        while recent and recent[0][0] <= now - WINDOW_S:
            recent.popleft()

    def _take(self, tenant: str, per_minute: int, tokens: int) -> None:
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            # A new limit holds from the minute before it: a tenant that already sent its new minute's worth
            # waits for the refill (a limit set on a flooding tenant takes effect at once, not a minute later).
            used = sum(charged for at, charged in self._recent.get(tenant, ()) if at > now - WINDOW_S)
            bucket = self._buckets[tenant] = _Bucket(float(max(0, per_minute - used)), now)
        per_second = per_minute / 60.0
        bucket.level = min(float(per_minute), bucket.level + (now - bucket.updated) * per_second)
        bucket.updated = now
        if bucket.level <= 0:
            raise rate_limited(tenant, f"over its limit of {per_minute} tokens per minute (estimated)",
                               (-bucket.level + 1) / per_second, "token_rate_limit")
        bucket.level -= tokens

    def reset(self, tenant: str) -> None:
        """Forget a tenant's bucket (its limit changed): it starts again under the new limit, less what the tenant
        was charged in the last minute."""
        with self._lock:
            self._buckets.pop(tenant, None)

    def reset_all_but(self, keep: set[str]) -> None:
        """Forget every bucket but those of `keep` (the default limit changed: the tenants without their own)."""
        with self._lock:
            for tenant in set(self._buckets) - keep:
                del self._buckets[tenant]


def estimate_tokens(body: dict[str, object]) -> int:
    """`ceil(prompt characters / 4) + max_tokens`: the rate limit's charge for one request (module docstring)."""
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list):
        chars = sum(len(p) if isinstance(p, str) else 4 for p in prompt)  # a token id counts as one token
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part.get("text", "")) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    completion = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    return math.ceil(chars / 4) + completion
