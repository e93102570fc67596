"""A vLLM managed by kvops.

Fast tests: a restart fix's kvops settings as vLLM's args, [engines.args] as vLLM's command line, and the
lifecycle with a fake vLLM interpreter (a small script that serves /health and /metrics, or dies at start
like a vLLM refusing a flag). Real tests (marker `vllm`): the supervisor managing the real vLLM of
`kvops vllm setup`, the one vLLM of the session (conftest.py; test_vllm_live watches it first), with the
supervisor API on a real port: kill -9 -> restarted; short chats -> the block-size diagnosis, its fix applied
through the API -> restarted with the new --block-size, and judged. Skipped with the reason when that vLLM or the
model is missing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from kvops.history import EngineHistory
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.errors import ConfigError
from kvops.supervisor.config import KvopsConfig, parse_config
from kvops.supervisor.launchers import launcher_for
from kvops.supervisor.managed_engine import ManagedEngine
from kvops.supervisor.own_polls import access_line
from kvops.vllm.flags import FIX_SETTINGS, InstalledFlags, args_for_fix, cli_flags, server_settings
from kvops.vllm.install import default_venv_dir, venv_python
from kvops.vllm.launch import server_argv, server_env
from kvops.vllm.model_export import default_model_dir, export_is_complete
from tests.helpers.waiting import wait_for

VLLM_PYTHON = venv_python(default_venv_dir())


# ------------------------------------------------------------------ settings and flags


def test_a_restart_fix_sets_vllm_flags_by_the_mapping_table():
    args = {"block_size": 128, "kv_cache_memory": "256MiB", "max_model_len": 1024}
    new = args_for_fix(args, {"block_size": 32, "kv_cache_memory": 2**27, "enable_prefix_caching": True,
                              "max_num_seqs": 8, "kv_cache_dtype": "fp8"})
    assert new == {"block_size": 32, "kv_cache_memory": 2**27, "max_model_len": 1024, "enable_prefix_caching": True,
                   "max_num_seqs": 8, "kv_cache_dtype": "fp8"}
    assert args["block_size"] == 128  # the old args stay as they were: the rollback restores them
    assert {"block_size", "enable_prefix_caching", "kv_cache_dtype", "max_num_seqs", "kv_cache_memory"} <= set(
        FIX_SETTINGS)


@pytest.mark.parametrize(("params", "message"), [
    ({"kv_cache_dtype": "int8"}, "vLLM has no int8 KV cache"),
    ({"kv_cache_dtype_skip_layers": [0]}, "kv_cache_dtype_skip_layers, a kvops engine setting vLLM has no flag"),
])
def test_a_fix_vllm_cannot_take_is_refused(params, message):
    with pytest.raises(ValueError, match=message):
        args_for_fix({}, params)


def test_engine_args_become_the_vllm_command_line(tmp_path):
    settings = server_settings({"block_size": 32, "enable_prefix_caching": False, "kv_cache_memory": "64MiB",
                                "max_num_seqs": 4, "kv_cache_dtype": "auto", "enforce_eager": True,
                                "max_model_len": 1024}, "127.0.0.1", 8123)
    argv = " ".join(server_argv("py", settings))
    assert f"--model {default_model_dir()}" in argv  # the shipped model by default, served as smollm2 in fp32
    for part in ("--served-model-name smollm2", "--dtype float32", "--max-model-len 1024", "--port 8123",
                 "--block-size 32", "--no-enable-prefix-caching", "--kv-cache-memory-bytes 67108864",
                 "--max-num-seqs 4", "--kv-cache-dtype auto", "--enforce-eager"):
        assert part in argv
    env = server_env(settings, base={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override the flag
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    # A model of one's own: vLLM's defaults for what is not given (no fp32, no 2048 cap, its own name).
    own = " ".join(server_argv("py", server_settings({"model": "org/model"}, "127.0.0.1", 1)))
    assert "--model org/model" in own and "--dtype" not in own and "--served-model-name" not in own
    assert server_env(server_settings({}, "h", 1), base={})["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_cli_flags_spell_vllm_flags():
    assert cli_flags({"a_b": True, "c": False, "d": [1, 2], "e": {"k": 1}, "f": None, "g": 3}) == [
        "--a-b", "--no-c", "--d", "1", "2", "--e", '{"k": 1}', "--g", "3"]


def test_installed_flags_name_the_closest_ones():
    flags = InstalledFlags("0.32.0", frozenset({"--block-size", "--max-num-seqs", "--enable-prefix-caching",
                                                "--no-enable-prefix-caching", "--enforce-eager"}))
    assert flags.problem({"block_size": 32, "kv_cache_memory": "1GiB", "enable_prefix_caching": False}) is None
    assert flags.problem({"blok_size": 32}) == "args.blok_size: vLLM 0.32.0 has no flag --blok-size; closest: " \
                                               "--block-size"
    assert "is a switch without a --no-enforce-eager form" in flags.problem({"enforce_eager": False})


FLAGS_OF = """\
#!{python}
# A stand-in for a vLLM interpreter answering kvops.vllm.flags' two questions: where vLLM is, and its flags.
import json, sys
code = sys.argv[-1]
if "find_spec" in code:
    print("KVOPS_VLLM_FLAGS " + json.dumps(["/opt/vllm/vllm/__init__.py", 1.0]))
else:
    print("KVOPS_VLLM_FLAGS " + json.dumps({{"version": "0.32.0", "flags": {flags}}}))
"""
ENDPOINTS_FLAG = "--disable-access-log-for-endpoints"
WHOLE_FLAG = "--disable-uvicorn-access-log"


@pytest.mark.parametrize(("flags", "args", "endpoints"), [
    ([ENDPOINTS_FLAG, WHOLE_FLAG], {}, "/health,/metrics"),  # vLLM 0.32: kvops's polls out, clients' requests in
    ([WHOLE_FLAG], {}, None),  # a vLLM without the flag: none added (the forwarder drops the lines)
    ([], {}, None),
    ([ENDPOINTS_FLAG], {"disable_access_log_for_endpoints": "/ping"}, "/ping"),  # the user's own setting wins
    ([ENDPOINTS_FLAG, WHOLE_FLAG], {"disable_uvicorn_access_log": True}, None),  # so does the whole log off
])
def test_a_managed_vllm_keeps_kvops_polls_out_of_its_access_log_where_it_has_the_flag(tmp_path, monkeypatch, flags,
                                                                                       args, endpoints):
    monkeypatch.setenv("KVOPS_CACHE_DIR", str(tmp_path / "cache"))  # the flags are cached per installation
    fake = tmp_path / "python"
    fake.write_text(FLAGS_OF.format(python=sys.executable, flags=json.dumps(flags)))
    fake.chmod(0o755)
    spec = parse_config({"engines": [{"name": "v", "kind": "vllm", "python": str(fake), "events": False,
                                      "args": {"model": "org/model", **args}}]}, "test").engines[0]
    argv = launcher_for(spec.kind, spec.start()).launch(spec.host, 8123, spec.args, spec.drain_timeout_s, "").argv
    assert argv.count(ENDPOINTS_FLAG) == (endpoints is not None)
    if endpoints is not None:
        assert argv[argv.index(ENDPOINTS_FLAG) + 1] == endpoints
    assert (WHOLE_FLAG in argv) is bool(args.get("disable_uvicorn_access_log"))


# ------------------------------------------------------------------ lifecycle with a fake vLLM

FAKE_VLLM = """\
#!{python}
# A stand-in for vLLM's interpreter: `-m vllm...api_server ARGS` serves /health and a /metrics with vLLM's
# cache_config_info; a --block-size under 32 dies at start the way vLLM's CPU build does.
import http.server, sys
argv = sys.argv
block = argv[argv.index("--block-size") + 1] if "--block-size" in argv else "128"
port = int(argv[argv.index("--port") + 1])
print("INFO starting fake vLLM", " ".join(argv[1:]), flush=True)
if int(block) % 32:
    print(f"ValueError: No common block size for {{block}} (CPU_ATTN: [MultipleOf(32)])", flush=True)
    sys.exit(1)
METRICS = ('vllm:cache_config_info{{block_size="%s",enable_prefix_caching="True",num_gpu_blocks="100",'
           'cache_dtype="auto"}} 1.0\\nvllm:kv_cache_usage_perc{{model_name="m"}} 0.0\\n'
           'vllm:num_requests_running{{model_name="m"}} 0.0\\nvllm:num_requests_waiting{{model_name="m"}} 0.0\\n'
           % block)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = METRICS.encode() if self.path == "/metrics" else b'{{"object": "list", "data": []}}' \\
            if self.path == "/v1/models" else b""
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    path = tmp_path / "fake-vllm-python"
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _managed(fake: Path, block_size: int) -> ManagedEngine:
    config = parse_config({"engines": [{"name": "v", "kind": "vllm", "python": str(fake), "health_timeout_s": 20,
                                        "args": {"model": "org/model", "block_size": block_size}}]}, "test")
    return ManagedEngine(config.engines[0], EngineHistory("v", managed=True))


def test_a_managed_vllm_is_read_through_the_adapter_and_restarted_with_new_flags(fake_vllm):
    engine = _managed(fake_vllm, 128)
    engine.start()
    try:
        engine.wait_healthy()
        client = engine.client()
        assert client.snapshot().engine.block_size == 128 and client.admin_token is None
        engine.restart_with(engine.settings_with({"block_size": 32}))
        cmdline = " ".join(psutil.Process(engine.pid).cmdline())
        assert "--block-size 32" in cmdline and "--shutdown-timeout 30" in cmdline  # drain_timeout_s
        assert client.snapshot().engine.block_size == 32
        client.close()
    finally:
        engine.stop()


def test_a_vllm_that_does_not_start_is_restored_and_its_lines_reported(fake_vllm):
    engine = _managed(fake_vllm, 128)
    engine.start()
    try:
        engine.wait_healthy()
        with pytest.raises(Exception, match=r"No common block size for 16 .*restarted with the previous settings"):
            engine.restart_with(engine.settings_with({"block_size": 16}))
        engine.wait_healthy()
        assert engine.args["block_size"] == 128
        assert any("did not come up with the new settings" in line.text for line in engine.log_tail)
    finally:
        engine.stop()


# ------------------------------------------------------------------ check-config


def _check(tmp_path: Path, python: str, args: str = "block_size = 32") -> tuple[int, str]:
    import subprocess

    path = tmp_path / "kvops.toml"
    path.write_text(f'[[engines]]\nname = "v"\nkind = "vllm"\npython = "{python}"\n[engines.args]\n'
                    f'model = "{tmp_path}"\n{args}\n')
    done = subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(path), "--check-config"],
                          capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                          "KVOPS_CACHE_DIR": str(tmp_path)})
    return done.returncode, done.stdout + done.stderr


def test_check_config_without_vllm_names_the_setup_command(tmp_path):
    code, out = _check(tmp_path, sys.executable)  # kvops's own interpreter has no vLLM
    assert code == 2 and "Traceback" not in out
    assert f"engines[0] (v): vLLM is not installed for {sys.executable}: run `kvops vllm setup`" in out
    code, out = _check(tmp_path, str(tmp_path / "nothing"))
    assert code == 2 and "does not run" in out and "kvops vllm setup" in out and "Traceback" not in out


FAKE_INSTALLED = """\
#!{python}
import json, sys
code = sys.argv[-1]
mark = "KVOPS_VLLM_FLAGS "
if "find_spec" in code:
    print(mark + json.dumps(["/opt/vllm/__init__.py", 1.0]))
else:
    print(mark + json.dumps({{"version": "0.32.0", "flags": ["--block-size", "--model", "--max-num-seqs",
                                                     "--shutdown-timeout"]}}))
"""


def test_check_config_refuses_a_flag_the_installed_vllm_lacks(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_INSTALLED.format(python=sys.executable))
    fake.chmod(0o755)
    code, out = _check(tmp_path, str(fake), "blok_size = 32")
    assert code == 2 and "Traceback" not in out
    assert "engines[0] (v): args.blok_size: vLLM 0.32.0 has no flag --blok-size; closest: --block-size" in out
    code, out = _check(tmp_path, str(fake), "block_size = 32\nmax_num_seqs = 4")
    assert code == 0, out
    assert list((tmp_path / "vllm-flags").glob("*.json"))  # asked once, cached


# ------------------------------------------------------------------ the real vLLM

real = pytest.mark.skipif(
    not VLLM_PYTHON.exists() or not export_is_complete(default_model_dir()),
    reason=f"no vLLM at {VLLM_PYTHON} or no exported model at {default_model_dir()}: run `kvops vllm setup`")


def _chats(url: str, count: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def chat(i: int) -> None:
        body = {"model": "smollm2", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": f"Question {i}: name one colour of the sky."}]}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(chat, range(count)))


def _living_in_group(pgid: int) -> list[int]:
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


class Served:
    """The supervisor of `kvops run`, in this process, with its API on a real port."""

    def __init__(self, config: KvopsConfig, token: str) -> None:
        import uvicorn

        from kvops.supervisor.api import build_supervisor_app
        from kvops.supervisor.supervisor import Supervisor

        self.sup = Supervisor(config, admin_token=token)
        host, port = config.supervisor.listen.rsplit(":", 1)
        self.api = httpx.Client(base_url=f"http://{config.supervisor.listen}", timeout=30,
                                headers={"Authorization": f"Bearer {token}"})
        self.server = uvicorn.Server(uvicorn.Config(build_supervisor_app(self.sup), host=host, port=int(port),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def engine(self) -> dict[str, Any]:
        return self.api.get("/api/engines").json()[0]


@pytest.fixture
def served(shared_vllm: Served) -> Served:
    """The session's one real vLLM (conftest.py), at block size 128 when these tests start."""
    return shared_vllm


def _requests_logged(served: Served) -> list[tuple[str, str]]:
    """The requests in the managed vLLM's log (its access-log lines), as (method, path)."""
    logs = served.api.get("/api/engines/vllm/logs?lines=500").json()
    return [(a.method, a.path) for line in logs if (a := access_line(line["text"]))]


@pytest.mark.vllm
@real
def test_real_vllm_killed_is_restarted(served):
    before = served.engine()
    pid = before["pid"]
    assert before["kind"] == "vllm" and before["args"]["block_size"] == 128
    restarts = before["events"]["publisher_restarts_total"]
    assert served.api.get("/api/engines/vllm/snapshot").json()["engine"]["block_size"] == 128  # via the adapter
    # The engine log has a client's request and none of the supervisor's polls of /metrics (two a second): vLLM 0.32
    # is started with --disable-access-log-for-endpoints.
    assert "--disable-access-log-for-endpoints /health,/metrics" in " ".join(psutil.Process(pid).cmdline())
    body = {"model": "smollm2", "prompt": list(range(2000, 2000 + 300)), "max_tokens": 1}
    httpx.post(f"{before['url']}/v1/completions", json=body, timeout=120).raise_for_status()
    wait_for("the client's request in the engine log",
             lambda: ("POST", "/v1/completions") in _requests_logged(served), 10)
    assert ("GET", "/metrics") not in _requests_logged(served), _requests_logged(served)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for("vLLM restarted after kill -9",
             lambda: (e := served.engine())["up"] and e["pid"] not in (None, pid) and e["restarts"] >= 1, 300,
             every_s=1)
    print(f"\nvLLM restarted after kill -9: up again in {time.monotonic() - killed:.0f} s")
    assert served.engine()["last_exit"]["signal"] == signal.SIGKILL
    assert not _living_in_group(pid)  # its engine core went with it
    logs = [line["text"] for line in served.api.get("/api/engines/vllm/logs?lines=500").json()]
    assert any("exited (signal SIGKILL); restarting" in text for text in logs)
    # The KV event stream: stale since the kill (nothing the index holds is in the new process's cache) until the
    # new publisher's first batch, whose sequence starts at 0 again: a publisher restart, and an index reset.
    assert served.engine()["events"]["stale"] is True
    url = served.engine()["url"]
    body = {"model": "smollm2", "prompt": list(range(1000, 1000 + 300)), "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
    events = wait_for("the new publisher's first batch", lambda: (e := served.engine()["events"])[
        "publisher_restarts_total"] > restarts and not e["stale"] and e, 30)
    assert ("GET", "/metrics") not in _requests_logged(served), _requests_logged(served)  # the new process's too
    assert events["dropped_batches_total"] == 0 and not events["error"], events
    resident = served.api.get("/api/engines/vllm/snapshot").json()["kv_events"]["resident"]
    assert resident == {"GPU": 2}, resident  # the 300-token prompt's two full blocks, nothing from before the kill


@pytest.mark.vllm
@real
def test_real_vllm_block_size_fix_restarts_with_the_new_flag_and_is_judged(served):
    # Short chats at block size 128, all the way through: each holds a 128-token block for ~50 tokens (the
    # block_size_waste rule needs 20 finished requests in vLLM's length histograms), and the fix's windows
    # before and after it need requests to judge on.
    stop = threading.Event()

    def steady_chats() -> None:
        while not stop.is_set():
            engine = served.engine()
            if not engine["up"]:
                time.sleep(1)
                continue
            try:
                _chats(engine["url"], 8)
            except httpx.HTTPError:
                time.sleep(1)  # restarting

    load = threading.Thread(target=steady_chats, daemon=True)
    load.start()
    try:
        _judged_block_size_fix(served)
    finally:
        stop.set()
        load.join(timeout=180)


def _judged_block_size_fix(served: Served) -> None:
    def proposal() -> Diagnosis | None:
        # The block-size rules' proposal (low_hit_cause's short_prompts cause proposes the same flag, judged by
        # the hit rate: not what this test judges).
        return next((d for d in served.sup.diagnoses if d.rule.startswith("block_size") and d.fix
                     and d.fix.kind is FixKind.RESTART and "block_size" in d.fix.params), None)

    try:
        proposed = wait_for("a block-size diagnosis", proposal, 60)
    except AssertionError:
        proposed = None
    time.sleep(20)  # a full before-window of traffic (verify_after_s)
    started = time.monotonic()
    if proposed is not None:  # a rule proposes it on this load: through the API, as a person would
        response = served.api.post("/api/fixes/apply", timeout=60, json={
            "engine": "vllm", "rule": proposed.rule, "subject": proposed.subject})
        assert response.status_code == 200, response.text
        new_block = proposed.fix.params["block_size"]
    else:  # no rule proposed it on this load: the same restart path, in process
        new_block = 32
        diagnosis = Diagnosis(rule="block_size_mismatch", engine="vllm", severity=Severity.WARNING,
                              title="block size", summary="test", evidence={"waste": 0.7},
                              fix=Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": 32},
                                      description="restart with --block-size 32",
                                      objectives=[Objective(measure="kv_slots_per_request", better="lower",
                                                            min_effect=0.1)]))
        served.sup.fixes.apply(diagnosis)
    how = f"proposed by {proposed.rule}, applied through the API" if proposed else "applied in process"
    # The fix runs as a job beside the poll loop: queued, then the restart, then its window.
    engine = wait_for("vLLM restarted with the new block size",
                      lambda: (e := served.engine())["up"] and e["args"]["block_size"] == new_block and e, 420)
    print(f"\nvLLM restarted with --block-size {new_block} ({how}): up in {time.monotonic() - started:.0f} s")
    pid = engine["pid"] or wait_for("its pid", lambda: served.engine()["pid"], 30)
    assert f"--block-size {new_block}" in " ".join(psutil.Process(pid).cmdline())
    wait_for("a snapshot at the new block size",
             lambda: served.api.get("/api/engines/vllm/snapshot").json()["engine"]["block_size"] == new_block, 180)
    verdict = wait_for("the fix's verdict", lambda: next(
        (e for e in served.api.get("/api/audit").json() if e["action"] in ("verified", "rolled_back", "failed")),
        None), 600)
    applied = next(e for e in served.api.get("/api/audit").json() if e["action"] == "verifying")
    assert applied["before"]["block_size"] == 128 and applied["after"]["block_size"] == new_block
    judged = verdict["verdict"]
    print(f"verdict: {verdict['action']} ({judged['kind']}): {verdict['message']}")
    assert judged["objectives"] and judged["objectives"][0]["measure"] in ("kv_slots_per_request", "slot_efficiency")
    assert judged["traffic_before"] > 0, judged  # judged on requests, not on the diagnosis going away
    if judged["kind"] == "improved":
        assert verdict["action"] == "verified"
    else:  # no effect, worse, inconclusive: back on 128, restarted and answering
        assert verdict["action"] in ("rolled_back", "failed")
        wait_for("vLLM back on block size 128", lambda: (e := served.engine())["up"] and e["args"]["block_size"] == 128,
                 420)


def test_config_errors_for_a_managed_vllm_name_the_key():
    with pytest.raises(ConfigError, match=r"engines\[0\]\.args: port is the engine's own key"):
        parse_config({"engines": [{"name": "v", "kind": "vllm", "args": {"port": 1}}]}, "kvops.toml")
