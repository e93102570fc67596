"""`kvops bench fleet`: how many engines one supervisor can watch.

For each fleet size it starts the simulated engines (kvops/bench/fleet_engines.py: real vLLM scrapes replayed on
loopback, three of them driven into trouble partway through), one `kvops run` watching all of them at the default
poll interval, and a webhook receiver for its alerts, each in a process of its own. Over the run it measures the
supervisor process: its CPU seconds per second (`cpu_cores`), its peak resident memory, the share of its poll
cycles that ended within the poll interval, how late cycles started, how long one evaluation of every rule took,
and how long after each engine's trouble began its alert arrived.

    kvops bench fleet --engines 10,100,300 --duration 120 --json docs/results/fleet.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

from kvops.adapters.http_client import HttpClient, HttpError
from kvops.adapters.prometheus import Scrape
from kvops.bench.compare import machine
from kvops.bench.fleet_engines import CAPTURES
from kvops.processes import free_port, start_in_own_session

# The rules the troubles should raise, with windows short enough for a run of a few minutes (their defaults are
# 1-5 minutes; the windows do not change what a poll costs).
RULES = {"kv_oom_runtime": {"window_s": 20.0}, "queueing": {"window_s": 20.0}, "no_prefix_hits": {"window_s": 20.0}}
EXPECTED_ALERT = {"kv_pressure": "kv_oom_runtime", "queueing": "queueing", "zero_hits": "no_prefix_hits"}
FOR_S = 10.0  # every alert's `for`: the alert fires when the diagnosis has held this long
WARMUP_S = 20.0  # not measured: the supervisor's start and its first history
TROUBLE_AT_S = 45.0  # after the simulator starts


@dataclass
class FleetRow:
    engines: int
    duration_s: float
    cpu_cores: float  # the supervisor's CPU seconds per second over the measured span
    rss_mb: float  # its peak resident memory
    polls: int
    polls_on_time: float  # share of poll cycles that ended within the poll interval
    poll_interval_s: float
    poll_p50_s: float | None  # from the histogram: the bound of the bucket that holds the quantile
    poll_p99_s: float | None
    lateness_p99_s: float | None
    evaluation_mean_s: float | None  # one evaluation of every rule on every engine
    alert_latency_s: float | None  # the slowest of the troubled engines: trouble begun -> alert received
    alert_for_s: float
    evaluation_interval_s: float
    alerts: dict[str, dict[str, object]] = field(default_factory=dict)  # engine -> trouble, alertname, latency
    poll_errors: int = 0
    engines_up: int = 0


class _Receiver:
    """A webhook receiver: every alert that arrives firing, with when it arrived."""

    def __init__(self) -> None:
        self.firing: dict[str, tuple[float, str]] = {}  # engine -> (arrival, alertname), the first only
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.time()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with contextlib.suppress(ValueError):
                    for alert in json.loads(body).get("alerts", []):
                        labels = alert.get("labels", {})
                        if alert.get("status") == "firing" and "engine" in labels:
                            outer.firing.setdefault(labels["engine"], (arrived, labels.get("alertname", "")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def engine_name(index: int) -> str:
    return f"e{index:04d}"


def config_text(engines: int, port: int, listen: int, state: Path, receiver: str) -> str:
    """The `kvops run` configuration: every simulated engine watched as a vLLM, the alerts to the receiver."""
    lines = ["[supervisor]", f'listen = "127.0.0.1:{listen}"', f'state_dir = "{state}"', "alert_warmup_s = 5", "",
             "[alerting]", f"default_for_s = {FOR_S}", f"critical_for_s = {FOR_S}", "group_wait_s = 0",
             "group_interval_s = 5", "", "[[alerting.receivers]]", 'name = "bench"', f'url = "{receiver}"', ""]
    for rule, settings in RULES.items():
        lines += [f"[rules.{rule}.settings]", *(f"{k} = {v}" for k, v in settings.items()), ""]
    for i in range(engines):
        lines += ["[[engines]]", f'name = "{engine_name(i)}"', f'url = "http://127.0.0.1:{port}/e/{i}"',
                  'kind = "vllm"', ""]
    return "\n".join(lines)


def _quantile(scrape: Scrape, earlier: Scrape, base: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile q of what a histogram counted between two scrapes."""
    now, then = scrape.histogram(base), earlier.histogram(base)
    if now is None or then is None:
        return None
    bounds, counts = now[0], [a - b for a, b in zip(now[1], then[1], strict=True)]
    total = sum(counts)
    if total <= 0:
        return None
    running = 0
    for bound, n in zip((*bounds, math.inf), counts, strict=True):
        running += n
        if running >= q * total:
            return bound
    return math.inf


def _delta(scrape: Scrape, earlier: Scrape, name: str) -> float:
    return (scrape.value(name) or 0.0) - (earlier.value(name) or 0.0)


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    from kvops.vllm.launch import stop_server

    with log.open("wb") as out:
        process = start_in_own_session(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        stop_server(process, timeout_s=15.0)


def _first_line(log: Path, process: subprocess.Popen[bytes], timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "\n" in text:
            return json.loads(text.split("\n", 1)[0])
        if process.poll() is not None:
            raise RuntimeError(f"the simulated engines exited ({process.returncode}): {text[-500:]}")
        time.sleep(0.05)
    raise RuntimeError(f"the simulated engines did not start within {timeout_s:.0f} s")


def _metrics(client: HttpClient, timeout_s: float = 60.0) -> Scrape:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Scrape.parse(client.request("GET", "/metrics", timeout=30.0).text)
        except HttpError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_one(engines: int, duration_s: float, workdir: Path, warmup_s: float = WARMUP_S,
            trouble_at_s: float = TROUBLE_AT_S) -> FleetRow:
    """One fleet size: the engines, the supervisor and the receiver up for `duration_s` after `warmup_s`; the
    troubles begin `trouble_at_s` after the engines start."""
    receiver = _Receiver()
    sim_log, sup_log = workdir / f"engines-{engines}.log", workdir / f"supervisor-{engines}.log"
    sim_argv = [sys.executable, "-m", "kvops.bench.fleet_engines", "--engines", str(engines),
                "--trouble-at", str(trouble_at_s)]
    try:
        with _process(sim_argv, sim_log) as simulator:
            started = _first_line(sim_log, simulator, 30.0)
            listen = free_port()
            config = workdir / f"fleet-{engines}.toml"
            config.write_text(config_text(engines, int(started["port"]), listen, workdir / f"state-{engines}",
                                          receiver.url))
            with _process([sys.executable, "-m", "kvops", "run", "--config", str(config)], sup_log) as supervisor:
                return _measure(engines, duration_s, warmup_s, supervisor, listen, started, receiver)
    finally:
        receiver.close()


def _measure(engines: int, duration_s: float, warmup_s: float, supervisor: subprocess.Popen[bytes], listen: int,
             started: dict[str, object], receiver: _Receiver) -> FleetRow:
    client = HttpClient(f"http://127.0.0.1:{listen}", timeout_s=30.0)
    proc = psutil.Process(supervisor.pid)
    _metrics(client)  # it answers
    time.sleep(warmup_s)
    first, cpu0, t0 = _metrics(client), sum(proc.cpu_times()[:2]), time.monotonic()
    rss = proc.memory_info().rss
    end = t0 + duration_s
    while time.monotonic() < end:
        if supervisor.poll() is not None:
            raise RuntimeError(f"the supervisor exited ({supervisor.returncode}) while measured")
        time.sleep(1.0)
        rss = max(rss, proc.memory_info().rss)
    cpu1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
    last = _metrics(client)
    client.close()
    polls = _delta(last, first, "kvops_supervisor_polls_total")
    late = _delta(last, first, "kvops_supervisor_polls_late_total")
    evaluations = _delta(last, first, "kvops_supervisor_rule_evaluation_seconds_count")
    trouble_began = float(started["started_at"]) + float(started["trouble_at_s"])
    troubles = {engine_name(int(i)): str(kind) for i, kind in dict(started["troubles"]).items()}  # type: ignore[call-overload]
    alerts: dict[str, dict[str, object]] = {}
    for name, trouble in troubles.items():
        arrived = receiver.firing.get(name)
        alerts[name] = {"trouble": trouble, "expected": EXPECTED_ALERT[trouble],
                        "alertname": arrived[1] if arrived else None,
                        "latency_s": round(arrived[0] - trouble_began, 2) if arrived else None}
    latencies = [a["latency_s"] for a in alerts.values()]
    return FleetRow(
        engines=engines, duration_s=round(t1 - t0, 1), cpu_cores=round((cpu1 - cpu0) / (t1 - t0), 3),
        rss_mb=round(rss / 2**20, 1), polls=int(polls), polls_on_time=round(1 - late / polls, 4) if polls else 0.0,
        poll_interval_s=0.5, poll_p50_s=_quantile(last, first, "kvops_supervisor_poll_duration_seconds", 0.5),
        poll_p99_s=_quantile(last, first, "kvops_supervisor_poll_duration_seconds", 0.99),
        lateness_p99_s=_quantile(last, first, "kvops_supervisor_poll_lateness_seconds", 0.99),
        evaluation_mean_s=round(_delta(last, first, "kvops_supervisor_rule_evaluation_seconds_sum") / evaluations, 4)
        if evaluations else None,
        alert_latency_s=None if None in latencies or not latencies else max(float(x) for x in latencies),  # type: ignore[arg-type]
        alert_for_s=FOR_S, evaluation_interval_s=0.5, alerts=alerts,
        poll_errors=int(_delta(last, first, "kvops_engine_poll_errors_total")),
        engines_up=int(last.value("kvops_engine_up") or 0))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvops bench fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="10,100,300", help="fleet sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds measured at each size, after the warm-up (default: %(default)s; long enough "
                             "for the troubles to begin and alert)")
    parser.add_argument("--trouble-at", type=float, default=TROUBLE_AT_S,
                        help="seconds after the engines start that three of them get into trouble (default: "
                             "%(default)s)")
    parser.add_argument("--warmup", type=float, default=WARMUP_S,
                        help="seconds after the supervisor answers before measuring (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the rows here, with the machine")
    parser.add_argument("--plot", type=Path, help="draw CPU, memory and poll time against engines into this PNG "
                                                  "(needs matplotlib: pip install 'kvops[bench]')")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        sizes = [int(x) for x in args.engines.split(",") if x.strip()]
    except ValueError:
        print(f"kvops bench fleet: --engines takes sizes like 10,100,300, not {args.engines!r}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1:
        print("kvops bench fleet: every fleet size must be at least 1", file=sys.stderr)
        return 2
    if not (CAPTURES / "loaded.txt").is_file():
        print(f"kvops bench fleet replays the vLLM capture in {CAPTURES}, which a kvops checkout has: run it from "
              "one", file=sys.stderr)
        return 2
    rows: list[FleetRow] = []
    with tempfile.TemporaryDirectory(prefix="kvops-fleet-") as folder:
        for n in sizes:
            print(f"[kvops bench fleet] {n} engines, {args.duration:.0f} s ...", file=sys.stderr, flush=True)
            try:
                row = run_one(n, args.duration, Path(folder), args.warmup, args.trouble_at)
            except (RuntimeError, HttpError, psutil.Error) as exc:
                print(f"kvops bench fleet: {n} engines failed: {exc} (logs were in {folder})", file=sys.stderr)
                return 1
            rows.append(row)
            print(_line(row), flush=True)
            if args.json:
                _save(args.json, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _line(row: FleetRow) -> str:
    alerts = ", ".join(f"{a['trouble']}→{a['alertname'] or 'none'} {a['latency_s']} s" for a in row.alerts.values())
    return (f"{row.engines} engines: {row.cpu_cores:.2f} cores, {row.rss_mb:.0f} MB, polls on time "
            f"{row.polls_on_time:.1%} (p50 {row.poll_p50_s} s, p99 {row.poll_p99_s} s), rules {row.evaluation_mean_s} "
            f"s an evaluation, {row.engines_up} up, {row.poll_errors} poll errors; alerts: {alerts or 'none'}")


def _save(path: Path, rows: list[FleetRow]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["kvops bench fleet", *sys.argv[3:]]) if sys.argv[1:3] == ["bench", "fleet"]
              else "kvops bench fleet", "machine": machine(), "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(report, indent=2) + "\n")


def plot(rows: list[FleetRow], path: Path) -> Path | None:
    """CPU cores, peak memory and the poll cycle's p99 against the number of engines, with the targets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvops[bench]'): no plot, the JSON has the numbers",
              file=sys.stderr)
        return None
    engines = [r.engines for r in rows]
    fig, (cpu, memory, polls) = plt.subplots(1, 3, figsize=(12.0, 3.6))
    cpu.plot(engines, [r.cpu_cores for r in rows], marker="o")
    cpu.axhline(1.0, color="grey", linestyle="--", label="target: 1 core at 300")
    cpu.set(xlabel="engines watched", ylabel="supervisor CPU (cores)", title="CPU")
    memory.plot(engines, [r.rss_mb for r in rows], marker="o")
    memory.axhline(1024, color="grey", linestyle="--", label="target: 1 GiB at 300")
    memory.set(xlabel="engines watched", ylabel="peak RSS (MiB)", title="Memory")
    polls.plot(engines, [r.poll_p99_s for r in rows], marker="o", label="poll cycle p99 (bucket bound)")
    polls.plot(engines, [r.polls_on_time for r in rows], marker="s", label="share of polls on time")
    polls.axhline(rows[0].poll_interval_s, color="grey", linestyle="--", label="poll interval (s)")
    polls.set(xlabel="engines watched", title="Polls")
    for ax in (cpu, memory, polls):
        ax.set_xscale("log")
        ax.set_xticks(engines, [str(n) for n in engines])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
