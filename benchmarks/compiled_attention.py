"""Decode attention, compiled (in place) against the torch reference (gather, then SDPA; cascade for shared prefixes).

`python benchmarks/compiled_attention.py` times one layer's decode attention of SmolLM2-135M's shape (9 query heads,
3 KV heads, head_dim 64, fp32, 16-token blocks) for a few batches: one stream, 16 chats, 16 long contexts, and 16
rows sharing a long prefix (where the reference reads the prefix once for all rows, kvops/kernels/cascade_attention.py).
Prints the median time of each and the ratio. docs/benchmarks.md records a run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvops.engine.compiled import compile_step
from kvops.kernels import AttentionMetadata, KVCacheLayer, allocate_kv_cache_layer, reference

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16
SHAPES = {  # name: (rows, context tokens each, shared prefix tokens)
    "one stream, 300 tokens": (1, 300, 0),
    "one stream, 1500 tokens": (1, 1500, 0),
    "16 chats, 100-200 tokens": (16, 150, 0),
    "16 rows, 1000 tokens each": (16, 1000, 0),
    "16 rows, 1000-token shared prefix": (16, 1050, 1000),
}


def _batch(rows: int, context: int, shared: int) -> tuple[torch.Tensor, AttentionMetadata, KVCacheLayer]:
    generator = torch.Generator().manual_seed(0)
    width = -(-(context + 50) // BS)  # the longest row: context + 49
    blocks = rows * width + 8
    layer = allocate_kv_cache_layer("auto", blocks, BS, KV_HEADS, D, torch.float32)
    layer.data.copy_(torch.randn(layer.data.shape, generator=generator))
    order = torch.randperm(blocks, generator=generator)
    tables = order[: rows * width].view(rows, width).clone()
    tables[:, : shared // BS] = tables[0, : shared // BS]  # the shared prefix's blocks, the same in every row
    lens = torch.tensor([context + (i * 7) % 50 for i in range(rows)])
    q = torch.randn(rows, HEADS, D, generator=generator)
    return q, AttentionMetadata(BS, torch.zeros(rows, dtype=torch.long), rows, tables, lens), layer


def _median_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def compare(ops: Any, rows: int, context: int, shared: int) -> tuple[float, float]:
    """Median ms of the reference and of the compiled decode attention over one batch."""
    q, meta, layer = _batch(rows, context, shared)
    scale = D**-0.5
    # the reference plans its buckets and cascade once a step and reuses the plan in every layer: kept here
    ref = _median_ms(lambda: reference.paged_decode_attention(q, layer, meta, scale))
    compiled = _median_ms(lambda: ops.paged_decode(q, layer.data, meta.decode_block_tables, meta.decode_context_lens,
                                                    scale))
    return ref, compiled


def main() -> None:
    ops = compile_step("on", torch.device("cpu"), "torch").ops
    print(f"torch threads {torch.get_num_threads()}")
    print("| batch | reference ms | compiled ms | reference / compiled |\n|---|---:|---:|---:|")
    for name, shape in SHAPES.items():
        ref, compiled = compare(ops, *shape)
        print(f"| {name} | {ref:.3f} | {compiled:.3f} | {ref / compiled:.2f} |")


if __name__ == "__main__":
    main()
