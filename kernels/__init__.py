"""Attention and cache ops (imported as `kvops.kernels`).

One interface for every op; this module dispatches to the implementation. On CPU that is the
torch reference in `reference.py`; GPU kernels plug in behind the same signatures.
"""

from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan
from kvops.kernels.reference import (
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)

__all__ = [
    "AttentionMetadata",
    "PrefillSpan",
    "copy_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv_cache",
]
