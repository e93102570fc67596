"""`kvops bench events`: how fast the resident-block index takes vLLM's KV cache events, and its memory per block.

1. Rate: recorded streams (kvops.events.recording; by default the real vLLM recordings in
   tests/fixtures/kv-events) are replayed at full speed into a ResidentIndex, `--repeat` times. Each repeat
   renumbers the block hashes and moves the clock on past the last one, and AllBlocksCleared events are left
   out, so every repeat adds its surviving blocks and a short recording still measures a large index. Two
   indexes are fed the same payloads: one times decode (kvops.events.wire.decode_batch) plus apply, the other
   apply alone. The payloads are encoded as vLLM encodes them (`vllm_payload`) before the clock starts.
2. stats(): the view the supervisor asks for twice a second, timed on the grown index.
3. Memory, and stats() on a large index: kvops.bench.events_memory, in a fresh process each.

Nothing here is a timed assertion: docs/benchmarks.md ("KV event index") records the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvops.bench.events_memory import ProbeError, probe_in_child
from kvops.events import wire
from kvops.events.index import ResidentIndex
from kvops.events.recording import RecordingError, read_recording
from kvops.schema.kv_events import EventStreamHealth

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "kv-events"
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E37_79B9_7F4A_7C15  # renumbering: repeat r xors every hash with r * GOLDEN
TOKEN_SHIFT = 1 << 20  # ... and adds r * TOKEN_SHIFT to every token id (past any vocabulary)


# ------------------------------------------------------------------------------ vLLM's encoding

class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM 0.32's BlockStored (vllm/distributed/kv_events.py), field for field, as it goes on the wire."""

    block_hashes: list[wire.BlockHash]
    parent_block_hash: wire.BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[wire.BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def vllm_event(event: wire.Event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, wire.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium, event.lora_name, event.extra_keys)
    if isinstance(event, wire.BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def vllm_payload(ts: float, events: list[wire.Event], data_parallel_rank: int | None = None) -> bytes:
    """A batch's payload exactly as vLLM's ZMQ publisher sends it: msgspec msgpack of an array-like EventBatch
    [ts, [event, ...], rank] whose events are maps tagged by "type", with defaulted fields left out."""
    return _encoder.encode(EventBatch(ts, [vllm_event(e) for e in events], data_parallel_rank))


# ------------------------------------------------------------------------------ the replay

def recording_paths(given: list[str] | None) -> list[Path]:
    """The .kvev files named (a folder means every .kvev in it); the fixtures when none is."""
    paths: list[Path] = []
    for name in given or [str(FIXTURES)]:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.glob("*.kvev"))
            if not found:
                raise RecordingError(f"{path} has no .kvev recording: record one with `scripts/record-kv-events` "
                                     "or a subscriber's record_to, or name a file with --recording")
            paths.extend(found)
        elif path.is_file():
            paths.append(path)
        else:
            raise RecordingError(f"{path}: no such recording (give a .kvev file or a folder of them)")
    return paths


def load_batches(paths: list[Path]) -> list[wire.DecodedBatch]:
    """Every batch of the recordings, end to end: each recording's clock is moved to start a second after the
    previous one ends, so the replay's time only goes forward."""
    batches: list[wire.DecodedBatch] = []
    for path in paths:
        try:
            own = [wire.decode_batch(frame.payload) for frame in read_recording(path)]
        except wire.MalformedBatch as exc:
            raise RecordingError(f"{path}: a frame is not a KV event batch ({exc}): is it a kvops recording?") from None
        if not own:
            continue
        shift = (batches[-1].ts + 1.0 - own[0].ts) if batches else 0.0
        batches.extend(wire.DecodedBatch(b.ts + shift, b.events, b.data_parallel_rank) for b in own)
    if not batches:
        raise RecordingError(f"no batch in {', '.join(map(str, paths))}: the recordings are empty")
    return batches


def _renumber(block_hash: wire.BlockHash, mix: int) -> wire.BlockHash:
    if isinstance(block_hash, int):
        return block_hash ^ mix
    return ((int.from_bytes(block_hash[:8], "big") ^ mix) & MASK64).to_bytes(8, "big") + block_hash[8:]


def repeat_payloads(batches: list[wire.DecodedBatch], repeat: int, span_s: float) -> list[bytes]:
    """Repeat `repeat` of the stream, encoded: hashes renumbered, token ids moved past the last repeat's (so its
    chains are new prompts, not the same ones under other salts), clock moved on, AllBlocksCleared left out."""
    mix = (repeat * GOLDEN) & MASK64
    shift = repeat * TOKEN_SHIFT
    out: list[bytes] = []
    for batch in batches:
        events: list[wire.Event] = []
        for event in batch.events:
            if isinstance(event, wire.BlockStored):
                parent = event.parent_block_hash
                events.append(msgspec.structs.replace(
                    event, block_hashes=[_renumber(h, mix) for h in event.block_hashes],
                    parent_block_hash=None if parent is None else _renumber(parent, mix),
                    token_ids=[t + shift for t in event.token_ids] if shift else event.token_ids))
            elif isinstance(event, wire.BlockRemoved):
                renumbered = [_renumber(h, mix) for h in event.block_hashes]
                events.append(msgspec.structs.replace(event, block_hashes=renumbered))
        out.append(vllm_payload(batch.ts + repeat * span_s, events, batch.data_parallel_rank))
    return out


def replay(batches: list[wire.DecodedBatch], repeats: int) -> dict[str, Any]:
    """Both timings over `repeats` renumbered copies of the stream, and stats() on the grown index. Each is
    taken as wall time and as this thread's CPU time: on a shared machine the CPU time is the one-core rate."""
    span_s = batches[-1].ts - batches[0].ts + 1.0
    with_decode, apply_only = ResidentIndex(), ResidentIndex()
    spent = {"decode_apply": [0.0, 0.0], "apply": [0.0, 0.0]}  # [wall, cpu]
    events = stored = removed = 0
    for repeat in range(repeats):
        payloads = repeat_payloads(batches, repeat, span_s)
        wall, cpu = time.perf_counter(), time.thread_time()
        for payload in payloads:
            with_decode.apply(wire.decode_batch(payload))
        spent["decode_apply"][0] += time.perf_counter() - wall
        spent["decode_apply"][1] += time.thread_time() - cpu
        decoded = [wire.decode_batch(payload) for payload in payloads]
        wall, cpu = time.perf_counter(), time.thread_time()
        for batch in decoded:
            apply_only.apply(batch)
        spent["apply"][0] += time.perf_counter() - wall
        spent["apply"][1] += time.thread_time() - cpu
        for batch in decoded:
            events += len(batch.events)
            stored += sum(len(e.block_hashes) for e in batch.events if isinstance(e, wire.BlockStored))
            removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, wire.BlockRemoved))
    now = batches[-1].ts + (repeats - 1) * span_s + 1.0
    health = EventStreamHealth(endpoint="replay")
    timings = []
    for _ in range(5):
        with_decode.apply(wire.DecodedBatch(now, [], None))  # a new batch: nothing is served from stats()'s cache
        cpu = time.thread_time()
        with_decode.stats(now, health)
        timings.append(time.thread_time() - cpu)
    out: dict[str, Any] = {"batches": len(batches) * repeats, "events": events, "blocks_stored": stored,
                           "blocks_removed": removed}
    for name, (wall_s, cpu_s) in spent.items():
        out[f"{name}_wall_s"], out[f"{name}_cpu_s"] = round(wall_s, 3), round(cpu_s, 3)
        out[f"{name}_events_per_s"] = round(events / cpu_s) if cpu_s > 0 else None
        out[f"{name}_events_per_wall_s"] = round(events / wall_s) if wall_s > 0 else None
    out["resident_blocks"] = with_decode.resident_blocks
    out["stats_ms"] = round(statistics.median(timings) * 1000, 2)
    return out


# ------------------------------------------------------------------------------ the command

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run(paths: list[Path], repeats: int, memory_blocks: int, traced: bool = False) -> dict[str, Any]:
    batches = load_batches(paths)
    report: dict[str, Any] = {
        "recordings": [str(p) for p in paths], "repeat": repeats, "cpu": cpu_name(),
        "python": sys.version.split()[0], "replay": replay(batches, repeats),
    }
    report["memory"] = ([probe_in_child(memory_blocks, tenants, traced) for tenants in (1, 2)]
                        if memory_blocks > 0 else [])
    return report


def render(report: dict[str, Any]) -> str:
    r = report["replay"]
    lines = [
        f"KV event index on {report['cpu']}, Python {report['python']}, one thread",
        f"replay: {len(report['recordings'])} recording(s) x {report['repeat']} repeats: {r['events']} events in "
        f"{r['batches']} batches ({r['blocks_stored']} blocks stored, {r['blocks_removed']} removed)",
        "",
        f"{'measure':<40} {'value':>12}",
        f"{'decode + apply, events/CPU s':<40} {r['decode_apply_events_per_s'] or 0:>12,}",
        f"{'decode + apply, events/wall s':<40} {r['decode_apply_events_per_wall_s'] or 0:>12,}",
        f"{'apply alone, events/CPU s':<40} {r['apply_events_per_s'] or 0:>12,}",
        f"{'apply alone, events/wall s':<40} {r['apply_events_per_wall_s'] or 0:>12,}",
        f"{'resident blocks at the end':<40} {r['resident_blocks']:>12,}",
        f"{'stats() at that size, CPU ms':<40} {r['stats_ms']:>12}",
    ]
    for m in report["memory"]:
        tenants = f"{m['tenants']} tenant{'s' if m['tenants'] > 1 else ''}"
        lines.append(f"{f'bytes/block (RSS), {tenants}':<40} {m['rss_bytes_per_block'] or 0:>12}")
        if m.get("traced_bytes_per_block") is not None:
            lines.append(f"{f'bytes/block (tracemalloc), {tenants}':<40} {m['traced_bytes_per_block']:>12}")
        label = f"stats() at {m['resident_blocks']:,} blocks, CPU ms"
        lines.append(f"{label:<40} {m['stats_ms']:>12}")
    if report["memory"]:
        blocks = report["memory"][0]["resident_blocks"]
        lines.append(f"(memory: {blocks:,} synthetic resident blocks in a fresh process; bytes per block = MB per "
                     "million blocks, the target is at most 300)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvops bench events", description=(
        "Replay recorded KV cache events at full speed into the resident-block index: events/s (decode + apply, "
        "and apply alone), stats() time, and memory per resident block."))
    parser.add_argument("--recording", action="append", metavar="PATH",
                        help="a .kvev recording, or a folder of them; repeatable (default: the recorded vLLM "
                             f"streams in {FIXTURES})")
    parser.add_argument("--repeat", type=int, default=100,
                        help="replays of the recordings, hashes renumbered each time so the index grows (default: 100)")
    parser.add_argument("--memory-blocks", type=int, default=1_000_000,
                        help="synthetic resident blocks for the memory measurement; 0 skips it (default: 1000000)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also count the memory with tracemalloc (exact live bytes, about five times slower)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.memory_blocks < 0:
        parser.error("--memory-blocks must be 0 (skip) or more")
    try:
        paths = recording_paths(args.recording)
        report = run(paths, args.repeat, args.memory_blocks, args.tracemalloc)
    except (RecordingError, OSError, ProbeError) as exc:
        print(f"kvops bench events: error: {exc}", file=sys.stderr)
        return 2
    report["command"] = "kvops bench events " + " ".join(sys.argv[3:] if argv is None else argv)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
