"""`kvops bench`: the engine against transformers, side by side, in one process.

Four systems generate from the exact same prompt token ids, fp32, greedy, on the default model:

- ``hf-generate``: transformers ``generate``, one prompt at a time;
- ``hf-padded``: transformers ``generate`` on one left-padded batch of every prompt;
- ``hf-cb``: transformers' own continuous batching (``generate_batch``, paged KV cache);
- ``kvops``: the kvops engine, driven step by step (``add_request`` / ``step``).

Workloads: ``chat`` (16 chat-templated questions x 64 new tokens), ``mixed`` (32 requests,
prompts of 20-1500 tokens, outputs of 16-256 tokens, seeded) and ``single`` (one chat prompt x
64 tokens, ``hf-generate`` against ``kvops``). Every system generates exactly the requested
number of tokens (EOS never stops a request) and the tokens actually generated are counted.
Throughput = useful generated tokens / wall time of the generation call(s); model loading and a
small per-system warm-up are excluded. KV waste of the engine (1 - used / allocated slots over
live sequences) is sampled after every step.

Modules: `workloads` (the prompts), `peers` (the transformers systems), `report` (runs, results,
the table and where it goes), and here the engine's runner and `main`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from kvops.bench import peers
from kvops.bench.report import (
    SINGLE_SYSTEMS,
    SYSTEMS,
    Run,
    SystemResult,
    configure_logging,
    log,
    mark_agreement,
    publish,
    render_table,
)
from kvops.bench.workloads import WORKLOADS, Workload, build_workloads


class Bench:
    """The four systems, each built on first use, and their timed runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._llm: Any = None
        self._hf: Any = None
        self._hf_cb: Any = None
        self._warm: set[str] = set()
        self._salt = 0

    # -- lazily built systems

    @property
    def engine(self) -> Any:
        if self._llm is None:
            from kvops.engine.config import EngineConfig
            from kvops.engine.llm import LLM

            started = time.perf_counter()
            self._llm = LLM(EngineConfig(
                block_size=self.args.block_size, kv_cache_memory=self.args.kv_cache_memory,
                max_model_len=self.args.max_model_len, max_num_seqs=self.args.max_num_seqs,
                max_num_batched_tokens=self.args.max_num_batched_tokens, dtype="float32",
            ))
            log(f"kvops engine loaded in {time.perf_counter() - started:.1f} s "
                f"({self._llm.engine.capacity.num_blocks} blocks x {self.args.block_size} tokens)")
        return self._llm.engine

    @property
    def hf(self) -> Any:
        if self._hf is None:
            self._hf = peers.load_model(self.engine.model_dir)
        return self._hf

    @property
    def hf_cb(self) -> Any:
        # A model instance of its own: continuous batching switches the attention implementation.
        if self._hf_cb is None:
            self._hf_cb = peers.load_model(self.engine.model_dir)
        return self._hf_cb

    @property
    def pad_id(self) -> int:
        tokenizer = self.engine.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _warm_up(self, system: str) -> None:
        """One small generation per system before its first timed run (allocator, thread pools, lazy init)."""
        if system in self._warm:
            return
        chat = self.engine.encode_chat
        prompts = [chat([{"role": "user", "content": q}]) for q in ("Hello!", "Who are you?")]
        self.runner(system)(Workload("warm-up", "", prompts, [2, 2]))
        self._warm.add(system)

    # -- the four runners; each returns a Run timed around the generation call(s) only

    def run_hf_generate(self, w: Workload) -> Run:
        return peers.run_generate(self.hf, self.pad_id, w)

    def run_hf_padded(self, w: Workload) -> Run:
        return peers.run_padded(self.hf, self.pad_id, w)

    def run_hf_cb(self, w: Workload) -> Run:
        model, capacity = self.hf_cb, self.engine.capacity
        cb_config = peers.continuous_batching_config(self.args.max_num_batched_tokens, self.args.max_num_seqs,
                                                     capacity.bytes_per_token, capacity.pool_bytes)
        return peers.run_continuous_batching(model, self.pad_id, cb_config, w)

    def run_kvops(self, w: Workload) -> Run:
        from kvops.engine.sampling import SamplingParams

        engine = self.engine
        # A fresh cache salt per run: no prefix-cache hits on blocks left by an earlier run or system
        # (sharing between the requests of one run stays on, as in transformers' continuous batching).
        self._salt += 1
        tenant = f"kvops-bench-{self._salt}"  # a tenant's name is its default cache salt
        preemptions = engine.scheduler.preemptions_total
        half = math.ceil(w.num_requests / 2)
        done: dict[str, Any] = {}
        samples: list[tuple[int, int, int]] = []  # (running, allocated slots, used slots) after each step
        sampling_s = 0.0
        started = time.perf_counter()
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                  tenant=tenant)
               for p, n in zip(w.prompts, w.max_tokens, strict=True)]
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            t = time.perf_counter()
            allocated, used = engine.kv_slots()
            samples.append((len(engine.scheduler.running), allocated, used))
            sampling_s += time.perf_counter() - t
        wall = time.perf_counter() - started - sampling_s  # the kv_slots sampling is not the engine's time
        outputs = [list(done[i].token_ids) for i in ids]
        tokens = sum(len(o) for o in outputs)

        def waste(rows: list[tuple[int, int, int]]) -> float | None:
            rows = [r for r in rows if r[1] > 0]
            return statistics.fmean(1 - used / alloc for _, alloc, used in rows) if rows else None

        steady = [s for s in samples if s[0] >= half]
        return Run(wall, tokens, tokens, outputs, {
            "steps": len(samples),
            "steady_steps": len(steady),
            "steady_threshold_running": half,
            "kv_waste_steady": waste(steady),
            "kv_waste_all_steps": waste(samples),
            "max_running": max((s[0] for s in samples), default=0),
            "preemptions": engine.scheduler.preemptions_total - preemptions,
            "prefix_hit_tokens": sum(done[i].num_cached_tokens for i in ids),
            "kv_sampling_s": round(sampling_s, 4),
        })

    def runner(self, system: str) -> Callable[[Workload], Run]:
        return getattr(self, "run_" + system.replace("-", "_"))

    def measure(self, system: str, w: Workload, k: int) -> Run:
        self._warm_up(system)
        log(f"{w.name}: {system} run {k + 1}/{self.args.repeat} "
            f"({w.num_requests} requests, {w.requested_tokens} tokens) ...")
        cpu = time.process_time()
        run = self.runner(system)(w)
        run.extra["cpu_s"] = round(time.process_time() - cpu, 3)
        expected = w.requested_tokens
        flag = "" if run.generated_tokens == expected else f"  (!) expected {expected}"
        log(f"{w.name}: {system}: {run.generated_tokens} tokens in {run.wall_s:.2f} s = "
            f"{run.tok_s:.1f} tok/s{flag}")
        return run


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvops bench",
        description="Benchmark the kvops engine against transformers (generate one at a time, padded "
                    "generate, continuous batching) on the default model, fp32, greedy, in one process.",
    )
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all",
                        help="chat: 16 chat prompts x 64 tokens; mixed: 32 requests, prompts 20-1500 and "
                             "outputs 16-256 tokens; single: 1 chat prompt x 64 tokens (default: all)")
    parser.add_argument("--systems", default="all",
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--block-size", type=int, default=16, help="kvops engine block size (default: 16)")
    parser.add_argument("--kv-cache-memory", default="512MiB",
                        help="KV budget of the engine, and of hf-cb (default: 512MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, help="runs per system and workload; the median is "
                        "reported (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixed workload (default: 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true",
                        help="a few short prompts and tokens: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    if args.systems.strip() == "all":
        args.systems = list(SYSTEMS)
    else:
        chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in SYSTEMS]
        if unknown or not chosen:
            parser.error(f"--systems: unknown {', '.join(unknown) or '(empty)'}; "
                         f"choose from {', '.join(SYSTEMS)}")
        args.systems = [s for s in SYSTEMS if s in chosen]
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.block_size < 1:
        parser.error("--block-size must be at least 1")
    args.workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging()
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    loadavg_start = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if loadavg_start > cpus + 0.5 and torch.get_num_threads() > 1:
        log(f"load average {loadavg_start:.1f} on {cpus} CPUs: other processes compete for the CPUs, and "
            f"{torch.get_num_threads()} torch threads slow down badly when oversubscribed; numbers will be "
            "noisy (--threads 1 is steadier)")
    bench = Bench(args)
    workloads = build_workloads(bench.engine, args.quick, args.seed)
    report: dict[str, Any] = {
        "model": bench.engine.model_name,
        "command": "kvops bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {
            "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "repeat": args.repeat, "quick": args.quick,
            "seed": args.seed, "dtype": "float32", "greedy": True,
        },
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "loadavg_start": loadavg_start,
        },
        "workloads": {},
    }
    started = time.perf_counter()
    for name in args.workloads:
        w = workloads[name]
        systems = [s for s in args.systems if name != "single" or s in SINGLE_SYSTEMS]
        if not systems:
            log(f"{name}: skipped, none of the chosen systems runs it "
                f"(it compares {', '.join(SINGLE_SYSTEMS)})")
            continue
        log(f"{name}: {w.description}; {w.prompt_tokens} prompt tokens; systems {', '.join(systems)}")
        runs: dict[str, list[Run]] = {s: [] for s in systems}
        failed: dict[str, str] = {}
        # Repeats go round-robin over the systems, so a change in background load hits all of them.
        for k in range(args.repeat):
            for system in systems:
                if system in failed:
                    continue
                try:
                    runs[system].append(bench.measure(system, w, k))
                except Exception as error:  # one broken system must not hide the others' numbers
                    failed[system] = f"{type(error).__name__}: {error}"
                    log(f"{name}: {system} FAILED:\n{traceback.format_exc()}")
        results = {s: SystemResult(s, r) for s, r in runs.items() if s not in failed}
        mark_agreement(results, w)
        ratios = {}
        if "kvops" in results:
            mine = results["kvops"].median.tok_s
            ratios = {s: mine / r.median.tok_s for s, r in results.items()
                      if s != "kvops" and r.median.tok_s > 0}
        report["workloads"][name] = {
            "description": w.description,
            "requests": w.num_requests,
            "prompt_tokens": w.prompt_tokens,
            "prompt_lengths": [len(p) for p in w.prompts],
            "max_tokens": w.max_tokens,
            "systems": {s: r.to_json() for s, r in results.items()},
            "ratios": {s: round(v, 4) for s, v in ratios.items()},
            "failed": failed,
        }
    report["environment"]["loadavg_end"] = os.getloadavg()[0]
    report["total_s"] = round(time.perf_counter() - started, 1)
    publish(report, render_table(report), args.json)
    return 1 if any(wl["failed"] for wl in report["workloads"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
