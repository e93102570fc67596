"""Attention and cache ops (imported as `kvops.kernels`).

One interface for every op. The cache write and the two attention ops go through `dispatch.py`: the
Triton kernels (`triton_cache.py`, `triton_attention.py`) for CUDA tensors, the torch reference
(`reference.py`) on CPU; `KVOPS_KERNELS=triton|torch` forces either (docs/kernels.md).
"""

from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan
from kvops.kernels.dispatch import (
    BACKENDS,
    backend_for,
    paged_decode_attention,
    paged_prefill_attention,
    use_backend,
    write_kv_cache,
)
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
    quantize_kv,
    swap_blocks,
)

__all__ = [
    "BACKENDS",
    "KV_CACHE_DTYPES",
    "AttentionMetadata",
    "KVCacheLayer",
    "PrefillSpan",
    "allocate_kv_cache_layer",
    "backend_for",
    "copy_blocks",
    "dequantize_kv",
    "gather_kv",
    "layer_bytes_per_token",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_kv",
    "swap_blocks",
    "use_backend",
    "write_kv_cache",
]
