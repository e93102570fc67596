"""Attention and cache ops (imported as `kvops.kernels`).

One interface for every op; this module dispatches to the implementation. On CPU that is the
torch reference in `reference.py`; GPU kernels plug in behind the same signatures.
"""

from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan
from kvops.kernels.kv_cache import (
    KV_CACHE_DTYPES,
    KVCacheLayer,
    allocate_kv_cache_layer,
    layer_bytes_per_token,
)
from kvops.kernels.reference import (
    copy_blocks,
    dequantize_kv,
    gather_kv,
    paged_decode_attention,
    paged_prefill_attention,
    quantize_kv,
    swap_blocks,
    write_kv_cache,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "AttentionMetadata",
    "KVCacheLayer",
    "PrefillSpan",
    "allocate_kv_cache_layer",
    "copy_blocks",
    "dequantize_kv",
    "gather_kv",
    "layer_bytes_per_token",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_kv",
    "swap_blocks",
    "write_kv_cache",
]
