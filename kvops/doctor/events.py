"""KV cache events: `kvops doctor --url URL --events ENDPOINT` subscribes to the engine's KV event publisher for a
few seconds (`--events-window`) while the other sections read the engine, then says whether events arrive and
what the resident-block index built from them saw.

`listen` (kvops/doctor/listening.py) starts the subscription before the sections run, so the window overlaps their
work; the section (`KvEvents`, the last to run) waits out what is left of it. The lines: the stream (✓ batches
arriving; ! none in the window, with how to tell a quiet engine from a wrong endpoint; ✗ cannot subscribe), its
integrity (gaps, drops, malformed messages, publisher restarts), the resident blocks, and the largest shared
prefixes. The diagnoses stay the other sections' own, read from the snapshots as always.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvops.doctor.report import Check, Status
from kvops.doctor.validator import Examined
from kvops.events.endpoint import socket_role
from kvops.schema.kv_events import EVENT_TYPES, KvEventStats
from kvops.schema.snapshot import Snapshot

SECTION = "KV cache events"
DEFAULT_WINDOW_S = 5.0
SHARED_PREFIXES_SHOWN = 3
FORMS = "tcp://*:PORT (vLLM binds it), tcp://HOST:PORT (vLLM connects to it) or ipc:///PATH"


class KvEvents:
    """The section (run last, so the window overlaps the others): waits out the window, then reports the stream and
    the index; nothing without --events."""

    name = SECTION

    def check(self, examined: Examined) -> list[Check]:
        listening = examined.events
        if listening is None:
            return []
        if listening.feed is None:
            return [_cannot(listening.endpoint, listening.error)]
        time.sleep(max(0.0, listening.started_at + listening.window_s - listening.clock()))
        end = snapshot_now(examined)
        now = listening.clock()
        pool = end.engine.num_blocks if end is not None and end.knows("engine.num_blocks") else None
        stats = listening.feed.stats(now, pool_blocks=pool)
        listening.close()
        if stats.stream.error:
            return [_cannot(listening.endpoint, stats.stream.error)]
        waited = now - listening.started_at
        if not stats.stream.batches_total:
            return [_none(stats, waited, examined.snaps[0] if examined.snaps else None, end)]
        checks = [_arriving(stats, waited), _integrity(stats), _resident(stats)]
        prefixes = _prefixes(stats)
        return checks + ([prefixes] if prefixes else [])


def snapshot_now(examined: Examined) -> Snapshot | None:
    """The engine read once more at the window's end (compared with the first snapshot); None: no answer."""
    from kvops.adapters.engine_client import EngineUnreachable
    from kvops.watching import WatchedEngineClient

    if examined.url is None or examined.kind is None:
        return None
    client = WatchedEngineClient(examined.url, examined.kind, timeout_s=examined.timeout_s)
    try:
        return client.snapshot()
    except EngineUnreachable:
        return None
    finally:
        client.close()


def _cannot(endpoint: str, error: str) -> Check:
    return Check(section=SECTION, title="Event stream", status=Status.FAIL,
                 evidence=f"cannot subscribe to {endpoint}: {error}",
                 remedy=f"give --events exactly the endpoint of the engine's --kv-events-config: {FORMS}")


def _how(endpoint: str) -> str:
    try:
        role = socket_role(endpoint)
    except ValueError:
        return ""
    return "the engine binds this endpoint and doctor connects to it" if role == "connect" else \
        "the engine connects to this address, so doctor binds it: run doctor on the host it names"


def _arriving(stats: KvEventStats, waited: float) -> Check:
    stream = stats.stream
    counted = ", ".join(f"{kind} {stream.events_total.get(kind, 0)}" for kind in EVENT_TYPES)
    replayed = f"; {stream.replayed_batches_total} of them replayed" if stream.replayed_batches_total else ""
    return Check(section=SECTION, title="Event stream", status=Status.OK,
                 evidence=f"{stream.batches_total} batch(es) in {waited:.1f} s from {stream.endpoint} ({counted})"
                          f"{replayed}",
                 detail=[_how(stream.endpoint), f"last sequence number {stream.last_seq}",
                         f"topic {stream.topic!r}, replay endpoint {stream.replay_endpoint or 'none'}"])


def _integrity(stats: KvEventStats) -> Check:
    stream = stats.stream
    numbers = {"gaps": stream.gaps_total, "batches replayed": stream.replayed_batches_total,
               "batches lost": stream.dropped_batches_total, "malformed messages": stream.malformed_total,
               "events of unknown types": stream.unknown_events_total,
               "publisher restarts": stream.publisher_restarts_total}
    evidence = ", ".join(f"{value} {name}" for name, value in numbers.items())
    if not (stream.dropped_batches_total or stream.malformed_total or stream.unknown_events_total):
        return Check(section=SECTION, title="Stream integrity", status=Status.OK, evidence=evidence)
    remedy = ("give --events-replay the engine's replay_endpoint so that missed batches are asked again"
              if stream.dropped_batches_total and stream.replay_endpoint is None else
              "malformed or unknown events come from a publisher kvops does not fully read (another vLLM version, "
              "or not vLLM): kvops skips them and counts them")
    return Check(section=SECTION, title="Stream integrity", status=Status.WARN, evidence=evidence, remedy=remedy)


def _resident(stats: KvEventStats) -> Check:
    media = ", ".join(f"{medium} {blocks}" for medium, blocks in sorted(stats.resident.items())) or "none"
    pool = f" of a {stats.pool_blocks}-block pool" if stats.pool_blocks else ""
    share = f" ({stats.restores_total / stats.stores_total:.0%})" if stats.stores_total else ""
    tenants = sorted(stats.tenants.items(), key=lambda kv: -kv[1].resident)
    return Check(section=SECTION, title="Resident blocks", status=Status.OK,
                 evidence=f"{sum(stats.resident.values())} resident ({media}){pool}; since subscribing "
                          f"{stats.stores_total} stored, {stats.removes_total} removed, {stats.restores_total} "
                          f"stored again after removal{share}, {stats.clears_total} cache reset(s)",
                 detail=[f"block size {stats.block_size or 'not seen yet'} tokens, {stats.resident_tokens} tokens "
                         "resident",
                         *(f"tenant {name}: {t.resident} resident, {t.stores_total} stored, {t.removed_total} removed"
                           for name, t in tenants)])


def _prefixes(stats: KvEventStats) -> Check | None:
    shown = stats.shared_prefixes[:SHARED_PREFIXES_SHOWN]
    if not shown:
        return None
    top = shown[0]
    return Check(section=SECTION, title="Shared prefixes", status=Status.INFO,
                 evidence=f"the largest: {top.descendants} resident block(s) below a {top.depth}-block, "
                          f"{top.tokens}-token prefix (tenant {top.tenant})",
                 detail=[f"{p.block_hash}: depth {p.depth}, {p.tokens} tokens, {p.descendants} below, first tokens "
                         f"{p.first_tokens}" for p in shown])


def _computed(first: Snapshot | None, end: Snapshot | None) -> int | None:
    """Prompt tokens the engine computed (admitted less prefix-cache hits) between two snapshots, where known."""
    if first is None or end is None or not end.knows("requests.prompt_tokens_total"):
        return None
    admitted = end.requests.prompt_tokens_total - first.requests.prompt_tokens_total
    hits = (end.prefix_cache.hits_total - first.prefix_cache.hits_total
            if end.knows("prefix_cache.hits_total") else 0)
    return max(0, admitted - hits) if admitted >= 0 else None


def _none(stats: KvEventStats, waited: float, first: Snapshot | None, end: Snapshot | None) -> Check:
    """No batch in the window: a quiet engine, or the wrong endpoint or topic. The prompt tokens the engine
    computed meanwhile tell which: computing a block's worth fills a block, which vLLM publishes."""
    stream = stats.stream
    evidence = f"no event batch in {waited:.1f} s from {stream.endpoint} (topic {stream.topic!r})"
    computed = _computed(first, end)
    block = end.engine.block_size if end is not None and end.knows("engine.block_size") else None
    how = _how(stream.endpoint)
    check_it = ("check that --events is the endpoint of the engine's --kv-events-config and --events-topic its "
                "topic, and that its log says 'Using kv_events_config'" + (f" ({how})" if how else ""))
    path = stream.endpoint[len("ipc://"):] if stream.endpoint.startswith("ipc://") else ""
    if path and not Path(path).exists():
        return Check(section=SECTION, title="Event stream", status=Status.WARN,
                     evidence=f"{evidence}: there is no socket at {path}, so nothing publishes there on this host",
                     remedy=f"{check_it}; an ipc:// endpoint is a path on the engine's host (and in its container)")
    if computed is not None and block and computed >= block:
        return Check(section=SECTION, title="Event stream", status=Status.WARN,
                     evidence=f"{evidence}, while the engine computed {computed} prompt tokens (a block is {block}): "
                              "the endpoint or the topic is not the engine's, or its events are off",
                     remedy=check_it)
    quiet = (f"the engine computed {computed} prompt tokens meanwhile, less than a block"
             if computed is not None else "kvops cannot tell whether the engine computed prompts meanwhile")
    # The replay socket is asked only once a live batch shows what was missed: it tells nothing of a quiet engine.
    replay = "" if stream.replay_endpoint else ("; with --events-replay, the blocks resident before doctor joined are "
                                                "read when the first batch arrives")
    return Check(section=SECTION, title="Event stream", status=Status.WARN,
                 evidence=f"{evidence}: {quiet}, and a quiet engine publishes nothing",
                 remedy=f"to tell a quiet engine from a wrong endpoint, send it a prompt longer than a block while "
                        f"doctor listens (--events-window 30): batches must arrive; if none do, {check_it}{replay}")
