"""kvops watching a real vLLM it did not start: doctor --url, `kvops run`, `kvops top --once`.

The session's one vLLM of `kvops vllm setup` (conftest.py: managed by a supervisor in the test process, which
test_vllm_managed then kills and restarts), at block size 128 with a 96 MiB KV budget, sent short chats (~35-token
prompts), the load on which the block-size capacity diagnosis proposes --block-size 32. Every kvops command runs
as a subprocess, as a user would run it. Marker `vllm`; skipped with the reason when that vLLM or the exported
model is missing (the skip of test_vllm_managed.py).

The last test adds Debian's `prometheus` (skipped when absent) with alerts/kvops.rules.yml loaded and the scrape
config of docs/observability.md at 1 s: the `kvops run` of the module (job kvops-supervisor) and, through its HTTP
service discovery, the vLLM itself (job kvops-engine). On live data: every dashboard panel that reads the
per-engine series shows engine="vllm", the block size is 128 with kind="vllm", kvops's block_size_mismatch
diagnosis is active and the KvopsBlockSizeMismatch alert pending (its `for` is 5 min), vLLM's own `vllm:` series
are scraped, and every rule is healthy. The KV-pressure alert on a vLLM is tested with a replayed scrape in
test_prometheus_e2e.py (a full pool held for 30 s+ would cost minutes here).
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
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from kvops.doctor.liveness import known_prefixes
from kvops.processes import free_port, start_in_own_session
from tests.helpers.waiting import wait_for
from tests.test_prometheus_e2e import (
    EVERY_KIND_PANELS,
    PROMETHEUS,
    RULES,
    _dashboard_queries,
    _query,
    _rule_queries,
    _scrape_configs,
    _start,
    _stop,
)
from tests.test_vllm_managed import _chats, real

pytestmark = [pytest.mark.vllm, real]

CHATS = 32  # block_size_mismatch's capacity reading needs 20 finished requests in vLLM's length histograms


def _kvops(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvops", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vllm_url(shared_vllm: Any) -> str:
    """The session's one real vLLM (conftest.py), sent short chats; kvops watches it here as a server it did not
    start (its supervisor is another one, in the test process)."""
    engine = shared_vllm.engine()
    assert engine["up"] and engine["args"]["block_size"] == 128, (
        f"the shared vLLM is not at block size 128 ({engine}): run test_vllm_live before test_vllm_managed, whose "
        "block-size fix restarts it")
    print(f"\nvLLM watched by kvops at {engine['url']}")
    _chats(engine["url"], CHATS)
    return str(engine["url"])


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
        process = start_in_own_session([sys.executable, "-m", "kvops", "run", "--config", str(config)], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
    assert f"/metrics has no {known_prefixes()} metrics" in done.stdout and "kvops_, vllm:, sglang:" in done.stdout


def test_doctor_on_the_supervisor_url_says_what_it_found(vllm_url, supervisor):
    done = _kvops("doctor", "--url", supervisor)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out
    assert f"[✗] Inference server: {supervisor} is a kvops supervisor (kvops run), not an engine; it watches 1 " \
           f"engine(s): vllm (vllm) at {vllm_url}" in out, out
    assert f"→ kvops doctor --url {vllm_url}; kvops top --attach {supervisor}" in out


# ------------------------------------------------------------------ a real Prometheus on the real vLLM


@pytest.fixture(scope="module")
def prometheus(supervisor: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's `prometheus` with alerts/kvops.rules.yml, scraping the supervisor and, through its HTTP service
    discovery, the vLLM (the scrape config of docs/observability.md at 1 s); yields its base URL."""
    if PROMETHEUS is None:
        pytest.skip("needs Debian's `prometheus` (apt-get install prometheus); .ci/run installs it")
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port("127.0.0.1")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": _scrape_configs(urlsplit(supervisor).netloc),
    }))
    process = _start([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                      f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], tmp / "prometheus.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("Prometheus ready", lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30,
                 (process,))
        yield url
    finally:
        _stop(process)
        log = [line for line in (tmp / "prometheus.log").read_text(errors="replace").splitlines()
               if "Received SIGTERM" not in line]
        if log:
            sys.stderr.write("--- prometheus.log (tail)\n" + "\n".join(log[-20:]) + "\n")


def _last(prometheus: str, expr: str) -> list[tuple[dict[str, str], float]]:
    """(labels, latest value) of every series the expression gives over the last minute."""
    answer = _query(prometheus, expr)
    assert answer["http"] == 200 and answer["status"] == "success", (expr, answer)
    return [(s["metric"], float(s["values"][-1][1])) for s in answer["data"]["result"]]


def test_prometheus_with_the_rules_scrapes_kvops_and_the_real_vllm(vllm_url, supervisor, prometheus):
    started = time.monotonic()

    def targets() -> list[dict[str, Any]] | None:
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return active if len(active) == 2 and all(t["health"] == "up" for t in active) else None

    # The supervisor's HTTP service discovery lists the watched vLLM itself: Prometheus scrapes its /metrics.
    by_job = {t["labels"]["job"]: t for t in wait_for("both targets scraped", targets, 30, every_s=0.5)}
    assert set(by_job) == {"kvops-supervisor", "kvops-engine"}
    assert by_job["kvops-supervisor"]["scrapeUrl"] == f"{supervisor}/metrics"
    engine = by_job["kvops-engine"]
    assert engine["scrapeUrl"] == f"{vllm_url}/metrics" and engine["labels"]["engine"] == "vllm", engine
    wait_for("the block-size diagnosis", lambda: _capacity(httpx.get(f"{supervisor}/api/diagnoses").json()), 60,
             every_s=1)

    # More requests after Prometheus's first scrapes, so rates over the counters have samples that moved.
    _chats(vllm_url, 8)
    wait_for("the new tokens in Prometheus", lambda: _last(
        prometheus, 'increase(kvops_engine_generation_tokens_total{engine="vllm"}[1m]) > 0'), 30, every_s=0.5)

    # Every dashboard panel that reads the per-engine series shows the vLLM.
    engines_by_panel: dict[str, set[str]] = {}
    for title, expr in _dashboard_queries():
        if title in EVERY_KIND_PANELS:
            engines_by_panel.setdefault(title, set()).update(
                labels.get("engine", "") for labels, _ in _last(prometheus, expr.replace('engine=~".*"',
                                                                                         'engine=~"vllm"')))
    assert engines_by_panel == {title: {"vllm"} for title in EVERY_KIND_PANELS}, engines_by_panel

    block_size = _last(prometheus, 'kvops_engine_kv_block_size_tokens{engine="vllm"}')
    assert [(labels["kind"], value) for labels, value in block_size] == [("vllm", 128.0)], block_size
    # kvops's own block-size diagnosis on the live vLLM, and the rule of alerts/kvops.rules.yml reading it:
    # pending (its `for` is 5 min) for the vLLM, with the diagnosis's severity.
    active = _last(prometheus, 'kvops_diagnosis_active{id="block_size_mismatch", engine="vllm", kind="vllm"}')
    assert len(active) == 1 and active[0][1] > 0, active
    severity = active[0][0]["severity"]
    assert severity in ("warning", "critical"), active  # the info variant has no alert
    alert = wait_for("KvopsBlockSizeMismatch pending for the vLLM", lambda: _last(
        prometheus, 'ALERTS{alertname="KvopsBlockSizeMismatch", engine="vllm", kind="vllm"}'), 15, every_s=0.5)
    assert [(labels["alertstate"], labels["severity"], labels["diagnosis"]) for labels, _ in alert] == [
        ("pending", severity, "block_size_mismatch")], alert

    # Prometheus's own scrape of the real vLLM: vLLM's `vllm:` series, under the supervisor's engine name
    # (vLLM's own engine="0" label becomes exported_engine), and the same counter the supervisor reads.
    config = _last(prometheus, 'vllm:cache_config_info{job="kvops-engine", engine="vllm"}')
    assert len(config) == 1 and config[0][0]["block_size"] == "128", config

    def same_prefix_queries() -> tuple[float, float] | None:
        own = _last(prometheus, 'sum(vllm:prefix_cache_queries_total{job="kvops-engine", engine="vllm"})')
        read = _last(prometheus, 'kvops_engine_prefix_cache_query_tokens_total{job="kvops-supervisor", '
                                 'engine="vllm"}')
        return (own[0][1], read[0][1]) if own and read and own[0][1] == read[0][1] > 0 else None

    wait_for("vLLM's prefix-cache queries the same in both scrapes", same_prefix_queries, 15, every_s=0.5)

    # Every rule of alerts/kvops.rules.yml loaded, evaluated, healthy, on the vLLM's series.
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(name for name, _ in _rule_queries())
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        assert not rule["lastEvaluation"].startswith("0001"), f"{rule['name']} never evaluated"
    print(f"\nPrometheus on the live vLLM: block size {block_size[0][1]:g}, block_size_mismatch {severity} "
          f"({active[0][1]:g}), KvopsBlockSizeMismatch {alert[0][0]['alertstate']}, {len(rules)} rules ok, "
          f"{time.monotonic() - started:.0f} s")
