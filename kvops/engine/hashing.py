"""Chained block hashes for prefix caching.

A full block's key covers its parent's key, its own token ids and extra keys (the tenant's
cache salt enters the first block), so equal keys mean equal prefixes, position included.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x1f")
        h.update(key.encode())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None, start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` on, chained from `parent`."""
    hashes: list[BlockHash] = []
    for index in range(start, len(token_ids) // block_size):
        extra = (salt,) if index == 0 and salt else ()
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
