"""The four measurements of `scripts/gpu-check`, each a function of a `PartContext` returning a JSON-able dict.

`kvops.bench.gpu_check` runs each in a child process of its own: a CUDA fault (an illegal address in a
kernel poisons the whole context) or a hang then costs that part only. The measuring code is kvops bench's
own: `Bench.run_kvops` and transformers' `generate` through `kvops.bench.peers`, `kv_quant.measure`, and
`kernel_bench`'s bandwidth functions, pointed at the device under test.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvops.bench import kv_quant, peers
from kvops.bench.engine import Bench
from kvops.bench.report import SystemResult, mark_agreement
from kvops.bench.workloads import CHAT_QUESTIONS, Workload


@dataclass(frozen=True)
class Sizes:
    parity_prompts: int
    parity_tokens: int
    chats: int
    chat_tokens: int
    throughput_runs: int  # timed runs per system, after one untimed warm-up run
    bandwidth_shapes: tuple[tuple[str, int, int], ...]  # (KV kind, batch, context); empty: the part is skipped
    copy_gib: float
    kv_variants: tuple[tuple[str, str, int], ...]  # kv_quant.VARIANTS' (name, KV dtype, int4 group); first: reference
    kv_prompts: int
    kv_tokens: int
    kv_steps: tuple[int, ...]


FULL = Sizes(
    parity_prompts=8, parity_tokens=64, chats=16, chat_tokens=64, throughput_runs=3,
    # Long contexts decide the bandwidth target (kernel_bench.long_context_verdict); one short row for contrast.
    bandwidth_shapes=(("auto", 16, 4096), ("auto", 16, 32768), ("auto", 4, 131072), ("auto", 1, 131072),
                      ("int8", 16, 32768), ("fp8", 16, 32768), ("int4", 16, 32768)),
    copy_gib=4.0, kv_variants=kv_quant.VARIANTS, kv_prompts=16, kv_tokens=64, kv_steps=(10, 50, 100),
)
SMOKE = Sizes(
    parity_prompts=2, parity_tokens=4, chats=2, chat_tokens=4, throughput_runs=1, bandwidth_shapes=(),
    copy_gib=0.0, kv_variants=kv_quant.VARIANTS[:2], kv_prompts=2, kv_tokens=4, kv_steps=(10,),
)


@dataclass
class PartContext:
    device: torch.device
    sizes: Sizes
    save: Callable[[dict[str, Any]], None]  # records a partial result: what survives if the part is cut short

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def kv_cache_memory(self) -> str:
        # On CUDA the engine's default 512MiB means "not set" and the pool would take ~90% of the device;
        # 1GiB is an explicit cap, plenty for these workloads, and quick to allocate five times over.
        return "1GiB" if self.cuda else "128MiB"


class DeviceBench(Bench):
    """`kvops bench`'s runners over a given engine and a transformers model on the device under test."""

    def __init__(self, llm: Any, hf_model: Any, device: torch.device) -> None:
        super().__init__(argparse.Namespace())
        self._llm = llm
        self._hf = OnDevice(hf_model, device)


class OnDevice:
    """A transformers model whose `generate` takes host tensors, as `kvops.bench.peers` builds them, and runs
    on the model's device. Greedy `generate` reads each step's tokens back to decide whether to stop, so the
    device is synchronized by the time it returns and peers' wall clock is fair."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.model.generate(input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                   **kwargs)


def _engine(ctx: PartContext, dtype: str, max_model_len: int = 1024) -> Any:
    from kvops.engine.config import EngineConfig
    from kvops.engine.llm import LLM

    return LLM(EngineConfig(device=str(ctx.device), dtype=dtype, kv_cache_memory=ctx.kv_cache_memory,
                            max_model_len=max_model_len))


def _chat_workload(engine: Any, name: str, prompts: int, tokens: int) -> Workload:
    ids = [engine.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:prompts]]
    return Workload(name, f"{prompts} chat prompts x {tokens} greedy tokens", ids, [tokens] * prompts)


def compare_tokens(got: list[int], want: list[int]) -> dict[str, Any]:
    """Where `got` leaves `want`: the first differing position (None when equal) and the share of `want`
    generated before it (after one flip a greedy continuation is a different text, so later positions
    say nothing)."""
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    agreeing = len(want) if first is None else first
    return {"matched": first is None, "first_diff": first,
            "match_fraction": round(agreeing / len(want), 4) if want else 1.0}


def _summary(kvops_out: list[list[int]], ref_out: list[list[int]], prompts: list[list[int]]) -> dict[str, Any]:
    rows = [{"prompt": i, "prompt_tokens": len(p), **compare_tokens(got, want), "kvops": got, "transformers": want}
            for i, (p, got, want) in enumerate(zip(prompts, kvops_out, ref_out, strict=True))]
    diffs = [r["first_diff"] for r in rows if r["first_diff"] is not None]
    return {"matched_prompts": sum(r["matched"] for r in rows), "of": len(rows),
            "all_matched": all(r["matched"] for r in rows),
            "mean_match_fraction": round(statistics.fmean(r["match_fraction"] for r in rows), 4),
            "earliest_first_diff": min(diffs, default=None), "per_prompt": rows}


def parity(ctx: PartContext) -> dict[str, Any]:
    """Greedy tokens of the kvops engine against transformers' `generate` (one prompt at a time, EOS
    ignored by both) on the same device: float32 must match exactly; bfloat16's divergence is measured,
    beside transformers' own bfloat16-vs-float32 divergence for scale."""
    result: dict[str, Any] = {"prompts": ctx.sizes.parity_prompts, "tokens": ctx.sizes.parity_tokens,
                              "reference": "transformers generate, one prompt at a time, same device and dtype"}
    hf: Any = None
    hf_fp32: list[list[int]] | None = None
    for dtype in ("float32", "bfloat16"):
        started = time.perf_counter()
        llm = _engine(ctx, dtype)
        if hf is None:
            hf = peers.load_model(llm.engine.model_dir)
        hf.to(device=ctx.device, dtype=getattr(torch, dtype))
        bench = DeviceBench(llm, hf, ctx.device)
        w = _chat_workload(llm.engine, "parity", ctx.sizes.parity_prompts, ctx.sizes.parity_tokens)
        ours, theirs = bench.run_kvops(w), bench.run_hf_generate(w)
        entry = {"kvops_dtype": llm.engine.dtype_name, "kernels": llm.engine.kernel_backend,
                 **_summary(ours.outputs, theirs.outputs, w.prompts)}
        if hf_fp32 is None:
            hf_fp32 = theirs.outputs
        else:  # bf16 rounding alone moves greedy tokens; this is the scale for kvops' own bf16 divergence
            hf_self = [compare_tokens(got, want) for got, want in zip(theirs.outputs, hf_fp32, strict=True)]
            entry["transformers_vs_its_float32"] = {
                "matched_prompts": sum(r["matched"] for r in hf_self),
                "mean_match_fraction": round(statistics.fmean(r["match_fraction"] for r in hf_self), 4)}
        entry["seconds"] = round(time.perf_counter() - started, 2)
        result[dtype] = entry
        ctx.save(result)
        del llm, bench  # before the next engine: one KV pool on the device at a time
        gc.collect()
    return result


def throughput(ctx: PartContext) -> dict[str, Any]:
    """16 concurrent chats x 64 tokens: the kvops engine against transformers' padded batched `generate`,
    both in the engine's default dtype on this device (bfloat16 on CUDA, float32 on CPU)."""
    dtype = "bfloat16" if ctx.cuda else "float32"
    llm = _engine(ctx, dtype, max_model_len=2048)
    hf = peers.load_model(llm.engine.model_dir).to(device=ctx.device, dtype=getattr(torch, dtype))
    bench = DeviceBench(llm, hf, ctx.device)
    w = _chat_workload(llm.engine, "chats", ctx.sizes.chats, ctx.sizes.chat_tokens)
    systems = {"kvops": bench.run_kvops, "hf-padded": bench.run_hf_padded}
    for run in systems.values():  # untimed: Triton compiles, cuBLAS picks algorithms, the allocator fills
        run(w)
    runs: dict[str, list[Any]] = {name: [] for name in systems}
    for k in range(ctx.sizes.throughput_runs):
        order = list(systems) if k % 2 == 0 else list(reversed(systems))  # a slow spell hits both
        for name in order:
            runs[name].append(systems[name](w))
    results = {name: SystemResult(name, r) for name, r in runs.items()}
    mark_agreement(results, w)
    ours, theirs = results["kvops"].median.tok_s, results["hf-padded"].median.tok_s
    return {"dtype": dtype, "workload": w.description, "requests": w.num_requests, "prompt_tokens": w.prompt_tokens,
            "timed_runs": ctx.sizes.throughput_runs, "kvops_tok_s": round(ours, 2),
            "transformers_tok_s": round(theirs, 2), "ratio": round(ours / theirs, 3) if theirs else None,
            "systems": {name: r.to_json() for name, r in results.items()}}


def bandwidth(ctx: PartContext) -> dict[str, Any]:
    """Paged decode attention's effective bandwidth (KV bytes read / time) against the device's copy
    bandwidth, on a few of `benchmarks/kernels_gpu.py`'s shapes."""
    from kvops.bench import kernel_bench

    if not ctx.cuda:
        raise RuntimeError("the Triton bandwidth part needs a CUDA device")
    torch.manual_seed(0)
    copy_gbs = kernel_bench.copy_bandwidth_gbs(ctx.sizes.copy_gib)
    result: dict[str, Any] = {"copy_gbs": round(copy_gbs, 1), "copy_gib": ctx.sizes.copy_gib,
                              "model_layer": "Llama-3-8B attention: 32 query heads, 8 KV heads of 128, bf16, "
                                             "block size 16", "rows": []}
    for kind, batch, context in ctx.sizes.bandwidth_shapes:
        result["rows"].append(asdict(kernel_bench.decode_bandwidth(kind, batch, context, copy_gbs)))
        ctx.save(result)
    verdict = kernel_bench.long_context_verdict([kernel_bench.Row(**r) for r in result["rows"]])
    result["target"] = {"of_copy": kernel_bench.TARGET, **asdict(verdict)}
    return result


def kv_quant_error(ctx: PartContext) -> dict[str, Any]:
    """`kvops bench kv-quant`'s measures per KV dtype on this device, against the model dtype's KV."""
    # kv_quant.measure builds its engines with --device auto: on CUDA the current device, which the child
    # process set to ours; a CPU check hides the GPUs from it (gpu_check's child environment).
    args = argparse.Namespace(kv_cache_memory=ctx.kv_cache_memory, prompts=ctx.sizes.kv_prompts,
                              max_tokens=ctx.sizes.kv_tokens, steps=list(ctx.sizes.kv_steps), debug_scale_k=None)
    result: dict[str, Any] = {"prompts": args.prompts, "max_tokens": args.max_tokens, "profile_steps": args.steps,
                              "variants": []}
    reference: dict[str, Any] | None = None
    for name, kind, group in ctx.sizes.kv_variants:
        measured = kv_quant.measure(name, kind, group, args, reference)
        reference = reference or measured
        result["variants"].append({k: v for k, v in measured.items() if k not in ("outputs", "predictions")})
        ctx.save(result)
    return result


PARTS: dict[str, Callable[[PartContext], dict[str, Any]]] = {
    "parity": parity, "throughput": throughput, "bandwidth": bandwidth, "kv_quant": kv_quant_error,
}
