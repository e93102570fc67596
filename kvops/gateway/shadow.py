"""What prompt normalization would be worth, measured on the prompts the gateway relays, before anyone turns it on.

The kvops engine answers that question with its shadow cache (normalized prompts looked up a second time). A vLLM has
none, and the gateway has no tokenizer, so it simulates two prefix caches over the prompt text itself: each prompt is
cut into chunks of `CHUNK_CHARS` characters, each chunk named by the hash of its text and of every chunk before it
(a chain, as vLLM's block hashes are), under the cache salt the upstream gets (tenants that share no salt share no
prefix). A prompt's leading chunks found in the cache are the characters a prefix cache could have reused. One cache
sees the prompts as the clients sent them, the other the same prompts whitespace-normalized (kvops.engine.normalize).

The difference between the two, over the same prompts, is the gain normalization would bring: what the
prompt_variance rule reads from the gateway (kvops.rules.prompt_variance). The absolute numbers are not vLLM's hit
rate (characters, not tokens; a bounded LRU, not vLLM's pool); the rule only compares the two caches with each other,
and the fix is then judged on the hit rate vLLM itself reports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvops.engine.normalize import normalize_prompt

CHUNK_CHARS = 64  # about 16 tokens: a prefix shorter than a chunk is never counted as reused
CAPACITY = 32768  # chunk hashes per cache (~2 MiB of text, a few MiB of memory)


@dataclass(frozen=True, slots=True)
class Reuse:
    """One prompt: its characters, and how many of them each cache found at its front."""

    chars: int
    reused: int
    normalized_reused: int


class _ChunkCache:
    """An LRU set of chained chunk hashes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def reuse(self, salt: str | None, text: str) -> int:
        """Characters at the front of `text` whose chunks are cached; every chunk of it is cached afterwards."""
        chain = hash(salt)
        reused, found = 0, True
        chunks = self._chunks
        for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            chain = hash((chain, text[start:start + CHUNK_CHARS]))
            if found and chain in chunks:
                reused += CHUNK_CHARS
                chunks.move_to_end(chain)
                continue
            found = False
            chunks[chain] = None
            if len(chunks) > self.capacity:
                chunks.popitem(last=False)
        return reused


class ShadowReuse:
    """The two simulated caches, shared by every tenant (the salt keeps them apart where the upstream does)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._raw = _ChunkCache(capacity)
        self._normalized = _ChunkCache(capacity)
        self._lock = threading.Lock()

    def observe(self, salt: str | None, prompts: Iterable[tuple[str, str]]) -> Reuse:
        """Look up and cache each (prompt as sent, the same normalized) under the salt."""
        chars = reused = normalized = 0
        for text, clean in prompts:
            with self._lock:
                reused += self._raw.reuse(salt, text)
                normalized += self._normalized.reuse(salt, clean)
            chars += len(text)
        return Reuse(chars, reused, min(normalized, chars))


def prompt_texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(as sent, normalized) for each string prompt of a completion, or for a chat's messages: their string contents
    joined with their roles in order (the upstream's chat template lays them out one after another), each content
    normalized on its own as the gateway's normalization does it. Token ids: nothing."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [(prompt, normalize_prompt(prompt))]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [(p, normalize_prompt(p)) for p in prompt]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    said = [(str(m.get("role", "")), m["content"]) for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)]
    if not said:
        return []
    return [("".join(f"{role}\n{text}\n" for role, text in said),
             "".join(f"{role}\n{normalize_prompt(text)}\n" for role, text in said))]
