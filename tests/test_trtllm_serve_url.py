"""`kvops doctor --url` and a watched engine (`kvops run --engine-url`) on a trtllm-serve, by its URL.

trtllm-serve answers `/metrics` with JSON iteration stats (`[]` until `enable_iter_perf_stats` collects any) and
serves its Prometheus text at `/prometheus/metrics`. The replay below is such a server: `/metrics` answers what
vllm-project/aibrix#2004 published from a trtllm-serve (`curl localhost:8000/metrics` -> `[]`), and
`/prometheus/metrics` the text trtllm-serve's PR #5785 published (both verbatim, tests/fixtures/published,
SOURCES.md). No `/v1/models` (404), so the kind comes from the metrics alone; no completion endpoint either, so
doctor's one-token check fails, which is not what is tested here.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvops.doctor.report import Report
from kvops.doctor.run import add_doctor_args, diagnose
from kvops.watching import WatchedEngineClient

PUBLISHED = Path(__file__).resolve().parent / "fixtures" / "published"
ANSWERS = {
    "/metrics": (PUBLISHED / "trtllm-serve-2026-03-aibrix2004-metrics-json.txt").read_bytes(),
    "/prometheus/metrics": (PUBLISHED / "trtllm-serve-2025-07-pr5785-unprefixed-ttft-excerpt.txt").read_bytes(),
    "/health": b"",
}


class TrtllmServe:
    """A trtllm-serve replay; `asked` lists the paths it was asked for, in order."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        asked = self.asked

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked.append(self.path)
                body = ANSWERS.get(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[TrtllmServe]:
    server = TrtllmServe()
    yield server
    server.close()


def doctor(*args: str) -> Report:
    parser = argparse.ArgumentParser()
    add_doctor_args(parser)
    return diagnose(parser.parse_args(list(args)))


def test_doctor_url_reads_trtllm_serve_from_its_prometheus_path(serve: TrtllmServe) -> None:
    # Before: /metrics' JSON has no metric and /v1/models is absent, so doctor said "something answers ... but it
    # is not an inference engine" and read nothing.
    report = doctor("--url", serve.url)
    assert report.kind == "tensorrt_llm"
    assert not [c for c in report.checks if c.title == "Inference server"]
    [ttft] = [c for c in report.checks if c.title == "Time to first token"]
    assert "over 2 requests" in ttft.evidence  # the PR #5785 text's 2 first tokens
    assert "/prometheus/metrics" in serve.asked


def test_a_watched_trtllm_serve_is_polled_at_its_prometheus_path_only(serve: TrtllmServe) -> None:
    # Before: the watcher read /metrics' JSON, recognised nothing and refused the engine.
    client = WatchedEngineClient(serve.url)
    try:
        first = client.snapshot()
        serve.asked.clear()
        second = client.snapshot()
    finally:
        client.close()
    assert first.source == second.source == "tensorrt_llm"
    assert second.ttft is not None and second.ttft.count == 2
    # Found once, then one metrics request a poll (the watcher asks /v1/models again while it has no answer).
    assert [path for path in serve.asked if path.endswith("metrics")] == ["/prometheus/metrics"]
