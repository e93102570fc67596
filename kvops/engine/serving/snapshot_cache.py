"""`/stats` without waiting for the step loop: a snapshot the step loop keeps fresh while someone polls.

Handing every `/stats` request to the step thread made a poller wait for the step in progress and wake
the event loop while the step thread ran: at 10 Hz that cost 5-8% of throughput on a 2-vCPU machine
(docs/benchmarks.md, "Supervisor polling"). So while polls keep coming, the step loop rebuilds the
snapshot between steps every REFRESH_S, and the server serializes and sends it without crossing threads.

What a cached snapshot may miss is bounded, and never something a client could have just seen:
- it is at most MAX_AGE_S old;
- it is never older than the last command run on the step thread (a request added or aborted, an admin
  change), nor than the last step that finished a request: the finished output reaches its client only
  after the step loop has invalidated the cache, so a client that saw its request finish (or its admin
  change answered) and then asks `/stats` gets a snapshot that counts it.
Otherwise `serve` returns None and the server builds one on the step thread, as it did before.

Threads: `invalidate`, `refresh` and `refresh_if_polled` run on the step-loop thread only; `serve` runs on
the event loop. The shared fields are a counter with one writer and one immutable entry swapped whole.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvops.schema.snapshot import Snapshot

REFRESH_S = 0.1  # how often the step loop rebuilds while polled: one refresh per 10 Hz poll
MAX_AGE_S = 0.25  # older than this, /stats builds a new one (a long prefill step outlasts the refresh)
INTEREST_S = 2.0  # no poll for this long: stop refreshing (an unpolled engine pays nothing)


@dataclass(frozen=True)
class CachedSnapshot:
    snapshot: Snapshot  # built on the step thread, never changed after: serializing it needs no other thread
    epoch: int  # the cache's epoch when it was built
    built_at: float  # monotonic seconds

    @functools.cached_property
    def body(self) -> bytes:
        """Its JSON, as `/stats` sends it: serialized when first asked for, since the supervisor asks only for
        `steps_after` (two racing requests may both serialize it; the results are equal)."""
        return self.snapshot.model_dump_json().encode()

    def steps_after(self, t: float) -> bytes:
        """Its JSON with only the steps newer than `t`: a poller holding the rest (kvops.adapters.engine_client)
        reads a tenth of the bytes, most of a snapshot being its 512 steps."""
        steps = self.snapshot.steps
        newer = steps[bisect.bisect_right(steps, t, key=lambda step: step.t):]
        return self.snapshot.model_copy(update={"steps": newer}).model_dump_json().encode()


class SnapshotCache:
    def __init__(self, build: Callable[[], Snapshot], clock: Callable[[], float] = time.monotonic) -> None:
        self._build = build
        self._clock = clock
        self._epoch = 0
        self._entry: CachedSnapshot | None = None
        self._polled_at = -math.inf
        self.served_total = 0  # polls answered from the cache
        self.built_total = 0  # snapshots built, on a poll or ahead of one

    # ------------------------------------------------------------ step-loop thread

    def invalidate(self) -> None:
        """The engine changed in a way a client may check at once: no snapshot built before may be served."""
        self._epoch += 1

    def refresh(self) -> CachedSnapshot:
        entry = CachedSnapshot(self._build(), self._epoch, self._clock())
        self._entry = entry
        self.built_total += 1
        return entry

    def refresh_if_polled(self) -> None:
        """Between steps: rebuild when someone polled lately and the cached one is stale or due."""
        now = self._clock()
        if now - self._polled_at > INTEREST_S:
            return
        entry = self._entry
        if entry is None or entry.epoch != self._epoch or now - entry.built_at >= REFRESH_S:
            self.refresh()

    # ------------------------------------------------------------ event loop

    def serve(self) -> CachedSnapshot | None:
        """The cached snapshot if it may be served now, else None (build one on the step thread)."""
        now = self._clock()
        self._polled_at = now
        entry = self._entry
        if entry is None or entry.epoch != self._epoch or now - entry.built_at > MAX_AGE_S:
            return None
        self.served_total += 1
        return entry
