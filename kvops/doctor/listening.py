"""The subscription `kvops doctor --events ENDPOINT` holds while it examines the engine: started before the sections
run so that its window overlaps their work, read by the KV cache events section (kvops/doctor/events.py), which
comes last. Its own module because the validator's `Examined` carries it and the section reads `Examined`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvops.events.endpoint import parse_source

if TYPE_CHECKING:
    from kvops.events.subscriber import EventFeed


@dataclass
class Listening:
    """A subscription doctor holds while it examines the engine."""

    endpoint: str
    window_s: float
    started_at: float
    feed: EventFeed | None = None
    error: str = ""  # why there is no subscription
    clock: Callable[[], float] = field(default=time.time)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()


def listen(endpoint: str, replay: str | None, topic: str, window_s: float, engine_host: str,
           clock: Callable[[], float] = time.time) -> Listening:
    """Subscribe now; a bad endpoint is a Listening with its error (the section says it), never an exception."""
    listening = Listening(endpoint, window_s, clock(), clock=clock)
    try:
        source = parse_source(endpoint, replay, topic)
    except ValueError as exc:
        listening.error = str(exc)
        return listening
    from kvops.events.subscriber import EventFeed  # ZMQ: only for a doctor that listens

    try:
        listening.feed = EventFeed(source, connect_host=engine_host, clock=clock)
        listening.feed.start()
    except Exception as exc:  # no subscription is a line of the report, never a lost report
        listening.feed = None
        listening.error = f"{type(exc).__name__}: {exc}"
    return listening
