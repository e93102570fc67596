"""The index's memory of recently removed block hashes, so that a store of one counts as a restore (the same
KV computed again): bounded in entries and in age, O(1) to add, to find and to forget."""

from __future__ import annotations


class RemovedMemory:
    """Removed hashes (as their Python hash(): a 32-byte int instead of a 80-byte bytes object) -> when removed.

    Two dicts: removals go into `current`; once it holds half the cap or is a window old, it becomes `previous`
    and the old `previous` is dropped. So at most `cap` entries are kept (a batch past it at worst), nothing older
    than two windows, and forgetting costs nothing per entry. A 64-bit hash can collide: about one false restore
    in 2**64 / (entries) stores.
    """

    __slots__ = ("current", "half", "previous", "started", "window_s")

    def __init__(self, window_s: float, cap: int) -> None:
        self.current: dict[int, float] = {}
        self.previous: dict[int, float] = {}
        self.started: float | None = None
        self.window_s = window_s
        self.half = max(1, cap // 2)

    def rotate(self, ts: float) -> None:
        """Called before a run of additions to `current`."""
        if self.started is None:
            self.started = ts
        elif len(self.current) >= self.half or ts - self.started > self.window_s:
            self.previous, self.current, self.started = self.current, {}, ts

    def take(self, key: int) -> float | None:
        found = self.current.pop(key, None)
        return self.previous.pop(key, None) if found is None else found

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)
