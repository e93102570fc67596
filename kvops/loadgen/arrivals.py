"""When an open-loop stream sends: Poisson or evenly spaced at its rate, or a trace's own times."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from kvops.loadgen.spec import Stream


def arrival_times(stream: Stream, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Send times (s from the run's start) of an open-loop stream: Poisson or evenly spaced at `rate`,
    or a trace's arrival_s shifted by start_s; only inside the stream's window, at most max_requests."""
    start, end = stream.window(duration_s)
    count = 0
    limit = stream.max_requests if stream.max_requests is not None else math.inf
    if stream.replays_arrivals:
        for record in stream.prompt.records:
            t = start + (record.arrival_s or 0.0)
            if t >= end or count >= limit:
                return
            count += 1
            yield t
        return
    if stream.rate is None:
        return
    t = start
    while count < limit:
        if stream.arrival == "poisson":
            t += rng.expovariate(stream.rate)
        elif count:
            t += 1.0 / stream.rate
        if t >= end:
            return
        count += 1
        yield t
