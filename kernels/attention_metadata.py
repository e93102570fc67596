"""What the attention ops need to know about one engine step, built once and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence's new tokens in this step: flat token range [start, end), `context_len` tokens
    of K/V in all after this step (cached prefix + the new ones), read through `block_table`."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # int64 [num_blocks_of_seq]


@dataclass
class AttentionMetadata:
    """Token layout of one forward pass over the paged cache.

    Tokens are flat: decode tokens (one per sequence) come first, then the prefill spans.
    """

    block_size: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]; slot = block_id * block_size + offset; < 0 skips
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int64 [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # int64 [num_decodes]
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Derived once per step by the torch reference and reused by every layer.
    _cache: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
