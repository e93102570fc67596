"""One delivery attempt of one outbox row, what it does to the row, and the per-receiver counters.

Failures that may pass (connection errors, timeouts, 5xx, 408, 429) are retried with exponential
backoff, forever: dropping the row would lose the alert. A refusal that will not pass by waiting (any
other 4xx) gets one retry, because a receiver being redeployed can answer 404 for a moment, and then
the row becomes a dead letter: kept in the outbox with the answer, out of the receiver's queue, so
the notifications behind it go on.
"""

from __future__ import annotations

import enum
import random
import threading
from collections.abc import Callable, Iterable

import structlog

from kvops.alerting.config import ResolvedReceiver
from kvops.alerting.health import ReceiverStats
from kvops.alerting.outbox import Outbox, OutboxRow
from kvops.alerting.receivers import DeliveryResult, ReceiverClient

log = structlog.get_logger("kvops.alerting")

REJECTIONS_BEFORE_DEAD = 2  # refusals (4xx other than 408/429) before a row is given up on: one retry


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    DEAD = "dead"  # given up on; the queue moves on
    RETRY = "retry"  # backing off; the receiver's queue waits for this row


def backoff_s(attempts: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Delay after the `attempts`-th failure: initial, doubling, capped, ±10% so receivers are not hit in step."""
    base = min(max_s, initial_s * 2.0 ** min(attempts - 1, 62))
    return min(max_s, base * rng.uniform(0.9, 1.1))


class Courier:
    """Sends rows and records the result in the outbox and in the counters `Alerter.stats()` reports."""

    def __init__(self, outbox: Outbox, clock: Callable[[], float], counters: Iterable[ReceiverStats]) -> None:
        self._outbox = outbox
        self._clock = clock
        self._lock = threading.Lock()
        self._counters = {c.name: c for c in counters}
        self._rng = random.Random()

    def counters(self) -> dict[str, ReceiverStats]:
        """Copies, by receiver name."""
        with self._lock:
            return {name: c.model_copy() for name, c in self._counters.items()}

    def attempt(self, client: ReceiverClient, row: OutboxRow, timeout_s: float | None = None) -> Outcome:
        receiver = client.receiver
        result = client.send(row.payload.encode(), row.idempotency_key, timeout_s)
        now = self._clock()
        attempts = row.attempts + 1
        if result.ok:
            self._outbox.mark_delivered(row.id, now)
            with self._lock:
                counters = self._counters[receiver.name]
                counters.delivered += 1
                counters.last_delivered_at = now
            log.info("notification delivered", receiver=receiver.name, id=row.id, kind=row.kind, group=row.group_key,
                     attempts=attempts, http_status=result.status_code, queued_s=round(now - row.created_at, 3))
            return Outcome.DELIVERED
        error = result.error or "unknown error"
        with self._lock:
            counters = self._counters[receiver.name]
            counters.failed_attempts += 1
            counters.last_error = error
        if result.rejected and row.rejections + 1 >= REJECTIONS_BEFORE_DEAD:
            self._bury(receiver, row, attempts, result, now)
            return Outcome.DEAD
        delay = backoff_s(attempts, receiver.initial_backoff_s, receiver.max_backoff_s, self._rng)
        rejections = row.rejections + 1 if result.rejected else None
        self._outbox.mark_failed(row.id, attempts, error, now + delay, rejections)
        fields = {"receiver": receiver.name, "id": row.id, "attempts": attempts, "error": error,
                  "retry_in_s": round(delay, 3)}
        if result.rejected:
            log.error("receiver rejected a notification; retrying, check its URL and credentials", **fields)
        else:
            log.warning("notification delivery failed; retrying", **fields)
        return Outcome.RETRY

    def _bury(self, receiver: ResolvedReceiver, row: OutboxRow, attempts: int, result: DeliveryResult,
              now: float) -> None:
        reason = result.error or "refused"
        self._outbox.mark_dead(row.id, attempts, result.status_code, reason, now)
        with self._lock:
            counters = self._counters[receiver.name]
            counters.dead_letters += 1
            counters.last_dead_letter_reason = reason
            counters.last_dead_letter_at = now
        log.warning("receiver refused a notification for good; kept as a dead letter, later ones go on",
                    receiver=receiver.name, id=row.id, kind=row.kind, group=row.group_key, attempts=attempts,
                    http_status=result.status_code, error=reason)
