"""What the supervisor's polling costs the engine: throughput with and without a /stats poller.

    python benchmarks/polling.py [--rate 10] [--rounds 3] [--requests 16] [--max-tokens 64]
                                 [--poller http|supervisor|busy] [--work-ms 2]

Starts `kvops engine serve` once, then alternates rounds without and with a poller at `--rate` Hz,
each round sending the same concurrent chat requests. The poller is either a bare HTTP client
reading the full snapshot (`GET /stats`) or a real kvops supervisor watching the engine (reading,
history, rules, alerts: what `kvops run` does each poll; one supervisor for all polled rounds, so its
history grows as a daemon's would). `--poller busy` is the control: a separate process that reads nothing
from the engine and spins `--work-ms` of CPU at `--rate` Hz, what any process of a poller's CPU cost takes.
Reports generated tokens per second of each round, the ratio of the medians (polled / unpolled) and the
mean of the paired ratios with its 95% interval. The issue's target: at 10 Hz, 98% or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvops.bench.workloads import CHAT_QUESTIONS
from kvops.history import EngineHistory
from kvops.logs import configure_logging
from kvops.processes import free_port, start_in_own_session
from kvops.supervisor.config import parse_config
from kvops.supervisor.engine_spec import EngineSpec
from kvops.supervisor.managed_engine import ManagedEngine
from kvops.supervisor.supervisor import Supervisor


def start_engine(args: dict[str, object]) -> ManagedEngine:
    """The engine as kvops run starts it: `kvops engine serve` on a free port, healthy before timing."""
    engine = ManagedEngine(EngineSpec(name="bench", args=args), EngineHistory("bench"))
    engine.start()
    engine.wait_healthy()
    return engine


async def one_round(url: str, requests: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def ask(question: str) -> int:
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "messages": [{"role": "user", "content": question}]}
            response = await http.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + f" ({i})" for i in range(requests)]
        tokens = await asyncio.gather(*(ask(q) for q in questions))
        return sum(tokens) / (time.perf_counter() - started)


def poll(url: str, rate: float, stop: threading.Event, counter: list[int], path: str = "/stats") -> None:
    """Poll `path` at `rate` Hz; counter: [polls, answered from the engine's snapshot cache]."""
    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.is_set():
            started = time.monotonic()
            response = http.get(path)
            response.raise_for_status()
            counter[0] += 1
            counter[1] += response.headers.get("X-Kvops-Snapshot") == "cached"
            stop.wait(max(0.0, 1 / rate - (time.monotonic() - started)))


BUSY_PROCESS = """
import sys, time
rate, work_s = float(sys.argv[1]), float(sys.argv[2]) / 1000
while True:
    started = time.monotonic()
    while time.monotonic() - started < work_s:
        pass
    time.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))
"""


def busy_process(rate: float, work_ms: float) -> subprocess.Popen[bytes]:
    """A process that reads nothing from the engine: it wakes at `rate` Hz and spins `work_ms` of CPU each
    time. What a co-located process of a poller's CPU cost takes from the engine, whatever it does."""
    return subprocess.Popen([sys.executable, "-c", BUSY_PROCESS, str(rate), str(work_ms)])


def supervisor_polls(metrics_url: str) -> float | None:
    """`kvops_supervisor_polls_total` from a supervisor's /metrics; None while it does not answer."""
    try:
        text = httpx.get(metrics_url, timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("kvops_supervisor_polls_total "):
            return float(line.split()[1])
    return None


def daemon_round(url: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """One round under `kvops run` in its own process, as it is deployed, watching the engine at `args.rate`:
    started, and polling, before the round begins; stopped after it. Returns tok/s, polls per second, and the
    seconds the daemon took to start."""
    state_dir = tempfile.mkdtemp(prefix="kvops-polling-daemon-")
    port = free_port()
    started = time.perf_counter()
    daemon = start_in_own_session([sys.executable, "-m", "kvops", "run", "--no-managed", "--engine-url", url,
                                   "--poll-interval", str(1 / args.rate), "--listen", f"127.0.0.1:{port}",
                                   "--state-dir", state_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        while (before := supervisor_polls(metrics_url)) is None or before < 3:
            if daemon.poll() is not None or time.perf_counter() - started > 120:
                raise RuntimeError(f"kvops run did not start polling (exit code {daemon.returncode})")
            time.sleep(0.2)
        startup_s = time.perf_counter() - started
        round_started = time.perf_counter()
        tok_s = asyncio.run(one_round(url, args.requests, args.max_tokens))
        elapsed = time.perf_counter() - round_started
        after = supervisor_polls(metrics_url) or before
        return tok_s, (after - before) / elapsed, startup_s
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state_dir, ignore_errors=True)


def supervise(supervisor: Supervisor, rate: float, stop: threading.Event, counter: list[int]) -> None:
    """The supervisor's poll loop (`Supervisor._run`), counted; counter[1]: the polls' seconds, in ms."""
    while not stop.is_set():
        started = time.monotonic()
        supervisor.poll_once()
        counter[0] += 1
        counter[1] += round(supervisor.last_poll_s * 1000)
        stop.wait(max(0.0, 1 / rate - (time.monotonic() - started)))


def watching_supervisor(url: str, rate: float, state_dir: str) -> Supervisor:
    """A supervisor as `kvops run` makes one for an engine given by URL, polling at `rate` (not started:
    the benchmark drives its poll loop only during polled rounds)."""
    return Supervisor(parse_config({
        "supervisor": {"state_dir": state_dir, "poll_interval_s": 1 / rate, "listen": "127.0.0.1:0"},
        "engines": [{"name": "bench", "url": url, "kind": "kvops"}],
    }, "benchmarks/polling.py"))


def polled_round(url: str, args: argparse.Namespace, supervisor: Supervisor | None) -> tuple[float, float, float]:
    """One round under a poller: tok/s, polls per second achieved, and for the HTTP poller the share of polls
    answered from the engine's snapshot cache, for the supervisor its mean poll time in ms."""
    if args.poller == "daemon":
        return daemon_round(url, args)
    if args.poller == "busy":
        process = busy_process(args.rate, args.work_ms)
        try:
            tok_s = asyncio.run(one_round(url, args.requests, args.max_tokens))
        finally:
            process.kill()
            process.wait()
        return tok_s, args.rate, args.work_ms
    stop, counter = threading.Event(), [0, 0]
    if supervisor is not None:
        poller = threading.Thread(target=supervise, args=(supervisor, args.rate, stop, counter), daemon=True)
    else:
        poller = threading.Thread(target=poll, args=(url, args.rate, stop, counter, args.path), daemon=True)
    started = time.perf_counter()
    poller.start()
    tok_s = asyncio.run(one_round(url, args.requests, args.max_tokens))
    stop.set()
    poller.join()
    return tok_s, counter[0] / (time.perf_counter() - started), counter[1] / max(1, counter[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="polls per second (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating (default 3)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--path", default="/stats",
                        help="what the poller reads (default /stats; /health: the cost of the HTTP round trip alone)")
    parser.add_argument("--threads", default=None, help="the engine's --threads (default: its own, auto)")
    parser.add_argument("--poller", choices=["http", "supervisor", "daemon", "busy"], default="http",
                        help="a bare HTTP client reading --path (a thread of this process), a kvops supervisor "
                             "watching the engine (a thread of this process), `kvops run` watching it (its own "
                             "process, as deployed), or a process that reads nothing and spins --work-ms of CPU "
                             "at --rate Hz")
    parser.add_argument("--work-ms", type=float, default=2.0,
                        help="with --poller busy: CPU milliseconds per wake-up (default 2, about a supervisor poll)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    configure_logging("warning")  # the engine's forwarded log lines would bury the numbers
    engine_args: dict[str, object] = {"kv_cache_memory": "256MiB", "max_model_len": 2048}
    if args.threads is not None:
        engine_args["threads"] = args.threads
    engine = start_engine(engine_args)
    url = engine.url
    state_dir = tempfile.TemporaryDirectory(prefix="kvops-polling-")
    supervisor = watching_supervisor(url, args.rate, state_dir.name) if args.poller == "supervisor" else None
    try:
        asyncio.run(one_round(url, 2, 4))  # warm-up
        plain: list[float] = []
        polled: list[float] = []
        polls: list[float] = []
        per_poll: list[float] = []
        for i in range(args.rounds):
            # the order alternates too, so a machine that slows down (or warms up) favours neither kind
            for kind in ("plain", "polled") if i % 2 == 0 else ("polled", "plain"):
                if kind == "plain":
                    plain.append(asyncio.run(one_round(url, args.requests, args.max_tokens)))
                    continue
                tok_s, hz, extra = polled_round(url, args, supervisor)
                polled.append(tok_s)
                polls.append(round(hz, 2))
                per_poll.append(round(extra, 3))
    finally:
        if supervisor is not None:
            supervisor.stop()
        engine.stop()
        state_dir.cleanup()
    ratio = statistics.median(polled) / statistics.median(plain)
    # each polled round beside the unpolled round it alternated with: the machine's slow spells cancel out
    paired = [b / a for a, b in zip(plain, polled, strict=True)]
    half_width = 1.96 * statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
    extra_name = {"http": "answered_from_cache", "supervisor": "mean_poll_ms", "daemon": "daemon_startup_s",
                  "busy": "work_ms"}[args.poller]
    report = {"command": "python benchmarks/polling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rate_hz": args.rate, "path": args.path, "threads": args.threads, "poller": args.poller,
              "achieved_poll_hz": polls, extra_name: per_poll,
              "unpolled_tok_s": [round(x, 1) for x in plain],
              "polled_tok_s": [round(x, 1) for x in polled], "ratio": round(ratio, 4),
              "paired_ratio_mean": round(statistics.mean(paired), 4), "paired_ratio_95": round(half_width, 4)}
    print(f"unpolled tok/s {report['unpolled_tok_s']}, {args.poller} poller at {args.rate} Hz {report['polled_tok_s']} "
          f"(achieved {polls} Hz, {extra_name} {per_poll}): ratio of medians {ratio:.3f}, "
          f"mean of paired ratios {statistics.mean(paired):.3f} ± {half_width:.3f} (95%)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
