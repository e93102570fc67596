"""A recorded KV event stream: the messages a subscriber received, as received, to replay later (the fast
tests' fixtures, `kvops bench events`).

The file is a run of frames, each a header `>dqI` (when it arrived, unix seconds; the sequence number; the
payload's length) then the payload bytes exactly as they came off the wire; the topic is not kept. Reading
stops with RecordingError at a frame cut short, so a truncated file says so instead of yielding half a batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_HEADER = struct.Struct(">dqI")


class RecordingError(ValueError):
    """A recording file that is cut short or is not a recording."""


@dataclass(frozen=True, slots=True)
class Frame:
    received_at: float
    seq: int
    payload: bytes


def write_frame(out: BinaryIO, frame: Frame) -> None:
    out.write(_HEADER.pack(frame.received_at, frame.seq, len(frame.payload)))
    out.write(frame.payload)


def write_recording(path: Path, frames: Iterable[Frame]) -> int:
    """Write `frames` to `path`; returns how many."""
    count = 0
    with path.open("wb") as out:
        for frame in frames:
            write_frame(out, frame)
            count += 1
    return count


def read_recording(path: Path) -> Iterator[Frame]:
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        if offset + _HEADER.size > len(data):
            raise RecordingError(f"{path}: a frame header is cut short at byte {offset}: the file is truncated")
        received_at, seq, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        if offset + length > len(data):
            raise RecordingError(f"{path}: the frame at byte {offset - _HEADER.size} says {length} bytes and "
                                 f"{len(data) - offset} are left: the file is truncated or not a recording")
        yield Frame(received_at, seq, data[offset:offset + length])
        offset += length
