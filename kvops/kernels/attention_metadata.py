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
    # The host-side original of metadata moved to a device by `to`: the ops plan from its lengths (split
    # counts, buckets, padded tables) without waiting for the device.
    host: AttentionMetadata | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def on_host(self) -> AttentionMetadata:
        """The CPU copy of this step's metadata (itself when it never left the host)."""
        return self.host if self.host is not None else self

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same step with its tensors on `device`, copied once and shared by every layer; itself when
        they are there already."""
        if self.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        spans = [PrefillSpan(s.start, s.end, s.context_len, move(s.block_table)) for s in self.prefills]
        return AttentionMetadata(self.block_size, move(self.slot_mapping), self.num_decode_tokens,
                                 move(self.decode_block_tables), move(self.decode_context_lens), spans,
                                 host=self.on_host)
