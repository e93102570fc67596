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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("hf-generate", "hf-padded", "hf-cb", "kvops")
PEERS = ("hf-generate", "hf-padded", "hf-cb")
WORKLOADS = ("chat", "mixed", "single")
SINGLE_SYSTEMS = ("hf-generate", "kvops")  # the single-request case compares these two only
SYSTEM_LABELS = {
    "hf-generate": "transformers generate, one prompt at a time",
    "hf-padded": "transformers generate, one left-padded batch",
    "hf-cb": "transformers continuous batching (generate_batch, paged)",
    "kvops": "kvops engine",
}

# Sixteen varied user questions: chat-templated with the model's default system prompt they
# come to ~30-40 tokens each.
CHAT_QUESTIONS = [
    "How do vaccines train the immune system?",
    "What is the difference between a list and a tuple in Python?",
    "Why does bread go stale?",
    "Can you suggest a name for my new bakery?",
    "How far away is the Moon?",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten year old.",
    "Is coffee bad for your heart?",
    "How do I politely decline a meeting invitation?",
    "What causes thunder during a storm?",
    "Write a short poem about the sea.",
    "How does compound interest work?",
    "Which houseplants need very little light?",
    "What is the best way to learn a new language?",
    "Why do cats purr?",
    "How do noise cancelling headphones work?",
]

# Plain prose (written for this benchmark) that the mixed workload's prompts are sampled from,
# sentence by sentence, with a seeded generator.
_PROSE = """\
The harbour town woke slowly, with gulls circling the fish market before the first boats came in.
Mara kept the lighthouse log in a green notebook, writing the wind, the tide and every ship she saw.
A storage engineer once told me that most outages begin with a disk that nobody was watching.
The recipe calls for two cups of flour, a pinch of salt, and butter cold enough to crack.
In the spring the river rises over the low meadow and the herons stand in the flooded grass.
Caching works because programs tend to reuse the data they touched a moment ago.
The committee met on Thursday and agreed to postpone the vote until the budget was clearer.
Old maps of the valley show a mill where the car park stands today.
He tuned the violin by ear, then played a slow air that his grandmother used to hum.
Every request that arrives at the server is queued, scheduled, and answered in turn.
The desert at night is colder than most travellers expect, so they pack wool as well as linen.
Our team measured latency at the ninety-ninth percentile, because averages hide the slow tail.
A good bicycle chain needs a little oil, a clean rag, and patience on a quiet afternoon.
The museum's new wing holds ceramics from the coast, glazed in blues that look like deep water.
When memory runs short the operating system starts to swap, and everything slows to a crawl.
Children in the village learned to read from the same worn books their parents had used.
The forecast promised rain, but the afternoon stayed bright and the washing dried on the line.
Photosynthesis turns light, water and carbon dioxide into sugar and the oxygen we breathe.
She wrote the letter three times before she was happy with the opening sentence.
The train left the city at dawn and reached the mountains by the middle of the morning.
A block of memory is only useful if someone remembers who owns it and when it can be freed.
Bees return to the hive and dance to tell the others where the flowers are.
The library stays open late during exams, and the reading room fills with quiet students.
Good documentation answers the question the reader actually has, not the one the author imagined.
At the edge of the forest the path forks, and the left branch climbs toward the ridge.
The bakery sells out of rye loaves before nine, so regular customers arrive early.
Engineers argue about block sizes the way sailors argue about knots, with conviction and little data.
A thunderstorm rolled in from the west and the streetlights came on in the middle of the afternoon.
The old clock in the hall gained a minute every week, and nobody ever corrected it.
Compression saves space, but every byte saved must be paid for with time to decode it.
Farmers along the coast plant windbreaks of pine to protect the young crops from salt spray.
The conference talk ran long, and the questions at the end were better than the slides.
Tea grown on high slopes ripens slowly in the cool air and tastes lighter than lowland tea.
He fixed the leaking tap with a new washer and felt unreasonably proud for the rest of the day.
A scheduler that never says no will eventually say yes to more work than it can finish.
The island has one road, two shops, and a ferry that runs when the weather allows.
Starlings gather over the marsh in winter and move like smoke against the evening sky.
The report recommends smaller batches, better monitoring, and a clear owner for each alarm.
In the workshop the smell of sawdust and linseed oil hangs in the air long after the saws stop.
Most people remember the melody of a song long after they have forgotten the words.
"""
_SENTENCES = [line.strip() for line in _PROSE.splitlines() if line.strip()]


def log(message: str) -> None:
    print(f"[kvops bench] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ workloads


@dataclass
class Workload:
    name: str
    description: str
    prompts: list[list[int]]  # token ids, identical for every system
    max_tokens: list[int]  # exact number of new tokens each request generates

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def requested_tokens(self) -> int:
        return sum(self.max_tokens)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _text_prompt(tokenizer: Any, rng: random.Random, index: int, length: int) -> list[int]:
    """Exactly `length` token ids of prose, distinct from the first block on (no accidental prefix hits)."""
    text = f"Notes {index}. Read these notes and continue them in the same style.\n"
    ids: list[int] = tokenizer(text).input_ids
    while len(ids) < length:
        text += " ".join(rng.choice(_SENTENCES) for _ in range(8)) + "\n"
        ids = tokenizer(text).input_ids
    return list(ids[:length])


def build_workloads(engine: Any, quick: bool, seed: int) -> dict[str, Workload]:
    tokenizer = engine.tokenizer
    num_chat, chat_tokens = (4, 8) if quick else (16, 64)
    chat = [engine.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:num_chat]]

    rng = random.Random(seed)
    if quick:
        num_mixed, prompt_range, output_range = 6, (20, 200), (4, 16)
    else:
        num_mixed, prompt_range, output_range = 32, (20, 1500), (16, 256)
    prompt_lens = [_log_uniform(rng, *prompt_range) for _ in range(num_mixed)]
    output_lens = [_log_uniform(rng, *output_range) for _ in range(num_mixed)]
    # Make sure both ends of each range are exercised, at different positions.
    prompt_lens[0], prompt_lens[1] = prompt_range[1], prompt_range[0]
    output_lens[0], output_lens[2] = output_range[0], output_range[1]
    mixed = [_text_prompt(tokenizer, rng, i, n) for i, n in enumerate(prompt_lens)]

    return {
        "chat": Workload("chat", f"{num_chat} chat prompts x {chat_tokens} new tokens", chat,
                         [chat_tokens] * num_chat),
        "mixed": Workload(
            "mixed",
            f"{num_mixed} requests, prompts {min(prompt_lens)}-{max(prompt_lens)} tokens, "
            f"outputs {min(output_lens)}-{max(output_lens)} tokens (seed {seed})",
            mixed, output_lens),
        "single": Workload("single", f"1 chat prompt x {chat_tokens} new tokens", chat[:1], [chat_tokens]),
    }


# -------------------------------------------------------------------- results


@dataclass
class Run:
    wall_s: float
    generated_tokens: int  # useful tokens: each request's own requested tokens, as actually generated
    computed_tokens: int  # every token the system generated, including padding rows' surplus
    outputs: list[list[int]] = field(repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class SystemResult:
    system: str
    runs: list[Run]
    agreement: tuple[int, int] | None = None  # requests whose tokens equal the reference system's, of all
    reference: str | None = None

    @property
    def median(self) -> Run:
        ordered = sorted(self.runs, key=lambda r: r.wall_s)
        return ordered[(len(ordered) - 1) // 2]

    def to_json(self) -> dict[str, Any]:
        best = self.median
        out: dict[str, Any] = {
            "system": self.system,
            "label": SYSTEM_LABELS[self.system],
            "generated_tokens": best.generated_tokens,
            "computed_tokens": best.computed_tokens,
            "wall_s": round(best.wall_s, 4),
            "cpu_s": best.extra.get("cpu_s"),
            "details": best.extra,  # of the median run
            "tok_s": round(best.tok_s, 3),
            "runs": [{"wall_s": round(r.wall_s, 4), "tok_s": round(r.tok_s, 3),
                      "generated_tokens": r.generated_tokens, **r.extra} for r in self.runs],
        }
        if self.agreement is not None:
            out["same_tokens_as_reference"] = {"reference": self.reference, "requests": self.agreement[0],
                                               "of": self.agreement[1]}
        return out


# -------------------------------------------------------------------- systems


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


class Bench:
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

    def _load_hf(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(self.engine.model_dir), dtype=torch.float32)
        model.eval()
        log(f"transformers model loaded in {time.perf_counter() - started:.1f} s "
            f"(attn_implementation={model.config._attn_implementation})")
        return model

    @property
    def hf(self) -> Any:
        if self._hf is None:
            self._hf = self._load_hf()
        return self._hf

    @property
    def hf_cb(self) -> Any:
        # A model instance of its own: continuous batching switches the attention implementation.
        if self._hf_cb is None:
            self._hf_cb = self._load_hf()
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
        import torch

        model, pad = self.hf, self.pad_id
        outputs: list[list[int]] = []
        with _quiet_transformers(), torch.inference_mode():
            started = time.perf_counter()
            for ids, n in zip(w.prompts, w.max_tokens, strict=True):
                inp = torch.tensor([ids], dtype=torch.long)
                # eos_token_id=-1: EOS never ends a request, like the engine's ignore_eos, so every system
                # generates the same tokens (min_new_tokens would mask EOS out and change the continuation).
                out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n,
                                     do_sample=False, eos_token_id=-1, pad_token_id=pad)
                outputs.append(out[0, len(ids):].tolist())
            wall = time.perf_counter() - started
        tokens = sum(len(o) for o in outputs)
        return Run(wall, tokens, tokens, outputs)

    def run_hf_padded(self, w: Workload) -> Run:
        import torch

        model, pad = self.hf, self.pad_id
        width = max(len(p) for p in w.prompts)
        longest = max(w.max_tokens)
        with _quiet_transformers(), torch.inference_mode():
            started = time.perf_counter()
            inp = torch.full((w.num_requests, width), pad, dtype=torch.long)
            mask = torch.zeros((w.num_requests, width), dtype=torch.long)
            for row, ids in enumerate(w.prompts):
                inp[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
                mask[row, width - len(ids):] = 1
            out = model.generate(inp, attention_mask=mask, max_new_tokens=longest,
                                 do_sample=False, eos_token_id=-1, pad_token_id=pad)
            wall = time.perf_counter() - started
        generated = out[:, width:]
        # The batch runs to the longest requested output; only each request's own tokens are useful.
        outputs = [generated[row, :n].tolist() for row, n in enumerate(w.max_tokens)]
        return Run(wall, sum(len(o) for o in outputs), int(generated.numel()), outputs,
                   {"padded_prompt_tokens": int(inp.numel()), "decode_steps": int(generated.shape[1])})

    def _cb_config(self) -> Any:
        from transformers import ContinuousBatchingConfig

        # Sized like the engine: the same KV budget, batch-token budget and request cap. On CPU the
        # default would claim 60% of RAM for the cache. Page size stays transformers' default.
        config = ContinuousBatchingConfig(max_batch_tokens=self.args.max_num_batched_tokens,
                                          max_requests_per_batch=self.args.max_num_seqs,
                                          use_cuda_graph=False, auto_switch_to_flash=False)
        engine = self.engine
        bytes_per_block = config.page_size * engine.capacity.bytes_per_token
        config.num_blocks = max(1, engine.capacity.pool_bytes // bytes_per_block)
        return config

    def run_hf_cb(self, w: Workload) -> Run:
        import torch
        from transformers import GenerationConfig

        model = self.hf_cb
        longest = max(w.max_tokens)
        gen_config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1,
                                      pad_token_id=self.pad_id)
        cb_config = self._cb_config()
        with _quiet_transformers(), torch.inference_mode():
            if len(set(w.max_tokens)) == 1:
                started = time.perf_counter()
                results = model.generate_batch(w.prompts, generation_config=gen_config,
                                               continuous_batching_config=cb_config, progress_bar=False)
                wall = time.perf_counter() - started
                ordered = list(results.values())
            else:
                # Per-request output lengths: what generate_batch wraps, with max_new_tokens per request.
                started = time.perf_counter()
                ordered = self._cb_per_request(model, w, gen_config, cb_config)
                wall = time.perf_counter() - started
        errors = [r.error for r in ordered if r.error]
        if len(ordered) != w.num_requests or errors:
            raise RuntimeError(f"transformers continuous batching returned {len(ordered)} of "
                               f"{w.num_requests} results; errors: {errors[:3]}")
        outputs = [list(r.generated_tokens) for r in ordered]
        tokens = sum(len(o) for o in outputs)
        return Run(wall, tokens, tokens, outputs,
                   {"page_size": cb_config.page_size, "num_blocks": cb_config.num_blocks})

    @staticmethod
    def _cb_per_request(model: Any, w: Workload, gen_config: Any, cb_config: Any) -> list[Any]:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                              max_generated_length=max(w.max_tokens), num_requests=w.num_requests)
        results: dict[str, Any] = {}
        with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=5,
                                                       continuous_batching_config=cb_config,
                                                       workload_hints=hints) as manager:
            ids = [manager.add_request(p, request_id=f"bench-{i}", max_new_tokens=n, eos_token_id=-1)
                   for i, (p, n) in enumerate(zip(w.prompts, w.max_tokens, strict=True))]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
        return [results[i] for i in ids if i in results]

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


# ------------------------------------------------------------------- reporting


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _agreement(results: dict[str, SystemResult], w: Workload) -> None:
    reference = "hf-generate" if "hf-generate" in results else ("kvops" if "kvops" in results else None)
    if reference is None:
        return
    want = results[reference].runs[0].outputs
    for result in results.values():
        got = result.runs[0].outputs
        same = sum(1 for a, b, n in zip(got, want, w.max_tokens, strict=True) if a[:n] == b[:n])
        result.agreement, result.reference = (same, w.num_requests), reference


def render_table(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"## kvops bench: {report['model']}, fp32, greedy, CPU, {env['torch_threads']} torch threads",
        "",
        "| workload | system | requests | prompt tok | generated tok | wall s | cpu s | tok/s | kvops × "
        "| same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    waste_rows = []
    for name, wl in report["workloads"].items():
        for system, res in wl["systems"].items():
            ratio = wl["ratios"].get(system)
            same = res.get("same_tokens_as_reference")
            same_s = "ref" if same and same["reference"] == system else (
                f"{same['requests']}/{same['of']}" if same else "-")
            gen = f"{res['generated_tokens']}"
            if res["computed_tokens"] != res["generated_tokens"]:
                gen += f" ({res['computed_tokens']} computed)"
            lines.append(f"| {name} | {system} | {wl['requests']} | {wl['prompt_tokens']} | {gen} | "
                         f"{res['wall_s']:.1f} | {_fmt(res['cpu_s'])} | {res['tok_s']:.1f} | "
                         f"{_fmt(ratio, '.2f', '×')} | {same_s} |")
        for system, error in wl["failed"].items():
            lines.append(f"| {name} | {system} | {wl['requests']} | {wl['prompt_tokens']} | failed: "
                         f"{error[:120].replace('|', '/')} | - | - | - | - | - |")
        kv = wl["systems"].get("kvops")
        if kv:
            run = kv["details"]
            waste_rows.append(
                f"| {name} | {_fmt(run['kv_waste_steady'] and 100 * run['kv_waste_steady'], '.1f', '%')} | "
                f"{run['steady_steps']}/{run['steps']} (≥{run['steady_threshold_running']} running) | "
                f"{_fmt(run['kv_waste_all_steps'] and 100 * run['kv_waste_all_steps'], '.1f', '%')} | "
                f"{run['max_running']} | {run['preemptions']} | {run['prefix_hit_tokens']} |")
    if waste_rows:
        lines += [
            "",
            f"kvops KV waste (block_size {report['config']['block_size']}; 1 - used/allocated slots, "
            "sampled after every step):",
            "",
            "| workload | steady-state waste | steady steps | all-steps waste | max running | preemptions "
            "| prefix-hit tokens |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *waste_rows,
        ]
    load = env["loadavg_start"], env["loadavg_end"]
    lines += [
        "",
        "Notes: tok/s = useful generated tokens / wall time of the generation call(s) (model load and "
        "a small warm-up excluded); cpu s = process CPU time over the same span (all threads); median of "
        f"{report['config']['repeat']} run(s). kvops × = kvops tok/s / that system's tok/s. EOS never ends a "
        "request, so every system generates exactly the requested tokens. hf-padded on a workload with "
        "different output lengths runs the whole batch to the longest output: only each request's own "
        "requested tokens count as useful (the computed total is in brackets). \"same tokens\" = requests "
        "whose tokens equal the reference system's (ref). hf-cb is sized like the engine (same KV bytes, "
        "batch-token budget and request cap; page size 256).",
        f"Load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} on {env['cpu_count']} CPUs"
        + (" — other processes were competing for the CPUs; absolute numbers are low and noisy."
           if max(load) > env["cpu_count"] + 0.5 else "."),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------ main


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


def _configure_logging() -> None:
    import structlog

    if structlog.is_configured():
        return
    try:
        from kvops.logs import configure_logging
    except ImportError:
        import logging

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    else:
        configure_logging("warning", json_logs=False)


def publish(report: dict[str, Any], table: str, json_path: str | None) -> None:
    """Print the table; with --json also write the report (table included) to `json_path`."""
    report["table"] = table
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        log(f"results written to {path}")
    print(table, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _configure_logging()
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
        _agreement(results, w)
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
