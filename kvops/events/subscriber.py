"""The ZMQ subscriber of an engine's KV events: a daemon thread that reads vLLM's publisher, keeps the
sequence whole with its replay socket, and feeds the resident-block index.

Each message is [topic, seq (8 bytes, big-endian), payload]. The next seq is applied. A jump is a gap: the
missed batches are asked from the replay socket (vLLM's ROUTER: send the start seq, get [b"", topic, seq,
payload] frames and an end marker of seq -1) and applied in order before the held one; what the replay cannot
give is counted as dropped. A smaller seq means a new publisher process: the index is reset. Joining a running
publisher (first seq > 0) replays from 0 to rebuild what is resident, when there is a replay socket; batches
published before kvops joined are not counted as dropped, since kvops never missed them.

Nothing the thread meets escapes it: a bad message is counted and skipped, a socket error goes to
`health().error`. Memory stays bounded: the receive queue has a high-water mark, replayed batches are applied
as they arrive, and the rate window is ten one-second buckets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import zmq

from kvops.events.endpoint import EventSource, needs_ipv6, socket_address, socket_role
from kvops.events.recording import Frame, write_frame
from kvops.events.wire import DecodedBatch, MalformedBatch, decode_batch, decode_seq
from kvops.schema.kv_events import EVENT_TYPES, EventStreamHealth, KvEventStats

if TYPE_CHECKING:
    from kvops.events.index import ResidentIndex

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10
POLL_MS = 100  # how long the thread waits before looking at its stop flag: close() takes about this long
RECEIVE_HWM = 10_000  # batches queued in the SUB socket while the thread replays; beyond it ZMQ drops (a gap)
BIND_RETRY_S = 2.0
END_SEQ = -1


class EventFeed:
    """One engine's KV event stream into a ResidentIndex. start() it, read health() and stats(), close() it.

    `record_to` appends every frame the feed applies (replayed ones included, malformed payloads too) to a
    recording (kvops.events.recording), in the order applied, so that replaying the file rebuilds the same index.
    `connect_host` is where a wildcard endpoint (tcp://*:N) is reached: the engine's host."""

    def __init__(self, source: EventSource, index: ResidentIndex | None = None, *,
                 connect_host: str = "127.0.0.1", clock: Callable[[], float] = time.time,
                 record_to: Path | None = None, replay_timeout_s: float = 1.0) -> None:
        if index is None:
            from kvops.events.index import ResidentIndex

            index = ResidentIndex()
        self._source = source
        self._index = index
        self._clock = clock
        self._role = socket_role(source.endpoint)
        self._address = socket_address(source.endpoint, connect_host)
        self._replay_address = (socket_address(source.replay_endpoint, connect_host)
                                if source.replay_endpoint is not None else None)
        self._topic = source.topic.encode()
        self._record_to = record_to
        self._record: BinaryIO | None = None
        # A replay waits this long for each reply, and the whole replay at most ten times as long: a publisher
        # that does not answer holds the live stream back that long, at worst.
        self._replay_timeout_s = replay_timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        # The stream's health, all under _lock.
        self._batches = 0
        self._events: dict[str, int] = {}
        self._rate: deque[list[int]] = deque(maxlen=RATE_WINDOW_S + 1)  # [unix second, events]
        self._last_seq: int | None = None
        self._gaps = 0
        self._replayed = 0
        self._dropped = 0
        self._malformed = 0
        self._unknown = 0
        self._restarts = 0
        self._last_event_at: float | None = None
        self._error = ""

    @property
    def index(self) -> ResidentIndex:
        return self._index

    @property
    def source(self) -> EventSource:
        return self._source

    @property
    def running(self) -> bool:
        """Whether the thread is alive (False before start() and after close())."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self._source.endpoint}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close its sockets (within about POLL_MS, or a replay's poll slice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def health(self, now: float) -> EventStreamHealth:
        with self._lock:
            return self._health(now)

    def stats(self, now: float, pool_blocks: int | None = None) -> KvEventStats:
        with self._lock:
            return self._index.stats(now, self._health(now), pool_blocks=pool_blocks)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._ctx = zmq.Context()
            sub = self._open_sub()
            if sub is not None:
                self._receive(sub)
        except Exception as exc:  # the thread's last line of defence: the caller reads it in health()
            log.exception("KV event feed %s stopped", self._source.endpoint)
            self._set_error(f"the KV event feed stopped: {type(exc).__name__}: {exc}")
        finally:
            if self._record is not None:
                self._record.close()
            if self._ctx is not None:
                self._ctx.destroy(linger=0)

    def _open_sub(self) -> zmq.Socket | None:
        """The SUB socket, connected or bound; a bind that fails (address in use, not an address of this host)
        is retried every BIND_RETRY_S with the reason in health().error. None once closed."""
        assert self._ctx is not None
        while not self._stop.is_set():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            if needs_ipv6(self._address):
                sub.setsockopt(zmq.IPV6, 1)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            try:
                if self._role == "bind":
                    sub.bind(self._address)
                else:
                    sub.connect(self._address)
            except zmq.ZMQError as exc:
                sub.close(linger=0)
                self._set_error(f"cannot {self._role} {self._address} for the KV events: {exc} (vLLM connects to "
                                f"this address, so kvops must bind it on this host; retrying every "
                                f"{BIND_RETRY_S:g} s)" if self._role == "bind" else
                                f"cannot connect to {self._address} for the KV events: {exc}")
                self._stop.wait(BIND_RETRY_S)
                continue
            self._set_error("")
            return sub
        return None

    def _receive(self, sub: zmq.Socket) -> None:
        if self._record_to is not None:
            try:
                self._record = self._record_to.open("ab")
            except OSError as exc:
                self._set_error(f"cannot record the KV events to {self._record_to}: {exc}")
        while not self._stop.is_set():
            if not sub.poll(POLL_MS):
                continue
            frames = sub.recv_multipart(zmq.NOBLOCK)
            try:
                self._on_message(frames)
            except Exception as exc:  # a bug in the index must not end the stream: say it and go on
                log.exception("KV event batch not applied")
                self._set_error(f"a KV event batch could not be applied: {type(exc).__name__}: {exc}")

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._count_malformed()
            return
        topic, seq_frame, payload = frames
        if topic != self._topic:
            return  # another topic whose name starts with ours (SUB filters by prefix)
        try:
            seq = decode_seq(seq_frame)
        except MalformedBatch:
            self._count_malformed()
            return
        batch = self._decode(payload)
        last = self._last_seq
        if last is not None and seq <= last:
            # A smaller (or repeated) number: a new publisher process counts from 0 again.
            with self._lock:
                self._restarts += 1
                self._index.reset()
                self._last_seq = None
            last = None
        if last is None:
            if seq > 0 and self._replay_address is not None:
                self._replay(0, seq, count_missing=self._restarts > 0)
            elif seq > 0 and self._restarts > 0:
                self._drop(seq)  # a restarted publisher's first batches, missed with no replay to ask
        elif seq > last + 1:
            with self._lock:
                self._gaps += 1
            if self._replay_address is not None:
                self._replay(last + 1, seq, count_missing=True)
            else:
                self._drop(seq - last - 1)
        self._apply(seq, payload, batch)

    def _replay(self, start: int, held: int, *, count_missing: bool) -> None:
        """Ask the replay socket for batches start..held-1 and apply them in order. Those it cannot give are
        counted as dropped when `count_missing` (a gap, or a restarted publisher's first batches), not when
        they are the history of a publisher kvops joined late."""
        assert self._ctx is not None and self._replay_address is not None
        # A fresh socket per request: replies to a request that timed out must not answer the next one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if needs_ipv6(self._replay_address):
            dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(self._replay_address)
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            finished = self._read_replay(dealer, start, held, count_missing)
        except zmq.ZMQError as exc:
            log.warning("KV event replay from %s failed: %s", self._replay_address, exc)
            finished = True
        finally:
            dealer.close(linger=0)
        if not finished and not self._stop.is_set():
            log.warning("KV event replay from %s did not finish within its timeout (%.1f s a reply)",
                        self._replay_address, self._replay_timeout_s)
        expected = start if self._last_seq is None or self._last_seq < start else self._last_seq + 1
        if count_missing and held > expected:
            self._drop(held - expected)

    def _read_replay(self, dealer: zmq.Socket, start: int, held: int, count_missing: bool) -> bool:
        """Apply the replies that fall in start..held-1; True once the end marker (or the held seq) came."""
        slice_ms = min(POLL_MS, max(1, int(self._replay_timeout_s * 1000)))
        deadline = time.monotonic() + 10 * self._replay_timeout_s
        idle_until = time.monotonic() + self._replay_timeout_s
        expected = start
        while not self._stop.is_set() and time.monotonic() < min(deadline, idle_until):
            if not dealer.poll(slice_ms):
                continue
            idle_until = time.monotonic() + self._replay_timeout_s
            frames = dealer.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 4:
                self._count_malformed()
                continue
            try:
                seq = decode_seq(frames[2])
            except MalformedBatch:
                self._count_malformed()
                continue
            if seq == END_SEQ or seq >= held:
                return True  # the end marker, or batches the live stream has queued already
            if seq < expected:
                continue
            if seq > expected and count_missing:
                self._drop(seq - expected)  # a hole in the publisher's own buffer
            self._apply(seq, frames[3], self._decode(frames[3]), replayed=True)
            expected = seq + 1
        return False

    def _decode(self, payload: bytes) -> DecodedBatch | None:
        try:
            return decode_batch(payload)
        except MalformedBatch:
            self._count_malformed()
            return None

    def _apply(self, seq: int, payload: bytes, batch: DecodedBatch | None, replayed: bool = False) -> None:
        """Take batch `seq` (None: malformed, counted already; its number is used up all the same)."""
        now = self._clock()
        self._write(Frame(now, seq, payload))
        with self._lock:
            self._last_seq = seq
            self._last_event_at = now
            if replayed:
                self._replayed += 1
            if batch is None:
                return
            self._batches += 1
            for event in batch.events:
                name = type(event).__name__
                name = name if name in EVENT_TYPES else "unknown"
                self._events[name] = self._events.get(name, 0) + 1
            if batch.unknown:
                self._events["unknown"] = self._events.get("unknown", 0) + batch.unknown
                self._unknown += batch.unknown
            self._count_rate(now, len(batch.events) + batch.unknown)
            self._index.apply(batch)

    # ------------------------------------------------------------------ bookkeeping

    def _write(self, frame: Frame) -> None:
        if self._record is None:
            return
        try:
            write_frame(self._record, frame)
            self._record.flush()
        except OSError as exc:
            self._set_error(f"cannot record the KV events to {self._record_to}: {exc}")
            self._record.close()
            self._record = None

    def _count_rate(self, now: float, events: int) -> None:
        second = int(now)
        if self._rate and self._rate[-1][0] == second:
            self._rate[-1][1] += events
        else:
            self._rate.append([second, events])

    def _count_malformed(self) -> None:
        with self._lock:
            self._malformed += 1

    def _drop(self, batches: int) -> None:
        with self._lock:
            self._dropped += batches

    def _set_error(self, error: str) -> None:
        with self._lock:
            self._error = error

    def _health(self, now: float) -> EventStreamHealth:
        recent = sum(events for second, events in self._rate if now - RATE_WINDOW_S <= second <= now)
        return EventStreamHealth(
            endpoint=self._source.endpoint, replay_endpoint=self._source.replay_endpoint, topic=self._source.topic,
            socket_role=self._role, batches_total=self._batches, events_total=dict(self._events),
            events_per_s=recent / RATE_WINDOW_S, rate_window_s=float(RATE_WINDOW_S), last_seq=self._last_seq,
            gaps_total=self._gaps, replayed_batches_total=self._replayed, dropped_batches_total=self._dropped,
            malformed_total=self._malformed, unknown_events_total=self._unknown,
            publisher_restarts_total=self._restarts, last_event_at=self._last_event_at,
            last_event_age_s=None if self._last_event_at is None else max(0.0, now - self._last_event_at),
            error=self._error)
