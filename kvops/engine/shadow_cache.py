"""Shadow prefix cache: the hit rate prompt normalization *would* give, while it is off.

In shadow mode the engine serves every prompt unchanged, and also normalizes it
(`kvops.prompt_normalization`), tokenizes the normalized text and passes those token ids to
`ShadowPrefixCache.observe`. The shadow cache keeps only block hashes, no K/V, so it costs a few
bytes per block and one hash per prompt block.

Keys are exactly the real cache's keys (`kvops.engine.hashing.block_hashes`: chained, with the
cache salt in the first block), and a lookup follows the real cache's rule: the longest run of
leading full blocks present, always leaving at least the last prompt token to compute. Hit rate
is the real cache's definition too: hit tokens / prompt tokens queried.

It is an estimate: the real cache is modelled as an LRU of hashes with the same capacity in
blocks. The model does not see blocks held by running sequences, blocks of generated tokens,
per-tenant quotas, the LFU policy, preemption or chunked prefill, and it counts every prompt
observed (the real cache counts a request once, at its first admission).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvops.engine.hashing import BlockHash, block_hashes


class ShadowPrefixCache:
    """A bounded LRU of full-block hashes that predicts prefix-cache hits."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self._check(capacity_blocks, block_size)
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self.queries_total = 0  # prompt tokens observed
        self.hits_total = 0  # of which predicted prefix hits

    @staticmethod
    def _check(capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {capacity_blocks} × {block_size})")

    @property
    def hit_rate(self) -> float:
        """Predicted hit tokens / prompt tokens queried (0.0 before any query)."""
        return self.hits_total / self.queries_total if self.queries_total else 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def observe(self, token_ids: Sequence[int], salt: str | None) -> int:
        """Predicted prefix-hit tokens for this prompt; then records its full blocks as cached.

        The hit is the longest run of the prompt's leading full blocks in the cache, at most
        ``(len(token_ids) - 1) // block_size`` blocks (the last token is always computed). Hit
        blocks are touched as recently used and the prompt's other full blocks inserted; beyond
        capacity the least recently used blocks are evicted. Within one prompt the first block
        counts as the most recently used, so (as with the real cache's LRU tie-break) a chain's
        tail is evicted before its shared prefix.
        """
        hashes = block_hashes(token_ids, self.block_size, salt)
        max_hit_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hit_blocks = 0
        for block_hash in hashes[:max_hit_blocks]:
            if block_hash not in self._blocks:
                break
            hit_blocks += 1
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        hit_tokens = hit_blocks * self.block_size
        self.queries_total += len(token_ids)
        self.hits_total += hit_tokens
        return hit_tokens

    def clear(self) -> None:
        """Forget every block; the counters are cumulative and keep their values."""
        self._blocks.clear()

    def resize(self, capacity_blocks: int, block_size: int) -> None:
        """New capacity and block size (e.g. after the engine's pool or block size changed).

        Clears the cached blocks, since hashes of another block size never match; the counters
        are cumulative and keep their values.
        """
        self._check(capacity_blocks, block_size)
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks.clear()
