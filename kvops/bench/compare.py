"""`kvops bench compare URL [URL ...]`: the same OpenAI requests to several servers, side by side.

Every server (a kvops engine, vLLM, SGLang, ...) gets the same token-id prompts with greedy decoding and
`ignore_eos`, so each generates exactly the requested tokens. Three workloads:

- ``stream``: one chat, 64 tokens;
- ``chats``: 16 concurrent chats x 64 tokens;
- ``shared-prefix``: 16 concurrent prompts sharing a ~600-token prefix x 32 tokens.

Rounds alternate the servers' order (A B, then B A, ...) workload by workload, so a slow spell of the
machine hits every server alike. Throughput is generated tokens over wall time, all rounds together.
Prompts come from the benchmark's chat questions (`kvops.bench.workloads`) and the load generator's
prompt builder (`kvops.loadgen`), tokenized with the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvops import __version__
from kvops.bench.workloads import CHAT_QUESTIONS

TIMEOUT_S = 900.0


@dataclass
class Server:
    name: str
    url: str
    model: str
    ignore_eos: bool = True


@dataclass
class Shape:
    """One workload at a scale: `requests` concurrent prompts, each generating `max_tokens`."""

    name: str
    description: str
    requests: int
    max_tokens: int
    prefix_tokens: int = 0  # shared by every prompt (0: chats)
    unique_tokens: int = 0


class CompareError(Exception):
    """A problem a person can act on: one line, exit status 2."""


def shapes(scale: float) -> list[Shape]:
    def n(value: int, least: int) -> int:
        return max(least, round(value * scale))

    concurrent, prefix, unique = n(16, 1), n(600, 8), n(24, 4)
    return [
        Shape("stream", f"1 chat x {n(64, 2)} tokens", 1, n(64, 2)),
        Shape("chats", f"{concurrent} concurrent chats x {n(64, 2)} tokens", concurrent, n(64, 2)),
        Shape("shared-prefix", f"{concurrent} concurrent prompts sharing a {prefix}-token prefix (+{unique} own) "
              f"x {n(32, 2)} tokens", concurrent, n(32, 2), prefix, unique),
    ]


class Prompts:
    """Token-id prompts, identical for every server; each round gets its own (no whole-prompt cache hits)."""

    def __init__(self, seed: int) -> None:
        from kvops.loadgen import PromptBuilder, load_tokenizer

        self.tokenizer = load_tokenizer()
        self.builder = PromptBuilder(self.tokenizer, seed)
        self.seed = seed

    def chat(self, index: int) -> list[int]:
        question = CHAT_QUESTIONS[index % len(CHAT_QUESTIONS)]
        if index >= len(CHAT_QUESTIONS):
            question = f"{question} (Question {index}.)"
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def build(self, shape: Shape, round_index: int) -> list[list[int]]:
        first = round_index * shape.requests
        if not shape.prefix_tokens:
            return [self.chat(first + i) for i in range(shape.requests)]
        prefix = self.builder.prefix("compare", 0, shape.prefix_tokens)
        rng = random.Random(f"{self.seed}/{round_index}")
        texts = [prefix + self.builder.unique(first + i, shape.unique_tokens, rng) for i in range(shape.requests)]
        return [list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


# ------------------------------------------------------------------------------------------- servers


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def discover(url: str, name: str | None, model: str | None) -> Server:
    """The server at `url` and the model it serves; CompareError when it is not reachable or not OpenAI."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CompareError(f"{url!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")
    try:
        response = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False)
        cards = response.json()["data"] if response.status_code == 200 else None
    except httpx.HTTPError as exc:
        raise CompareError(f"cannot reach {url} ({_reason(exc)}): is the server running?") from None
    except (ValueError, KeyError, TypeError):
        cards = None
    if not cards:
        raise CompareError(f"{url}/v1/models gave no model list (HTTP {response.status_code}): is {url} an "
                           "OpenAI-compatible server?")
    served = [str(card.get("id")) for card in cards]
    if model is not None and model not in served:
        raise CompareError(f"{url} serves {', '.join(served)}, not {model!r}")
    owner = str(cards[0].get("owned_by") or "")
    default_name = owner if owner in ("kvops", "vllm", "sglang") else url.split("//", 1)[1]
    return Server(name or default_name, url, model or served[0])


def _body(server: Server, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if server.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _one(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int) -> int:
    body = _body(server, prompt, max_tokens)
    response = await client.post(f"{server.url}/v1/completions", json=body)
    if response.status_code != 200:
        raise CompareError(f"{server.url}/v1/completions answered HTTP {response.status_code}: {response.text[:300]}")
    return int(response.json()["usage"]["completion_tokens"])


async def send_batch(server: Server, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """All prompts at once; (tokens generated, wall seconds)."""
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(_one(client, server, p, max_tokens) for p in prompts))
        return sum(tokens), time.perf_counter() - started


async def _streamed(server: Server, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    body = _body(server, prompt, max_tokens) | {"stream": True, "stream_options": {"include_usage": True}}
    tokens, pieces, first = 0, 0, 0.0
    async with httpx.AsyncClient(timeout=TIMEOUT_S, trust_env=False) as client:
        started = time.perf_counter()
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise CompareError(f"{server.url}/v1/completions answered HTTP {response.status_code}: "
                                   f"{response.text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices"):
                    pieces += 1
                    first = first or time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        # a server that sends no usage: its chunks, a token each as vLLM and kvops stream them
        return tokens or pieces, first, time.perf_counter() - started


def streamed(server: Server, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    """One streamed request: (tokens generated, seconds to the first token, seconds to the last). The first token
    and the decode after it come from one request, so a stall in either shows where it happened."""
    return asyncio.run(_streamed(server, prompt, max_tokens))


def warm_up(server: Server, prompt: list[int]) -> None:
    """One short request (first-request compilation, caches); drops ignore_eos if the server rejects it."""
    try:
        asyncio.run(send_batch(server, [prompt], 4))
    except CompareError:
        server.ignore_eos = False
        asyncio.run(send_batch(server, [prompt], 4))


# ------------------------------------------------------------------------------------------- running


# The features that decide fp32 and bf16 matmul speed on x86; a VM's model name can be only "AMD EPYC".
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_identity(cpuinfo: str) -> dict[str, Any]:
    """The first processor of /proc/cpuinfo: model name, family/model/stepping (which name the generation where
    the model name does not: AMD family 23 is Zen 1-2, 25 Zen 3-4), and which of CPU_FEATURES it has."""
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_id": " ".join(f"{k.split()[-1]} {fields[k]}" for k in ("cpu family", "model", "stepping")
                               if k in fields) or None,
            "cpu_features": [f for f in CPU_FEATURES if f in flags]}


def describe_cpu(m: dict[str, Any]) -> str:
    """A report's CPU in one phrase: "AMD EPYC (family 25 model 1 stepping 1; avx2, fma)"."""
    if not m.get("cpu_id"):
        return str(m["cpu"])  # a report from before cpu_id, or a machine without /proc/cpuinfo
    return f"{m['cpu']} ({m['cpu_id']}; {', '.join(m.get('cpu_features') or ['no AVX2'])})"


def machine() -> dict[str, Any]:
    try:
        identity = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        identity = {"cpu": platform.processor() or platform.machine(), "cpu_id": None, "cpu_features": []}
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {**identity, "cores": os.cpu_count(), "memory_gib": memory_gib, "platform": platform.platform(),
            "python": platform.python_version()}


def run(servers: list[Server], scale: float, rounds: int, seed: int, command: str = "kvops bench compare",
        log: Any = None, settle: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every workload, `rounds` rounds, the servers' order alternating; `settle` (kvops/bench/settle.py), when
    given, runs before each timed batch."""
    log = log or sys.stderr  # looked up per call: a caller may have replaced sys.stderr
    prompts = Prompts(seed)
    for server in servers:
        warm_up(server, prompts.chat(0))
    workloads: dict[str, Any] = {}
    for shape in shapes(scale):
        results = {s.name: {"tokens": 0, "seconds": 0.0, "rounds_tok_s": []} for s in servers}
        orders = []
        for r in range(rounds):
            batch = prompts.build(shape, r)
            order = servers if r % 2 == 0 else servers[::-1]
            orders.append([s.name for s in order])
            for server in order:
                if settle is not None:
                    settle()
                tokens, seconds = asyncio.run(send_batch(server, batch, shape.max_tokens))
                result = results[server.name]
                result["tokens"] += tokens
                result["seconds"] += seconds
                result["rounds_tok_s"].append(round(tokens / seconds, 2))
                print(f"{shape.name} round {r + 1}/{rounds} {server.name}: {tokens} tokens in {seconds:.2f} s "
                      f"({tokens / seconds:.1f} tok/s)", file=log, flush=True)
        requested = shape.requests * shape.max_tokens * rounds
        for result in results.values():
            result["tok_s"] = round(result["tokens"] / result["seconds"], 2)
            result["seconds"] = round(result["seconds"], 3)
            result["complete"] = result["tokens"] == requested
        base = results[servers[0].name]["tok_s"]
        workloads[shape.name] = {
            "description": shape.description, "requests": shape.requests, "max_tokens": shape.max_tokens,
            "prefix_tokens": shape.prefix_tokens, "requested_tokens": requested, "orders": orders,
            "servers": results,
            "ratio_to_first": {name: round(r["tok_s"] / base, 3) if base else None for name, r in results.items()},
        }
    return {
        "kvops_version": __version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "scale": scale, "rounds": rounds, "seed": seed,
        "command": command,
        "servers": [{"name": s.name, "url": s.url, "model": s.model, "ignore_eos": s.ignore_eos} for s in servers],
        "workloads": workloads,
    }


def table(report: dict[str, Any]) -> str:
    names = [s["name"] for s in report["servers"]]
    first = names[0]
    head = ["workload", *(f"{n} tok/s" for n in names), *(f"{n} / {first}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, w in report["workloads"].items():
        cells = [f"{name}: {w['description']}", *(f"{w['servers'][n]['tok_s']:.1f}" for n in names),
                 *(f"{w['ratio_to_first'][n]:.2f}" for n in names[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    m = report["machine"]
    lines.append("")
    lines.append(f"{report['date']}, {describe_cpu(m)}, {m['cores']} cores, {m['memory_gib']} GiB; {report['rounds']} "
                 f"round(s) alternating the servers' order, scale {report['scale']:g}; greedy, ignore_eos.")
    for server in report["servers"]:
        eos = "" if server["ignore_eos"] else " (ignore_eos rejected: outputs may stop early)"
        lines.append(f"- {server['name']}: {server['url']} serving {server['model']}{eos}")
    short = [f"{w} on {n}" for w, r in report["workloads"].items()
             for n, s in r["servers"].items() if not s["complete"]]
    if short:
        lines.append(f"- fewer tokens than requested: {', '.join(short)}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvops bench compare",
        description="Send the same OpenAI requests to several servers (a kvops engine, vLLM, ...) and compare "
                    "their throughput: one stream; 16 concurrent chats x 64 tokens; 16 concurrent prompts sharing "
                    "a ~600-token prefix x 32 tokens.")
    parser.add_argument("urls", nargs="+", metavar="URL", help="OpenAI-compatible servers, e.g. http://127.0.0.1:8000")
    parser.add_argument("--names", help="comma-separated names for the servers (default: kvops / vllm / sglang from "
                        "/v1/models, else host:port)")
    parser.add_argument("--model", help="model name to request on every server (default: each one's first model)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per workload, alternating the order (default 3)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="size of the workloads: tokens, prefix and concurrency times this (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="write the report as JSON to FILE (or stdout without FILE) instead of the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    names = args.names.split(",") if args.names else [None] * len(args.urls)
    try:
        if len(names) != len(args.urls):
            raise CompareError(f"--names gives {len(names)} names for {len(args.urls)} URLs")
        if args.rounds < 1 or not 0 < args.scale <= 10:
            raise CompareError("--rounds must be at least 1 and --scale in (0, 10]")
        servers = [discover(url, name, args.model) for url, name in zip(args.urls, names, strict=True)]
        seen: dict[str, int] = {}
        for server in servers:  # two servers of one kind: vllm, vllm-2
            seen[server.name] = seen.get(server.name, 0) + 1
            if seen[server.name] > 1:
                server.name = f"{server.name}-{seen[server.name]}"
        report = run(servers, args.scale, args.rounds, args.seed, "kvops bench compare " + shlex.join(argv))
    except CompareError as exc:
        print(f"kvops bench compare: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"kvops bench compare: a request failed ({_reason(exc)})", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(table(report))
    return 0
