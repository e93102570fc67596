"""vLLM's KV cache events as they come off the wire, decoded with msgspec as vLLM encodes them.

A ZMQ message is three frames: the topic, the batch's sequence number (8 bytes, big-endian) and the payload,
a msgpack `EventBatch` written as an array `[ts, [event, ...], data_parallel_rank]`. Each event is a map
tagged by its `type`: BlockStored, BlockRemoved or AllBlocksCleared (vllm/distributed/kv_events.py). The
structs below read the fields kvops uses and ignore the rest, so fields vLLM adds later decode unchanged; a
block hash is bytes, or an int under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.

A batch that is not msgpack, or not that array, raises MalformedBatch; an event of a type kvops does not
know is skipped and counted in `DecodedBatch.unknown`, so one new event type does not lose its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: the LoRA name (if any), multimodal (identifier, offset) pairs, the cache salt and
    # prompt-embedding digests, untagged (vLLM >= 0.11; absent before).
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class MalformedBatch(ValueError):
    """A payload that is not a msgpack event batch."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float  # the publisher's clock when it built the batch (unix seconds)
    events: list[Event]
    data_parallel_rank: int | None
    unknown: int = 0  # events skipped: a type kvops does not know, or a known type with fields it cannot read


_batch = msgspec.msgpack.Decoder(_Batch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_event = msgspec.msgpack.Decoder(Event)


def decode_batch(payload: bytes) -> DecodedBatch:
    """One payload into its events; MalformedBatch when it is not an event batch at all."""
    try:
        batch = _batch.decode(payload)
        return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank)
    except msgspec.DecodeError:
        pass  # an unknown event type, or a bad batch: find out which, event by event
    try:
        raw = _raw_batch.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(f"not a KV event batch: {exc}") from None
    events: list[Event] = []
    unknown = 0
    for item in raw.events:
        try:
            events.append(_event.decode(item))
        except msgspec.DecodeError:
            unknown += 1
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank, unknown)


def decode_seq(frame: bytes) -> int:
    """The sequence-number frame: 8 bytes, big-endian, signed (the replay socket's end marker is -1)."""
    if len(frame) != 8:
        raise MalformedBatch(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
