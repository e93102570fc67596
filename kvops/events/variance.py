"""Prompt variance seen in the root blocks: the same prompt's first block stored again and again with a few token
positions changed (a timestamp, a request id), each one a new chain the prefix cache cannot share.

The index keeps the token ids of the last RECENT_ROOTS distinct root blocks only (every other block keeps none),
and groups them on demand: roots of one tenant and one length are joined when they differ in 1 to
MAX_POSITIONS positions and in less than a tenth of the block. The comparison is all pairs at once in numpy,
redone only when a root came or went since the last call.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvops.events.wire import BlockHash
from kvops.schema.kv_events import RootVariant

RECENT_ROOTS = 256
MAX_POSITIONS = 4
MAX_GROUPS = 5
MAX_VARIANTS = 8  # roots listed per group
NAMED_ROOTS = 16  # roots of shared prefixes kept by name after they leave the recent set
FIRST_TOKENS = 16


class RecentRoots:
    """The last `capacity` distinct root blocks stored: hash -> (token ids, tenant)."""

    def __init__(self, capacity: int = RECENT_ROOTS) -> None:
        self.capacity = capacity
        self._roots: OrderedDict[BlockHash, tuple[tuple[int, ...], str]] = OrderedDict()
        self._named: OrderedDict[BlockHash, list[int]] = OrderedDict()
        self._changed = True
        self._groups: list[RootVariant] = []

    def __len__(self) -> int:
        return len(self._roots)

    def add(self, block_hash: BlockHash, tokens: tuple[int, ...], tenant: str) -> None:
        roots = self._roots
        if block_hash in roots:
            roots.move_to_end(block_hash)
            return
        roots[block_hash] = (tokens, tenant)
        if len(roots) > self.capacity:
            roots.popitem(last=False)
        self._changed = True

    def first_tokens(self, hashes: list[BlockHash]) -> dict[BlockHash, list[int]]:
        """The first token ids of these roots where known, and keep them known (shared prefixes' roots are
        stored once and then only hit, so they would drop out of the recent set while still in use)."""
        out: dict[BlockHash, list[int]] = {}
        for block_hash in hashes:
            known = self._roots.get(block_hash)
            if known is not None:
                out[block_hash] = list(known[0][:FIRST_TOKENS])
            elif block_hash in self._named:
                out[block_hash] = self._named[block_hash]
            else:
                continue
            self._named[block_hash] = out[block_hash]
            self._named.move_to_end(block_hash)
            if len(self._named) > NAMED_ROOTS:
                self._named.popitem(last=False)
        return out

    def variants(self) -> list[RootVariant]:
        """Groups of near-identical roots, most roots first."""
        if not self._changed:
            return self._groups
        by_kind: dict[tuple[str, int], dict[tuple[int, ...], None]] = {}
        for tokens, tenant in self._roots.values():
            by_kind.setdefault((tenant, len(tokens)), {})[tokens] = None  # distinct token lists, in order
        groups: list[RootVariant] = []
        for (tenant, length), distinct in by_kind.items():
            if len(distinct) >= 2 and length > 0:
                groups.extend(_group(np.array(list(distinct), dtype=np.int64), tenant))
        groups.sort(key=lambda g: -g.roots)
        self._groups = groups[:MAX_GROUPS]
        self._changed = False
        return self._groups


def _group(tokens: np.ndarray, tenant: str) -> list[RootVariant]:
    """Connected groups of rows (roots of one length) joined by small differences."""
    length = tokens.shape[1]
    differ = (tokens[:, None, :] != tokens[None, :, :]).sum(axis=2)
    near = (differ >= 1) & (differ <= MAX_POSITIONS) & (differ * 10 < length)
    if not near.any():
        return []
    count = len(tokens)
    labels = np.arange(count)
    while True:  # each root takes the smallest label among its neighbours until none changes
        joined = np.minimum(labels, np.where(near, labels[None, :], count).min(axis=1))
        if np.array_equal(joined, labels):
            break
        labels = joined
    out: list[RootVariant] = []
    for label in np.unique(labels).tolist():
        members = tokens[labels == label]
        if len(members) < 2:
            continue
        positions = np.flatnonzero((members != members[0]).any(axis=0))
        out.append(RootVariant(block_tokens=length, roots=len(members), positions=positions.tolist(),
                               variants=members[:MAX_VARIANTS][:, positions].tolist(), tenant=tenant))
    return out
