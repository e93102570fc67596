"""`kvops bench vs-vllm`: the comparison with vLLM-CPU in docs/benchmarks.md, every number from one command.

It starts three servers on this machine, each serving SmolLM2-135M-Instruct with 1 GiB of KV and max-model-len
2048, in fp32 first and then again in bf16 (``--dtype``):

- ``kvops``: `kvops engine serve` at its defaults (``--threads auto``);
- ``vllm``: vLLM-CPU at its defaults (one torch thread per worker);
- ``vllm-omp``: vLLM-CPU with ``OMP_NUM_THREADS`` set to the machine's cores.

Then, with the same token-id requests to each (`kvops.bench.compare`), rounds alternating the order, and before
each timed request a wait for every server's processes to go idle (`kvops.bench.settle`: vLLM-CPU keeps a core
busy for about a second after each request):

1. the comparison workloads (one stream, 16 chats, 16 prompts sharing a prefix) on the quiet machine;
2. the same with one core kept busy by another process (skip with ``--no-busy-core``);
3. throughput against concurrency 1, 2, 4, ..., 64 (chats x 32 tokens), and against context length
   (one stream at 128 to 1536 prompt tokens: time to the first token and decode rate);
4. in bf16 (kvops ``--dtype bfloat16`` against vLLM ``--dtype bfloat16``, vLLM-CPU's usual dtype): the
   comparison workloads on the quiet machine (phase ``quiet_bf16``);
5. in each dtype, vLLM's own serving benchmark against each server (`kvops.bench.peer_client`: its random and
   prefix_repetition datasets; phases ``peer_client`` and ``peer_client_bf16``; skip with ``--no-peer-client``).

It writes one JSON report, and with matplotlib (``pip install 'kvops[bench]'``) the two scaling plots as PNG.
The table checks the target ratios (TARGETS) against the better of the two vLLMs, workload by workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from kvops import __version__
from kvops.bench.compare import (
    CompareError,
    Prompts,
    Server,
    describe_cpu,
    discover,
    machine,
    run,
    send_batch,
    streamed,
    warm_up,
)
from kvops.bench.peer_client import PEER_WORKLOADS, run_peer_client
from kvops.bench.settle import Settle
from kvops.processes import NotReady, free_port, start_engine_server, wait_healthy

KV_BYTES = 2**30
MAX_MODEL_LEN = 2048
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_LENGTHS = (128, 256, 512, 1024, 1536)
SWEEP_TOKENS = 32
DTYPES = ("float32", "bfloat16")
PHASES = ("quiet", "busy_core", "quiet_bf16")
PEER_PHASES = {"float32": "peer_client", "bfloat16": "peer_client_bf16"}
# (workload, the least ratio to the better vLLM that kvops aims for); they hold for the quiet fp32 phase only
TARGETS = {"stream": 1.5, "chats": 2.0, "shared-prefix": 2.0}
TARGETED_PHASE = "quiet"


@dataclass
class Started:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@contextlib.contextmanager
def servers(workdir: Path, cores: int, vllm_python: Path, dtype: str = "float32") -> Iterator[list[Started]]:
    """kvops, vllm and vllm-omp up and answering in `dtype`; all stopped (process groups) on the way out."""
    from kvops.vllm.launch import ServerSettings, start_server, stop_server
    from kvops.vllm.model_export import export_default_model

    model = export_default_model()
    started: list[Started] = []
    logs: list[IO[bytes]] = []

    def log_for(name: str) -> tuple[Path, IO[bytes]]:
        path = workdir / f"{name}-{dtype}.log"
        logs.append(path.open("wb"))
        return path, logs[-1]

    try:
        port = free_port()
        path, log = log_for("kvops")
        process = start_engine_server(port, ["--kv-cache-memory", str(KV_BYTES), "--max-model-len",
                                             str(MAX_MODEL_LEN), "--dtype", dtype], log)
        started.append(Started("kvops", f"http://127.0.0.1:{port}", process, path))
        # Up before the vLLMs start: kvops times its matmul backends while it loads (kvops/engine/linear.py), and beside
        # two vLLM servers loading it timed 3-10x slow passes and chose oneDNN for 2 rows, where MKL wins quiet.
        ready(started[0])
        for name, omp in (("vllm", None), ("vllm-omp", str(cores))):
            settings = ServerSettings(model=model, port=free_port(), served_model_name="SmolLM2-135M-Instruct",
                                      max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES, dtype=dtype)
            path, log = log_for(name)
            process = start_server(vllm_python, settings, log, env_overrides={"OMP_NUM_THREADS": omp})
            started.append(Started(name, settings.url, process, path))
        for each in started[1:]:
            ready(each)
        yield started
    finally:
        for each in started:
            stop_server(each.process)
        for log in logs:
            log.close()


def ready(server: Started) -> None:
    """Wait for a started server's /health (900 s); CompareError with the end of its log when it does not come up."""
    try:
        wait_healthy(server.url, server.process, 900.0, server.name, server.log_path)
    except NotReady as exc:
        raise CompareError(str(exc)) from None
    print(f"{server.name} ready at {server.url}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process keeping one core busy for the length of the block."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(3.0)  # long enough for --threads auto to see it (two readings, a second apart)
        yield
    finally:
        burner.kill()
        burner.wait()


def _tok_s(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2) if seconds > 0 else 0.0


def concurrency_sweep(targets: list[Server], prompts: Prompts, settle: Callable[[], None]) -> dict[str, Any]:
    """tok/s at each concurrency (chats x SWEEP_TOKENS), the servers' order alternating point by point."""
    points: dict[str, list[float]] = {s.name: [] for s in targets}
    for i, n in enumerate(CONCURRENCY):
        batch = [prompts.chat(100 * i + j) for j in range(n)]
        for server in targets if i % 2 == 0 else targets[::-1]:
            settle()
            tokens, seconds = asyncio.run(send_batch(server, batch, SWEEP_TOKENS))
            points[server.name].append(_tok_s(tokens, seconds))
            print(f"concurrency {n} {server.name}: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    return {"concurrency": list(CONCURRENCY), "max_tokens": SWEEP_TOKENS, "tok_s": points}


def context_sweep(targets: list[Server], prompts: Prompts, settle: Callable[[], None]) -> dict[str, Any]:
    """One stream per context length, one streamed request each: seconds to the first token (mostly prefill) and
    the decode rate after it."""
    rng = random.Random(7)
    ttft: dict[str, list[float]] = {s.name: [] for s in targets}
    decode: dict[str, list[float]] = {s.name: [] for s in targets}
    for i, length in enumerate(CONTEXT_LENGTHS):
        text = prompts.builder.unique(1000 + i, length, rng)
        prompt = list(prompts.tokenizer(text, add_special_tokens=False).input_ids)[:length]
        for server in targets if i % 2 == 0 else targets[::-1]:
            settle()
            # A distinct first token per length, so no request reuses another length's cached prefix.
            tokens, first, whole = streamed(server, [11 + i, *prompt[1:]], SWEEP_TOKENS)
            ttft[server.name].append(round(first, 3))
            decode[server.name].append(_tok_s(tokens - 1, whole - first))
            print(f"context {length} {server.name}: first token {first:.2f} s, decode "
                  f"{_tok_s(tokens - 1, whole - first):.1f} tok/s", file=sys.stderr, flush=True)
    return {"context_tokens": list(CONTEXT_LENGTHS), "max_tokens": SWEEP_TOKENS, "first_token_s": ttft,
            "decode_tok_s": decode}


def peer_client(targets: list[Server], vllm_python: Path, tokenizer: Path, settle: Callable[[], None],
                ) -> dict[str, Any]:
    """vLLM's own client on each of its workloads against each server, the servers' order alternating, with kvops's
    output tok/s over the better vLLM's."""
    workloads: dict[str, Any] = {}
    for i, workload in enumerate(PEER_WORKLOADS):
        results = {}
        for server in targets if i % 2 == 0 else targets[::-1]:
            settle()
            results[server.name] = run_peer_client(vllm_python, server.url, server.model, tokenizer, workload).as_dict()
            print(f"peer client {workload.name} {server.name}: {results[server.name]['output_tok_s']:.1f} tok/s, "
                  f"mean ITL {results[server.name]['mean_itl_ms']:.0f} ms", file=sys.stderr, flush=True)
        _, ratio = over_best_vllm({name: r["output_tok_s"] for name, r in results.items()})
        workloads[workload.name] = {"description": workload.description, "concurrency": workload.concurrency,
                                    "prompts": workload.prompts, "servers": results, "kvops_over_best_vllm": ratio}
    return workloads


def over_best_vllm(rates: dict[str, float]) -> tuple[float, float | None]:
    """The better vLLM's rate (of `vllm` and `vllm-omp`) and kvops's over it; None without both sides."""
    best = max((v for k, v in rates.items() if k.startswith("vllm")), default=0.0)
    return best, (round(rates["kvops"] / best, 3) if best and "kvops" in rates else None)


def verdicts(workloads: dict[str, Any], targeted: bool = True) -> dict[str, Any]:
    """kvops over the better vLLM, per workload, against TARGETS (`targeted`), or the ratio alone: with a core busy
    the issue asks for nothing slower than before, which one run cannot know, and bf16 has no target."""
    out = {}
    for name, least in TARGETS.items():
        w = workloads.get(name)
        if not w:
            continue
        rates = {server: r["tok_s"] for server, r in w["servers"].items()}
        best_vllm, ratio = over_best_vllm(rates)
        out[name] = {"kvops_tok_s": rates["kvops"], "best_vllm_tok_s": best_vllm, "ratio": ratio}
        if targeted:
            out[name] |= {"target": least, "met": ratio is not None and ratio >= least}
    return out


def plot(report: dict[str, Any], directory: Path) -> list[Path]:
    """The two scaling plots as PNG; none (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvops[bench]'): no plots, the JSON has the numbers",
              file=sys.stderr)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    stamp = report["date"][:10]
    written = []
    sweep = report["concurrency_sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, values in sweep["tok_s"].items():
        ax.plot(sweep["concurrency"], values, marker="o", label=name)
    ax.set(xscale="log", xlabel="concurrent chats", ylabel="generated tok/s",
           title=f"Throughput against concurrency ({sweep['max_tokens']} tokens each), {stamp}")
    ax.set_xticks(sweep["concurrency"], [str(c) for c in sweep["concurrency"]])
    ax.grid(alpha=0.3)
    ax.legend()
    path = directory / "scaling-concurrency.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    written.append(path)
    sweep = report["context_sweep"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for name in sweep["decode_tok_s"]:
        left.plot(sweep["context_tokens"], sweep["decode_tok_s"][name], marker="o", label=name)
        right.plot(sweep["context_tokens"], sweep["first_token_s"][name], marker="o", label=name)
    left.set(xlabel="prompt tokens", ylabel="decode tok/s (one stream)", title="Decode against context")
    right.set(xlabel="prompt tokens", ylabel="seconds to the first token", title="Prefill against context")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    path = directory / "scaling-context.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    written.append(path)
    plt.close("all")
    return written


def _torch_threads(url: str) -> float | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        for line in httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text.splitlines():
            if line.startswith("kvops_engine_torch_threads "):
                return float(line.split()[1])
    return None


def _compile_state(url: str) -> str | None:
    """The kvops engine's compiled step as its snapshot says (built, cached or off)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return httpx.get(f"{url}/stats", timeout=10, trust_env=False).json()["engine"]["compile"]
    return None


def table(report: dict[str, Any]) -> str:
    lines = ["| phase | workload | kvops tok/s | vllm tok/s | vllm-omp tok/s | kvops / better vLLM | target |",
             "|---|---|---:|---:|---:|---:|---|"]
    for phase in PHASES:
        if phase not in report:
            continue
        for name, w in report[phase]["workloads"].items():
            rates = {k: v["tok_s"] for k, v in w["servers"].items()}
            verdict = report[phase]["verdicts"].get(name, {})
            met = "met" if verdict.get("met") else "**missed**"
            target = f"≥ {verdict['target']} ({met})" if "target" in verdict else "—"
            lines.append(f"| {phase} | {name} | {rates['kvops']:.1f} | {rates['vllm']:.1f} | "
                         f"{rates['vllm-omp']:.1f} | {verdict.get('ratio', 0):.2f} | {target} |")
    for phase in PEER_PHASES.values():
        if phase not in report:
            continue
        lines += ["", f"vLLM's own client ({phase}): output tok/s, TTFT and ITL in ms (mean / p99), as it reports them",
                  "", "| workload | server | tok/s | TTFT | ITL | kvops / better vLLM |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, w in report[phase]["workloads"].items():
            for server, r in w["servers"].items():
                ratio = f"{w['kvops_over_best_vllm']:.2f}" if server == "kvops" and w["kvops_over_best_vllm"] else ""
                lines.append(f"| {name} | {server} | {r['output_tok_s']:.1f} | {r['mean_ttft_ms']:.0f} / "
                             f"{r['p99_ttft_ms']:.0f} | {r['mean_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {ratio} |")
    m = report["machine"]
    lines.append("")
    lines.append(f"{report['date']}, {describe_cpu(m)}, {m['cores']} cores, {m['memory_gib']} GiB; "
                 f"`{report['command']}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvops bench vs-vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="vs-vllm.json", help="the report (default: %(default)s)")
    parser.add_argument("--plots", default=".", help="folder for the PNG plots (default: the current one)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per workload (default: %(default)s)")
    parser.add_argument("--no-busy-core", action="store_true", help="skip the phase with one core kept busy")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the concurrency and context sweeps")
    parser.add_argument("--no-peer-client", action="store_true", help="skip vLLM's own benchmark client")
    parser.add_argument("--dtype", choices=("both", *DTYPES), default="both",
                        help="float32 (every phase), bfloat16 (the quiet workloads) or both (default: %(default)s)")
    args = parser.parse_args(argv)
    # A SIGTERM (a CI timeout, a kill) unwinds like Ctrl-C, so the servers' process groups are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from kvops.vllm.install import default_venv_dir, probe_vllm, venv_python

    status = probe_vllm(venv_python(default_venv_dir()))
    if not status.installed:
        print(f"kvops bench vs-vllm: {status.describe()}", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    command = "kvops bench vs-vllm " + shlex.join(argv)
    report: dict[str, Any] = {"kvops_version": __version__, "vllm_version": status.version,
                              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
                              "command": command, "kv_cache_bytes": KV_BYTES, "max_model_len": MAX_MODEL_LEN}
    workdir = Path(args.json).resolve().parent
    dtypes = DTYPES if args.dtype == "both" else (args.dtype,)

    def save() -> None:  # after every phase: a run that fails later keeps what it measured
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    try:
        for dtype in dtypes:
            with servers(workdir, cores, status.python, dtype) as started:
                targets = [discover(s.url, s.name, None) for s in started]
                settle = Settle([s.process.pid for s in started])
                if dtype == "bfloat16":
                    phases = [("quiet_bf16", contextlib.nullcontext())]
                else:
                    phases = [("quiet", contextlib.nullcontext())]
                    if not args.no_busy_core:
                        phases.append(("busy_core", busy_core()))
                for phase, context in phases:
                    with context:
                        settle.waits, settle.timeouts = [], 0
                        result = run(targets, 1.0, args.rounds, 0, command, settle=settle)
                        threads = _torch_threads(started[0].url)
                    report[phase] = {"dtype": dtype, "workloads": result["workloads"],
                                     "verdicts": verdicts(result["workloads"], phase == TARGETED_PHASE),
                                     "kvops_torch_threads_at_end": threads,
                                     "kvops_compile": _compile_state(started[0].url), "settle": settle.summary()}
                    save()
                if not args.no_peer_client:
                    from kvops.vllm.model_export import export_default_model

                    report[PEER_PHASES[dtype]] = {"dtype": dtype, "workloads": peer_client(
                        targets, status.python, export_default_model(), settle)}
                    save()
                if dtype == "float32" and not args.no_sweeps:
                    prompts = Prompts(0)
                    for server in targets:
                        warm_up(server, prompts.chat(0))
                    report["concurrency_sweep"] = concurrency_sweep(targets, prompts, settle)
                    report["context_sweep"] = context_sweep(targets, prompts, settle)
                    save()
    except CompareError as exc:
        report["error"] = str(exc)
        save()
        print(f"kvops bench vs-vllm: {exc} (the phases measured before it are in {args.json}; the servers' logs "
              f"in {workdir})", file=sys.stderr)
        return 2
    save()
    if "concurrency_sweep" in report:
        for path in plot(report, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    print(table(report))
    return 0
