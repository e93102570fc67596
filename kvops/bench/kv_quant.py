"""`kvops bench kv-quant`: what each KV cache dtype saves and what it costs, on the default model.

For every dtype (the model dtype, int8, fp8 with calibrated scales, fp8 at the fixed scale 1.0 it used
before calibration, int4 with groups of 32 and of 64), one engine at the same KV budget reports:

- bytes per token and the pool's capacity in tokens (measured from the allocated tensors);
- greedy agreement with fp32: the chat prompts of `kvops bench`, 64 new tokens each (EOS ignored),
  counting each prompt's tokens up to its first difference from the fp32 output;
- next-token agreement and perplexity on a fixed text (the benchmark's prose, prefilled in chunks
  of 256 tokens, so later chunks read their context back from the quantized cache);
- the worst layer's cosine similarity and relative error in the KV error profile (steps 10, 50, 100);
- fp8: each layer's K and V scales.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

from kvops.bench.report import configure_logging, log, publish
from kvops.bench.workloads import CHAT_QUESTIONS
from kvops.prose import PROSE

# (name, kv dtype, int4 group size); "fp8/1.0" is fp8 with the fixed scale 1.0, the baseline calibration beats.
VARIANTS = (("auto", "auto", 32), ("int8", "int8", 32), ("fp8", "fp8", 32), ("fp8/1.0", "fp8", 32),
            ("int4/g32", "int4", 32), ("int4/g64", "int4", 64))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(name: str, kind: str, group_size: int, args: argparse.Namespace,
            reference: dict[str, Any] | None) -> dict[str, Any]:
    from kvops.kernels.kv_cache import fixed_fp8_scale

    if name == "fp8/1.0":
        with fixed_fp8_scale(1.0):  # every fp8 pool the variant allocates, private ones included
            return _measure(name, kind, group_size, args, reference)
    return _measure(name, kind, group_size, args, reference)


def _measure(name: str, kind: str, group_size: int, args: argparse.Namespace,
             reference: dict[str, Any] | None) -> dict[str, Any]:
    from kvops.engine.config import EngineConfig
    from kvops.engine.kv_error_profile import profile_kv_error
    from kvops.engine.kv_quality import score_text
    from kvops.engine.llm import LLM
    from kvops.engine.sampling import SamplingParams

    started = time.perf_counter()
    llm = LLM(EngineConfig(kv_cache_dtype=kind, kv_cache_group_size=group_size, kv_cache_memory=args.kv_cache_memory,
                           max_model_len=1024, debug_scale_k=args.debug_scale_k or ""))
    engine = llm.engine
    questions = CHAT_QUESTIONS[: args.prompts]
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, greedy)]
    text_ids = engine.tokenizer(PROSE).input_ids
    score = score_text(engine, text_ids)
    profile = profile_kv_error(engine, steps=args.steps)
    result: dict[str, Any] = {
        "model": engine.model_name,
        "variant": name,
        "kv_cache_dtype": engine.kv_cache_dtype_name,
        "group_size": group_size if kind == "int4" else None,
        "bytes_per_token": engine.capacity.bytes_per_token,
        "allocated_bytes": engine.kv_pool.allocated_bytes,
        "capacity_tokens": engine.capacity.tokens,
        "perplexity": round(score.perplexity, 4),
        "text_tokens": len(text_ids),
        "min_layer_cosine": min(entry.min_cosine for entry in profile.layers),
        "max_layer_rel_error": max(max(e.k_rel_error or 0.0, e.v_rel_error or 0.0) for e in profile.layers),
        "flagged_layers": profile.flagged,
        "outputs": outputs,
        "predictions": score.predictions,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if kind == "fp8":
        # The serving pool's scales (calibrated on the chat prompts' first step), which the profile and
        # the perplexity run reuse; per layer, [K, V].
        result["fp8_scales"] = [[round(x, 6) for x in layer.scale.tolist()] for layer in engine.kv_pool.device]
    if reference is not None:
        agreeing = [_common_prefix(out, ref) for out, ref in zip(outputs, reference["outputs"], strict=True)]
        result["greedy_agreement"] = round(sum(agreeing) / sum(len(r) for r in reference["outputs"]), 4)
        result["identical_prompts"] = sum(a == len(r) for a, r in zip(agreeing, reference["outputs"], strict=True))
        same = sum(p == q for p, q in zip(score.predictions, reference["predictions"], strict=True))
        result["next_token_agreement"] = round(same / len(score.predictions), 4)
        result["perplexity_change"] = round(score.perplexity / reference["perplexity"] - 1, 4)
        result["capacity_ratio"] = round(engine.capacity.tokens / reference["capacity_tokens"], 3)
    del llm, engine
    gc.collect()
    return result


def render(report: dict[str, Any]) -> str:
    lines = [
        f"KV cache dtypes on {report['model']}, budget {report['kv_cache_memory']}, "
        f"{report['prompts']} chat prompts x {report['max_tokens']} greedy tokens, perplexity on "
        f"{report['variants'][0]['text_tokens']} tokens of fixed prose",
        "",
        f"{'kv dtype':<10} {'bytes/token':>11} {'capacity':>14} {'greedy agree':>13} {'identical':>10} "
        f"{'next-token':>10} {'perplexity':>16} {'worst layer cos':>16} {'worst rel err':>14}",
    ]
    for v in report["variants"]:
        name = v["variant"]
        ratio = v.get("capacity_ratio", 1.0)
        change = v.get("perplexity_change", 0.0)
        lines.append(
            f"{name:<10} {v['bytes_per_token']:>11} {v['capacity_tokens']:>7} ({ratio:4.2f}x) "
            f"{v.get('greedy_agreement', 1.0):>12.1%} {v.get('identical_prompts', report['prompts']):>6}/"
            f"{report['prompts']:<3} {v.get('next_token_agreement', 1.0):>10.1%} "
            f"{v['perplexity']:>8.3f} ({change:+.2%}) {v['min_layer_cosine']:>16.5f} "
            f"{v['max_layer_rel_error']:>14.5f}")
    for v in report["variants"]:
        if "fp8_scales" in v:
            k, s = zip(*v["fp8_scales"], strict=True)
            top = max(range(len(k)), key=k.__getitem__)
            lines.append(f"{v['variant']} scales: K {min(k):.4g}..{max(k):.4g} (largest: layer {top}), "
                         f"V {min(s):.4g}..{max(s):.4g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvops bench kv-quant",
                                     description="Bytes, capacity and quality of each KV cache dtype.")
    parser.add_argument("--kv-cache-memory", default="512MiB", help="KV budget of every engine (default: 512MiB)")
    parser.add_argument("--prompts", type=int, default=16, help="chat prompts for greedy agreement (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens, profile at step 10: a smoke test")
    names = [name for name, _, _ in VARIANTS]
    parser.add_argument("--variants", default=",".join(names),
                        help=f"comma-separated subset of {', '.join(names)} (auto, the reference, always runs)")
    parser.add_argument("--debug-scale-k", metavar="LAYER:FACTOR",
                        help="scale one layer's K projection in every engine (e.g. 3:1000: keys past fp8's range)")
    args = parser.parse_args(argv)
    chosen = {name.strip() for name in args.variants.split(",") if name.strip()} | {"auto"}
    if chosen - set(names):
        parser.error(f"--variants: unknown {', '.join(sorted(chosen - set(names)))}; use some of {', '.join(names)}")
    if not 1 <= args.prompts <= len(CHAT_QUESTIONS):
        parser.error(f"--prompts must be between 1 and {len(CHAT_QUESTIONS)}")
    if args.quick:
        args.prompts, args.max_tokens = min(args.prompts, 4), min(args.max_tokens, 8)
    args.steps = [10] if args.quick else [10, 50, 100]

    configure_logging()
    from kvops.schema.errors import EngineError

    variants: list[dict[str, Any]] = []
    try:
        for name, kind, group in VARIANTS:
            if name in chosen:
                log(f"kv-quant: {name}")
                variants.append(measure(name, kind, group, args, variants[0] if variants else None))
    except EngineError as exc:
        print(f"kvops bench kv-quant: error: {exc}", file=sys.stderr)
        return 2
    report = {
        "command": "kvops bench kv-quant " + " ".join(sys.argv[2:] if argv is None else argv),
        "model": variants[0]["model"],
        "kv_cache_memory": args.kv_cache_memory,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "debug_scale_k": args.debug_scale_k,
        "variants": [{k: v for k, v in entry.items() if k not in ("outputs", "predictions")} for entry in variants],
    }
    publish(report, render(report), args.json)
    return 0
