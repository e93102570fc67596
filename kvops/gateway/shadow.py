"""What prompt normalization, masking or a shared cache salt would be worth, measured on the prompts the gateway
relays, before anyone turns them on.

The kvops engine answers that question with its shadow cache (normalized prompts looked up a second time). A vLLM has
none, and the gateway has no tokenizer, so it simulates prefix caches over the prompt text itself: each prompt is
cut into chunks of `CHUNK_CHARS` characters, each chunk named by the hash of its text and of every chunk before it
(a chain, as vLLM's block hashes are), under the cache salt the upstream gets (tenants that share no salt share no
prefix). A prompt's leading chunks found in the cache are the characters a prefix cache could have reused. Four
caches see the same prompts:

- as the clients sent them;
- whitespace-normalized (kvops.prompt_normalization);
- normalized, then every volatile value of kvops.gateway.volatile's catalog masked;
- as sent, with no salt at all: each chunk remembers the namespace (the salt, `shared` for none) that last sent it.
  A prompt's chunks found there beyond what its own namespace found are what sharing a salt with that namespace
  would add, counted per namespace.

The differences, over the same prompts, are the gains: what the prompt_variance rule (normalization, masks) and the
salt_split rule (sharing) read from the gateway. The absolute numbers are not vLLM's hit rate (characters, not
tokens; bounded LRUs, not vLLM's pool); the rules only compare the caches with each other, and a fix is then judged
on the hit rate vLLM itself reports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvops.gateway.volatile import CATALOG, found, mask_text
from kvops.prompt_normalization import normalize_prompt
from kvops.schema.gateway import SHARED

CHUNK_CHARS = 64  # about 16 tokens: a prefix shorter than a chunk is never counted as reused
CAPACITY = 32768  # chunk hashes per cache (~2 MiB of text, a few MiB of memory)
EVERY_PATTERN = list(CATALOG)


@dataclass(frozen=True, slots=True)
class PromptText:
    """One prompt as the caches see it."""

    sent: str
    normalized: str  # whitespace-normalized
    masked: str  # normalized, then every volatile value masked

    @classmethod
    def of(cls, sent: str, normalized: str) -> PromptText:
        return cls(sent, normalized, mask_text(normalized, EVERY_PATTERN))


@dataclass(frozen=True, slots=True)
class Reuse:
    """A request's prompts: their characters, and how many of them each cache found at their front."""

    chars: int
    reused: int
    normalized_reused: int
    masked_reused: int = 0
    volatile: dict[str, int] = field(default_factory=dict)  # characters of each catalog pattern in the prompts
    shareable: dict[str, int] = field(default_factory=dict)  # namespace -> characters only sharing it would reuse


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


class _OwnedChunkCache:
    """An LRU map of chained chunk hashes with no salt, each to the namespace that last sent the chunk."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[int, str] = OrderedDict()

    def shareable(self, namespace: str, text: str, own: int, into: dict[str, int]) -> None:
        """Adds to `into`, per other namespace, the characters of `text`'s found front beyond the `own` characters
        its own namespace found; every chunk of it is then owned by `namespace`."""
        chain, in_front = 0, True
        owners = self._owners
        for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            chain = hash((chain, text[start:start + CHUNK_CHARS]))
            owner = owners.get(chain) if in_front else None
            if owner is None:
                in_front = False
            elif start >= own and owner != namespace:
                into[owner] = into.get(owner, 0) + CHUNK_CHARS
            owners[chain] = namespace
            owners.move_to_end(chain)
            if len(owners) > self.capacity:
                owners.popitem(last=False)


class ShadowReuse:
    """The simulated caches, shared by every tenant (the salt keeps them apart where the upstream does)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._raw = _ChunkCache(capacity)
        self._normalized = _ChunkCache(capacity)
        self._masked = _ChunkCache(capacity)
        self._unsalted = _OwnedChunkCache(capacity)
        self._lock = threading.Lock()

    def observe(self, salt: str | None, prompts: Iterable[PromptText]) -> Reuse:
        """Look up and cache each prompt, in each of its forms, under the salt."""
        chars = reused = normalized = masked = 0
        volatile: dict[str, int] = {}
        shareable: dict[str, int] = {}
        namespace = salt or SHARED  # prompts sent with no salt: the shared tenants' namespace
        for prompt in prompts:
            with self._lock:
                own = self._raw.reuse(salt, prompt.sent)
                normalized += self._normalized.reuse(salt, prompt.normalized)
                masked += self._masked.reuse(salt, prompt.masked)
                self._unsalted.shareable(namespace, prompt.sent, own, shareable)
            reused += own
            chars += len(prompt.sent)
            for name, count in found(prompt.sent).items():
                volatile[name] = volatile.get(name, 0) + count
        # Normalizing or masking shortens a prompt: what it reuses is counted against the text as sent.
        return Reuse(chars, reused, min(normalized, chars), min(masked, chars), volatile, shareable)


def prompt_texts(body: dict[str, Any]) -> list[PromptText]:
    """Each string prompt of a completion, or for a chat's messages one prompt: their string contents joined with
    their roles in order (the upstream's chat template lays them out one after another), each content
    normalized on its own as the gateway's normalization does it. Token ids: nothing."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [PromptText.of(prompt, normalize_prompt(prompt))]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [PromptText.of(p, normalize_prompt(p)) for p in prompt]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    said = [(str(m.get("role", "")), m["content"]) for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)]
    if not said:
        return []
    return [PromptText.of("".join(f"{role}\n{text}\n" for role, text in said),
                          "".join(f"{role}\n{normalize_prompt(text)}\n" for role, text in said))]
