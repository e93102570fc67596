"""Eviction policies for CACHED blocks.

Each policy turns a block into a priority key; the evictor pops the smallest key first.
Keys only change when a block is touched, so a heap with lazy deletion gives O(log n).
"""

from __future__ import annotations

import heapq
import math
from typing import Protocol

from kvops.engine.block import Block, BlockState
from kvops.engine.config import EVICTION_POLICIES


class EvictionPolicy(Protocol):
    name: str

    def key(self, block: Block) -> tuple[float, ...]: ...

    def touch(self, block: Block, now: float) -> None:
        """The block was used (released by its last holder): move its access time to `now`."""
        ...

    def on_hit(self, block: Block, now: float) -> None:
        """A prefix-cache hit on the block at `now`."""
        ...


class LRU:
    """Least recently used first; on ties the tail of the longest chain first (prefixes outlive suffixes)."""

    name = "lru"

    def key(self, block: Block) -> tuple[float, ...]:
        return (block.last_access, -block.depth, block.block_id)

    def touch(self, block: Block, now: float) -> None:
        block.last_access = now

    def on_hit(self, block: Block, now: float) -> None:
        block.last_access = now
        block.freq += 1.0


class LFU:
    """Least frequently used, with recent hits weighted up.

    The frequency decays with half-life `half_life_s`. Ranking blocks by freq * 2**((t - now)/H)
    is the same as ranking by log2(freq) + t/H, which does not move with `now`.
    """

    name = "lfu"

    def __init__(self, half_life_s: float = 60.0) -> None:
        self.half_life_s = half_life_s

    def key(self, block: Block) -> tuple[float, ...]:
        score = math.log2(max(block.freq, 1e-9)) + block.last_access / self.half_life_s
        return (score, -block.depth, block.block_id)

    def touch(self, block: Block, now: float) -> None:
        """Decay the frequency to `now` before moving the access time, so no hit is counted at full weight twice."""
        block.freq *= 2.0 ** (-(now - block.last_access) / self.half_life_s)
        block.last_access = now

    def on_hit(self, block: Block, now: float) -> None:
        self.touch(block, now)
        block.freq += 1.0


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(EVICTION_POLICIES)}")


Entry = tuple[tuple[float, ...], int, Block]
ANY_OWNER = object()  # pop from any tenant's cached blocks


class Evictor:
    """The set of CACHED blocks, ordered by an eviction policy and partitioned by owning tenant,
    so that an isolated tenant can evict its own cached blocks without touching anyone else's."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heaps: dict[str | None, list[Entry]] = {}
        self._live: dict[str | None, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def count(self, owner: str | None) -> int:
        """Cached blocks owned by `owner`."""
        return self._live.get(owner, 0)

    def add(self, block: Block) -> None:
        heapq.heappush(self._heaps.setdefault(block.owner, []), (self.policy.key(block), block.evict_version, block))
        self._live[block.owner] = self._live.get(block.owner, 0) + 1
        self._total += 1

    def remove(self, block: Block) -> None:
        """Forget a block that left CACHED (a prefix hit); its heap entry goes stale."""
        block.evict_version += 1
        self._live[block.owner] -= 1
        self._total -= 1
        heap = self._heaps[block.owner]
        if len(heap) > 64 and len(heap) > 4 * self._live[block.owner]:
            heap[:] = [entry for entry in heap if self._is_live(entry)]
            heapq.heapify(heap)

    def pop(self, owner: object = ANY_OWNER) -> Block:
        """The next block to evict: overall, or among `owner`'s cached blocks."""
        if owner is ANY_OWNER:
            candidates = [o for o, live in self._live.items() if live]
            if not candidates:
                raise IndexError("no cached block to evict")
            owner = min(candidates, key=lambda o: self._top(o)[0])
        if not self._live.get(owner):  # type: ignore[call-overload]
            raise IndexError(f"no cached block of {owner!r} to evict")
        entry = self._top(owner)  # type: ignore[arg-type]
        heapq.heappop(self._heaps[owner])  # type: ignore[index]
        block = entry[2]
        block.evict_version += 1
        self._live[owner] -= 1  # type: ignore[index]
        self._total -= 1
        return block

    def blocks(self) -> list[Block]:
        return [entry[2] for heap in self._heaps.values() for entry in heap if self._is_live(entry)]

    def rebuild(self, policy: EvictionPolicy) -> None:
        live = self.blocks()
        self.policy = policy
        self._heaps, self._live, self._total = {}, {}, 0
        for block in live:
            self.add(block)

    def _top(self, owner: str | None) -> Entry:
        heap = self._heaps[owner]
        while not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0]

    @staticmethod
    def _is_live(entry: Entry) -> bool:
        _, version, block = entry
        return block.state is BlockState.CACHED and block.evict_version == version
