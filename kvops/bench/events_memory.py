"""`kvops bench events`'s memory measure: a ResidentIndex filled with synthetic resident blocks in a fresh
process, its RSS growth (and, asked for, tracemalloc's count of live bytes) over the blocks, and stats() timed
on it.

The blocks are as a large GPU pool holds them: 32-byte hashes, 16-token blocks, prompts of 64 blocks in groups of
eight that share their first 32 (a system prompt: a branch point for stats()'s shared prefixes). With two
tenants the groups alternate between two cache salts, which turns on the cross-tenant duplicate table.
A fresh process, because RSS only tells what a process holds: memory that an earlier phase freed would be
reused and hide the index's own.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

from kvops.events import wire
from kvops.events.index import PREFIX_REFRESH_S, ResidentIndex
from kvops.schema.kv_events import EventStreamHealth

BLOCK_TOKENS = 16
SHARED_BLOCKS = 32  # a group's shared system prompt
OWN_BLOCKS = 32  # each prompt's own blocks after it
GROUP = 8  # prompts a group
PER_BATCH = 8  # stores a batch


class ProbeError(RuntimeError):
    """The memory probe's process failed."""


def synthetic_batches(blocks: int, tenants: int) -> Iterator[wire.DecodedBatch]:
    """Batches storing `blocks` blocks (see the module's docstring), yielded one at a time so that only the
    index stays in memory."""
    counter = 0
    stored = 0
    events: list[wire.Event] = []
    group = 0
    while stored < blocks:
        salt = f"tenant-{group % tenants}" if tenants > 1 else None
        count = min(SHARED_BLOCKS, blocks - stored)
        shared = [(counter + i).to_bytes(32, "big") for i in range(count)]
        counter += count
        tokens = [(group * 7919 + k) % 50_000 for k in range(count * BLOCK_TOKENS)]
        events.append(wire.BlockStored(block_hashes=shared, parent_block_hash=None, token_ids=tokens,
                                       block_size=BLOCK_TOKENS, medium="GPU",
                                       extra_keys=[[salt]] + [None] * (count - 1) if salt else None))
        stored += count
        for prompt in range(GROUP):
            count = min(OWN_BLOCKS, blocks - stored)
            if count <= 0:
                break
            own = [(counter + i).to_bytes(32, "big") for i in range(count)]
            counter += count
            tokens = [(group * 104_729 + prompt * 7919 + k) % 50_000 for k in range(count * BLOCK_TOKENS)]
            events.append(wire.BlockStored(block_hashes=own, parent_block_hash=shared[-1], token_ids=tokens,
                                           block_size=BLOCK_TOKENS, medium="GPU"))
            stored += count
            if len(events) >= PER_BATCH:
                yield wire.DecodedBatch(1_000_000.0 + group, events, None)
                events = []
        group += 1
    if events:
        yield wire.DecodedBatch(1_000_000.0 + group, events, None)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_probe(blocks: int, tenants: int, traced: bool = False) -> dict[str, Any]:
    """Fill an index in this process and measure it (meant for a fresh process: probe_in_child)."""
    gc.collect()
    if traced:
        tracemalloc.start()
    before_rss = _rss()
    before_traced = tracemalloc.get_traced_memory()[0] if traced else 0
    index = ResidentIndex()
    for batch in synthetic_batches(blocks, tenants):
        index.apply(batch)
    gc.collect()
    grown = _rss() - before_rss
    held = tracemalloc.get_traced_memory()[0] - before_traced if traced else None
    if traced:
        tracemalloc.stop()
    resident = index.resident_blocks
    health = EventStreamHealth(endpoint="synthetic")
    timings = []
    for round_ in range(3):
        # A new batch, and past the shared prefixes' refresh: each stats() does all its work.
        now = 2_000_000.0 + round_ * PREFIX_REFRESH_S
        index.apply(wire.DecodedBatch(now, [], None))
        started = time.thread_time()
        index.stats(now, health)
        timings.append(time.thread_time() - started)
    return {"tenants": tenants, "resident_blocks": resident, "rss_bytes": grown,
            "rss_bytes_per_block": round(grown / resident, 1) if resident else None,
            "traced_bytes_per_block": round(held / resident, 1) if resident and held is not None else None,
            "stats_ms": round(statistics.median(timings) * 1000, 2)}


def probe_in_child(blocks: int, tenants: int, traced: bool = False) -> dict[str, Any]:
    code = ("import json; from kvops.bench.events_memory import memory_probe; "
            f"print(json.dumps(memory_probe({int(blocks)}, {int(tenants)}, {bool(traced)})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"the memory probe ({blocks} blocks) took over 30 minutes: "
                         "try fewer --memory-blocks") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ProbeError(f"the memory probe ({blocks} blocks, {tenants} tenants) failed with exit code "
                         f"{done.returncode}: {' / '.join(tail)} (try fewer --memory-blocks)")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
