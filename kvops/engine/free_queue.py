"""The free-block queue: O(1) take from the front, O(1) return to the back."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator


class FreeBlockQueue:
    """FIFO of FREE block ids; returned blocks go to the back so writes spread over the pool."""

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._queue: deque[int] = deque(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def pop(self) -> int:
        return self._queue.popleft()

    def push(self, block_id: int) -> None:
        self._queue.append(block_id)
