"""`kvops bench profile`: where one engine step's time goes, and what the HTTP server adds on top.

Sixteen sequences (``--sequences``) decode together — the chat workload, ``--context N`` tokens of prose
each, or ``--shared-prefix N`` tokens of prose shared by all and a question of their own — greedy with
``ignore_eos``. Once every prompt is prefilled, decode steps are measured twice:

1. plain: the step's wall time, split by wrapping the engine's phases: scheduling, preparing the batch
   (token ids, positions, slot mapping, block tables), the forward pass, sampling, and the bookkeeping
   after it (appending tokens, hashing full blocks, stats);
2. under `torch.profiler`: the forward pass's ops by self time, grouped as matmuls, attention,
   gather/copy, and the rest (norms, RoPE, activations, adds). The groups' shares split the forward time
   of pass 1 (the profiler's own overhead inflates small ops, so its absolute times are not used).

The step is set against the bandwidth limit: every decode step reads every weight once, so weight bytes
over the machine's measured read rate is the least a step can take. On a shared VM that rate moves by a
quarter from one minute to the next, so a third pass pairs them: a few steps, then the read rate right
after, the share of the limit per pair, and the median of the pairs (`share_of_limit`); the pass-1 step
against the best read of the run is kept beside it (`share_of_best_read`). Then the same requests go to a
`kvops engine serve` subprocess over HTTP (`/v1/completions`, streamed off), and the difference in wall
time from the offline run is what the server adds (HTTP, JSON, detokenizing, the asyncio hand-off).
Nothing here is a timed assertion: docs/benchmarks.md records the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the compiled step's one call for every layer of a decode step (--compile): what it does between the ops it
    # records (matmuls, RoPE and the cache write, attention), i.e. its norms, SiLU and residual adds
    ("compiled layers", ("decode_layers",)),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax", "baddbmm", "bmm",
                   "paged_decode")),
    ("matmul", ("linear", "addmm", "aten::mm", "matmul", "gemv")),
    ("gather/copy", ("index", "gather", "copy_", "aten::cat", "clone", "contiguous", "_to_copy", "aten::to",
                     "stack", "aten::where")),
)
PHASES = ("schedule", "prepare", "forward", "sample", "bookkeeping")
PAIR_STEPS = 5  # decode steps before each read-rate measurement of the paired pass


def group_of(op: str) -> str:
    for group, needles in GROUPS:
        if any(n in op for n in needles):
            return group
    return "other ops"


class PhaseTimer:
    """Wraps an engine's phases and adds up their wall time per step."""

    def __init__(self, engine: Any) -> None:
        import kvops.engine.engine as engine_module

        self.totals: dict[str, float] = defaultdict(float)
        self.engine, self.module = engine, engine_module
        self._saved: list[tuple[Any, str, Any]] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_prepare", "prepare")
        self._wrap(engine.model, "forward", "forward")
        self._wrap(engine_module, "sample", "sample")

    def _wrap(self, owner: Any, attribute: str, phase: str) -> None:
        original: Callable[..., Any] = getattr(owner, attribute)
        self._saved.append((owner, attribute, original))

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - started

        setattr(owner, attribute, timed)

    def restore(self) -> None:
        for owner, attribute, original in reversed(self._saved):
            if owner is self.module:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)  # the instance attribute hid the class's method


def _prompts(engine: Any, context: int | None, sequences: int, shared_prefix: int = 0) -> list[list[int]]:
    import random

    from kvops.bench.workloads import CHAT_QUESTIONS, text_prompt

    if shared_prefix:
        prefix = text_prompt(engine.tokenizer, random.Random(0), 0, shared_prefix)
        return [prefix + engine.tokenizer(f"\n{CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]} ({i})\n").input_ids
                for i in range(sequences)]
    if context is None:
        return [engine.encode_chat([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}])
                for i in range(sequences)]
    rng = random.Random(0)
    return [text_prompt(engine.tokenizer, rng, i, context) for i in range(sequences)]


def read_bandwidth(megabytes: int = 512, rounds: int = 5) -> float:
    """Bytes per second this machine streams from memory into torch, with the engine's threads: a sum over a
    tensor far larger than the caches, the best of a few rounds. A decode step must read every weight once,
    so weight bytes / this is the floor of a step's time."""
    import torch

    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def read_by_matrix(weights: list[Any], rounds: int = 3) -> float:
    """Seconds torch takes to sum every matmul weight once, one matrix after another as a step reads them (the
    best of `rounds`): each matrix starts a stream and ends in a join, which one 512 MB buffer does not."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for w in weights:
            w.sum()
        best = min(best, time.perf_counter() - started)
    return best


def _decode_steps(engine: Any, prompts: list[list[int]], params: Any, n: int, timer: PhaseTimer | None = None,
                  around: Any = None, pause: Callable[[float], None] | None = None, every: int = 0) -> float:
    """Fresh requests; `n` decode-only steps after their prefill, inside `around` (a context manager, e.g. the
    profiler) when given; seconds of those steps. With `pause`, it gets the seconds of each `every` steps after
    them, and its own time is not counted."""
    for p in prompts:
        engine.add_request([p[0] + 1, *p[1:]], params)  # a new first token: no cached prefix
    while any(s.num_computed_tokens < s.prompt_len for s in engine.sequences.values()):
        engine.step()
    if timer is not None:
        timer.totals.clear()
    elapsed = 0.0
    with around if around is not None else contextlib.nullcontext():
        for done in range(0, n, every or n):
            started = time.perf_counter()
            for _ in range(min(n - done, every or n)):
                engine.step()
            batch = time.perf_counter() - started
            elapsed += batch
            if pause is not None:
                pause(batch)
    for request_id in list(engine.sequences):
        engine.abort_request(request_id)
    while engine.has_unfinished() or engine.block_manager.pending_free:
        engine.step()
    return elapsed


def _paired_shares(decode_steps: Callable[..., float], steps: int, weight_bytes: int) -> list[dict[str, float]]:
    """The third pass: every PAIR_STEPS steps, the read rate right after them; each pair's share of the limit
    (weight bytes over that rate, against those steps' mean), lowest first."""
    every = min(PAIR_STEPS, steps)
    pairs: list[tuple[float, float]] = []  # (seconds a step, read bytes a second right after)

    def read_after(batch_s: float) -> None:
        pairs.append((batch_s / every, read_bandwidth(rounds=2)))

    decode_steps(steps - steps % every, pause=read_after, every=every)
    return sorted(({"step_ms": round(step_s * 1000, 2), "read_gb_s": round(rate / 1e9, 2),
                    "share": round(weight_bytes / rate / step_s, 3)} for step_s, rate in pairs),
                  key=lambda pair: pair["share"])


def profile_offline(context: int | None, steps: int, max_tokens: int, llm: Any = None,
                    sequences: int = 16, shared_prefix: int = 0, compile: str = "auto") -> dict[str, Any]:
    """The plain and the profiled pass on `llm` (default: a new engine, 1 GiB of KV, max-model-len 2048, the
    compiled step as `compile` says)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvops.engine.config import EngineConfig
    from kvops.engine.llm import LLM
    from kvops.engine.sampling import SamplingParams

    llm = llm or LLM(EngineConfig(kv_cache_memory="1GiB", max_model_len=2048, compile=compile))
    engine = llm.engine
    prompts = _prompts(engine, context, sequences, shared_prefix)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    offline_s = float("inf")
    for run in range(2):  # the best of two: the first meets shapes (and allocations) for the first time
        started = time.perf_counter()
        # A first token of the run's own: the second run must not find the first one's prompts cached.
        llm.generate([[p[0] + 2 + run, *p[1:]] for p in prompts], params)
        offline_s = min(offline_s, time.perf_counter() - started)

    decode_steps = functools.partial(_decode_steps, engine, prompts, params)

    timer = PhaseTimer(engine)
    try:
        wall = decode_steps(steps, timer)
        phases = dict(timer.totals)
    finally:
        timer.restore()
    phases["bookkeeping"] = wall - sum(phases.values())
    prof = profile(activities=[ProfilerActivity.CPU])
    decode_steps(steps, around=prof)
    weight_bytes = engine.model.nbytes  # RoPE tables included: under 1% of it
    paired = _paired_shares(decode_steps, steps, weight_bytes)
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        self_us[group_of(event.key)] += event.self_cpu_time_total
    op_total = sum(self_us.values()) or 1.0
    forward_ms = phases["forward"] / steps * 1000
    contexts = [len(p) for p in prompts]
    bandwidth = max(read_bandwidth(), *(pair["read_gb_s"] * 1e9 for pair in paired))
    by_matrix_s = read_by_matrix(engine.model.matmul_weights)
    floor_ms = weight_bytes / bandwidth * 1000
    return {
        "workload": (f"{shared_prefix}-token shared prefix + a question" if shared_prefix else
                     "chat" if context is None else f"{context}-token prose"),
        "sequences": len(prompts), "mean_prompt_tokens": round(sum(contexts) / len(contexts), 1),
        "max_tokens": max_tokens, "steps": steps, "torch_threads": torch.get_num_threads(),
        "compile": engine.compiled.state, "offline_s": round(offline_s, 3),
        "step_ms": round(wall / steps * 1000, 2),
        "phases_ms": {p: round(phases[p] / steps * 1000, 3) for p in PHASES},
        "forward_ms_by_group": {g: round(forward_ms * us / op_total, 3) for g, us in sorted(self_us.items())},
        # The bandwidth limit: every step reads every weight once (tied embeddings counted once).
        "weight_mb": round(weight_bytes / 1e6, 1), "read_gb_s": round(bandwidth / 1e9, 2),
        "step_floor_ms": round(floor_ms, 2), "weights_summed_by_matrix_ms": round(by_matrix_s * 1000, 2),
        "share_of_best_read": round(floor_ms / (wall / steps * 1000), 3),
        "share_of_limit": round(statistics.median(p["share"] for p in paired), 3), "pairs": paired,
        "top_ops": [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / steps / 1000, 3)}
                    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]],
        "prompts": prompts,
    }


def served_seconds(prompts: list[list[int]], max_tokens: int, compile: str = "auto") -> float:
    """The same requests through `kvops engine serve` (a subprocess), after a warm-up; wall seconds, the
    better of two runs as offline."""
    from kvops.bench.compare import Server, send_batch
    from kvops.processes import free_port, start_engine_server, wait_healthy
    from kvops.vllm.launch import stop_server

    port = free_port()
    process = start_engine_server(port, ["--kv-cache-memory", "1GiB", "--max-model-len", "2048", "--compile", compile])
    server = Server("kvops", f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct")
    try:
        wait_healthy(server.url, process, 300.0, "kvops engine serve")
        asyncio.run(send_batch(server, prompts[:2], 4))
        return min(asyncio.run(send_batch(server, [[p[0] + 2 + run, *p[1:]] for p in prompts], max_tokens))[1]
                   for run in range(2))
    finally:
        stop_server(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvops bench profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=None,
                        help="prompt tokens per sequence (prose); default: the 16 chat prompts")
    parser.add_argument("--sequences", type=int, default=16,
                        help="sequences decoding together (default: %(default)s; 1: one stream)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every sequence starts with the same N tokens of prose, then its own question")
    parser.add_argument("--steps", type=int, default=20, help="decode steps measured (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    parser.add_argument("--no-http", action="store_true", help="skip the run through the HTTP server")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="the engine's compiled step (--compile of `kvops engine serve`; default: %(default)s)")
    parser.add_argument("--json", help="write the report to this file")
    args = parser.parse_args(argv)
    longest = 2048 - args.max_tokens - 64  # room for a question after a shared prefix
    if args.steps < 1 or args.max_tokens <= args.steps or not 1 <= args.sequences <= 256 or (
            args.context is not None and not 16 <= args.context <= longest) or not 0 <= args.shared_prefix <= longest \
            or (args.context is not None and args.shared_prefix):
        print("kvops bench profile: --steps must be at least 1 and below --max-tokens, --sequences within 1..256, "
              "--context or --shared-prefix (not both) within 16..1984 - max-tokens", file=sys.stderr)
        return 2
    report = profile_offline(args.context, args.steps, args.max_tokens, sequences=args.sequences,
                             shared_prefix=args.shared_prefix, compile=args.compile)
    prompts = report.pop("prompts")
    if not args.no_http:
        from kvops.processes import NotReady

        try:
            served = served_seconds(prompts, args.max_tokens, args.compile)
        except NotReady as exc:
            print(f"kvops bench profile: the HTTP run could not start: {exc}; --no-http skips it", file=sys.stderr)
            return 1
        report["served_s"] = round(served, 3)
        report["http_overhead_share"] = round(1 - report["offline_s"] / served, 3)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    step = report["step_ms"]
    print(f"{report['workload']}: {report['sequences']} sequences, {report['torch_threads']} torch threads, "
          f"decode step {step:.1f} ms")
    for phase, ms in report["phases_ms"].items():
        print(f"  {phase:<12} {ms:8.2f} ms  {ms / step:6.1%}")
        if phase == "forward":
            for group, gms in report["forward_ms_by_group"].items():
                print(f"    {group:<12} {gms:8.2f} ms  {gms / step:6.1%}")
    print(f"  the weights ({report['weight_mb']:.0f} MB) at {report['read_gb_s']:.1f} GB/s read (the run's best): "
          f"a step takes at least {report['step_floor_ms']:.1f} ms; this one ran at "
          f"{report['share_of_best_read']:.0%} of that limit")
    print(f"  the same weights summed matrix by matrix: {report['weights_summed_by_matrix_ms']:.1f} ms "
          f"(the step's matmuls: {report['forward_ms_by_group'].get('matmul', 0.0):.1f} ms)")
    pairs = report["pairs"]
    print(f"  steps against the read rate measured right after them: {report['share_of_limit']:.0%} of the limit "
          f"(median of {len(pairs)} pairs, {pairs[0]['share']:.0%}-{pairs[-1]['share']:.0%})")
    if "served_s" in report:
        print(f"  offline {report['offline_s']:.2f} s, over HTTP {report['served_s']:.2f} s: the server adds "
              f"{report['http_overhead_share']:.1%}")
    return 0
