"""What a BlockStored's LoRA and extra keys say about its block: whose it is (the tenant) and what besides its
token ids went into its hash (multimodal items, prompt embeddings).

vLLM >= 0.11 publishes one extra-keys entry per block, untagged, in the order it hashes them
(vllm/v1/core/kv_cache_utils.py, `generate_block_hash_extra_keys` and `to_event_extra_keys`): the LoRA name
(if the request has a LoRA), `(mm identifier, offset)` pairs for the multimodal items in the block, the cache
salt (only in a request's first block), then prompt-embedding digests (bytes). So the names are the bare
strings: the first is the LoRA's when `lora_name` is set, the next the salt.
"""

from __future__ import annotations

from kvops.events.wire import BlockStored
from kvops.schema.kv_events import NO_TENANT


def tenant_name(event: BlockStored, first_keys: object) -> str:
    """A chain's tenant from its root block: the cache salt, else the LoRA name, else NO_TENANT."""
    if isinstance(first_keys, list | tuple):
        names = [key for key in first_keys if isinstance(key, str)]
        if names and event.lora_name is not None and names[0] == event.lora_name:
            names = names[1:]
        if names:
            return names[0]
    if event.lora_name:
        return event.lora_name
    if event.lora_id is not None:  # vLLM before lora_name: only the (deprecated) adapter id
        return f"lora-{event.lora_id}"
    return NO_TENANT


def content_keys(keys: object) -> tuple[object, ...]:
    """The extra keys that are content (multimodal items, prompt embeddings), not salt or LoRA: they belong in
    the salt-free chain key, since two chains with the same token ids but other images are not duplicates."""
    if not isinstance(keys, list | tuple):
        return ()
    return tuple(tuple(key) if isinstance(key, list) else key for key in keys if not isinstance(key, str))
