"""kvops watching a real vLLM it did not start (issue 16, point 5): doctor --url, `kvops run`, `kvops top --once`.

One vLLM of `kvops vllm setup` for the module, started here through kvops.vllm.launch at block size 128 with a
256 MiB KV budget, and sent short chats (~35-token prompts), the load on which the block-size capacity
diagnosis proposes --block-size 32. Every kvops command runs as a subprocess, as a user would run it. Marker
`vllm`; skipped with the reason when that vLLM or the exported model is missing (the skip of
test_vllm_managed.py).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_vllm_managed import VLLM_PYTHON, _chats, real
from waiting import wait_for

from kvops.processes import free_port
from kvops.vllm.launch import ServerSettings, start_server, stop_server, wait_ready
from kvops.vllm.model_export import default_model_dir

pytestmark = [pytest.mark.vllm, real]

CHATS = 32  # block_size_mismatch's capacity reading needs 20 finished requests in vLLM's length histograms


def _kvops(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvops", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = ServerSettings(model=default_model_dir(), port=free_port(), block_size=128,
                              kv_cache_memory_bytes=256 * 2**20, max_model_len=1024)
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with log_path.open("wb") as log:
        process = start_server(VLLM_PYTHON, settings, log)
        try:
            try:
                took = wait_ready(settings, process, timeout_s=420)
            except RuntimeError as exc:
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                raise AssertionError(f"{exc}; its last lines:\n" + "\n".join(tail)) from None
            print(f"\nvLLM watched by kvops: up in {took:.0f} s at {settings.url}")
            _chats(settings.url, CHATS)
            yield settings.url
        finally:
            stop_server(process)


@pytest.fixture(scope="module")
def supervisor(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `kvops run` watching the vLLM; yields its base URL."""
    state = tmp_path_factory.mktemp("supervisor")
    listen = f"127.0.0.1:{free_port()}"
    config = state / "kvops.toml"
    config.write_text(f'[supervisor]\nlisten = "{listen}"\nstate_dir = "{state}"\npoll_interval_s = 0.5\n'
                      f'alert_warmup_s = 0\n\n[[engines]]\nname = "vllm"\nurl = "{vllm_url}"\n\n'
                      f'[rules.block_size_mismatch]\npolicy = "suggest"\n')
    log_path = state / "kvops-run.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "kvops", "run", "--config", str(config)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://{listen}"

            def answers() -> bool:
                assert process.poll() is None, f"kvops run exited: {log_path.read_text(errors='replace')}"
                try:
                    return httpx.get(f"{url}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for("kvops run answering", answers, 60, every_s=0.5)
            yield url
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def _capacity(diagnoses: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((d for d in diagnoses if d["rule"] == "block_size_mismatch" and d["subject"] == "capacity"), None)


def test_doctor_recognises_the_real_vllm_and_flags_its_block_size(vllm_url):
    done = _kvops("doctor", "--url", vllm_url, "--json")
    assert done.returncode == 1, done.stdout + done.stderr  # 1: it flags something
    report = json.loads(done.stdout)
    assert report["flavour"] == "vllm" and report["exit_code"] == 1
    checks = {c["title"]: c for c in report["checks"]}
    assert checks["Health"]["status"] == "ok"
    pool = checks["KV cache usage"]
    assert re.search(r"in use of \d+ blocks", pool["evidence"]), pool
    block = checks["Block size 128 (KV capacity)"]
    assert block["status"] in ("warn", "fail") and block["rule"] == "block_size_mismatch"
    assert re.search(r"block size 128 leaves \d+% of allocated KV slots empty .*at 32, \d+%", block["evidence"])
    assert "--block-size 32 (now 128)" in block["remedy"]
    detail = "\n".join(block["detail"])
    for line in ("block_size = 128", "proposed_block_size = 32"):
        assert line in detail, detail
    requests = re.search(r"^requests = (\d+)$", detail, re.M)
    assert requests and int(requests[1]) >= CHATS, detail  # doctor's own one-token completions count too
    assert re.search(r"^kv_freed_fraction = 0\.\d+$", detail, re.M) and "fragmentation_by_block_size = " in detail

    text = _kvops("doctor", "--url", vllm_url)
    assert text.returncode == 1
    assert f"kvops doctor: {vllm_url} (vllm)" in text.stdout  # the kind it recognised, in the header
    # [!] warning, [✗] critical: ~50% of the KV freed here sits on the warning/critical line.
    assert re.search(r"\[[!✗]\] Block size 128 \(KV capacity\)", text.stdout) and "--block-size 32" in text.stdout
    assert "Traceback" not in text.stdout + text.stderr


def test_kvops_run_watching_the_real_vllm_gives_the_same_diagnosis(vllm_url, supervisor):
    api = httpx.Client(base_url=supervisor, timeout=10)

    def vllm_up() -> dict[str, Any] | None:
        engine = next(e for e in api.get("/api/engines").json() if e["name"] == "vllm")
        return engine if engine["up"] else None

    engine = wait_for("the vLLM up", vllm_up, 60, every_s=0.5)
    assert engine["url"] == vllm_url and engine["managed"] is False
    # Recognised as vLLM from its /metrics (configured kind "auto"; /api/engines repeats the configured kind).
    snapshot = api.get("/api/engines/vllm/snapshot").json()
    assert snapshot["source"] == "vllm" and snapshot["engine"]["block_size"] == 128
    diagnosis = wait_for("the block-size diagnosis", lambda: _capacity(api.get("/api/diagnoses").json()), 60,
                         every_s=1)
    assert diagnosis["engine"] == "vllm"
    assert diagnosis["fix"]["params"] == {"block_size": 32}
    assert diagnosis["evidence"]["block_size"] == 128 and diagnosis["evidence"]["proposed_block_size"] == 32
    metrics = api.get("/metrics").text
    assert re.search(r'^kvops_engine_kv_block_size_tokens\{engine="vllm",kind="vllm"\} 128(\.0)?$', metrics,
                     re.M), [line for line in metrics.splitlines() if "block_size" in line]


def test_top_once_shows_the_watched_vllm_and_its_diagnosis(supervisor):
    api = httpx.Client(base_url=supervisor, timeout=10)
    wait_for("the block-size diagnosis", lambda: _capacity(api.get("/api/diagnoses").json()), 60, every_s=1)
    done = _kvops("top", "--once", "--attach", supervisor, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vllm" in done.stdout
    assert "block_size_mismatch" in done.stdout or "Block size wastes KV capacity" in done.stdout, done.stdout


class _Html(http.server.BaseHTTPRequestHandler):
    """A web server that is no inference engine: 200 and an HTML page on every path."""

    def do_GET(self) -> None:
        body = b"<!doctype html><html><head><title>Welcome</title></head><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_doctor_on_a_url_that_is_not_vllm_says_what_it_found():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done = _kvops("doctor", "--url", url)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    assert f"something answers at {url} but it is not an inference engine: GET /health → 200 text/html" in done.stdout
    assert "/metrics has no kvops_, vllm: or sglang: metrics" in done.stdout


def test_doctor_on_the_supervisor_url_says_what_it_found(vllm_url, supervisor):
    done = _kvops("doctor", "--url", supervisor)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out
    assert f"[✗] Inference server: {supervisor} is a kvops supervisor (kvops run), not an engine; it watches 1 " \
           f"engine(s): vllm (vllm) at {vllm_url}" in out, out
    assert f"→ kvops doctor --url {vllm_url}; kvops top --attach {supervisor}" in out
