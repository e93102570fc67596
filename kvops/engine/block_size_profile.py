"""Which block size decodes fastest for this model and this workload, measured on demand.

Rules of thumb ("16 for chat, 32 for long documents") ignore the model, the hardware and the
lengths actually served. Here each candidate block size runs the same decode step: the engine's
model, its KV dtypes, a batch as large as it has been running, at context lengths drawn from the
prompts it has recently served. K/V live in a private cache (the serving pool is not touched)
filled with random values: attention cost does not depend on what the values are.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvops import kernels
from kvops.engine.errors import InvalidRequestError
from kvops.kernels import AttentionMetadata, KVCacheLayer
from kvops.schema.reports import BlockSizeProfile, BlockSizeTiming

if TYPE_CHECKING:
    from kvops.engine.engine import LLMEngine

DEFAULT_CANDIDATES = (8, 16, 32, 64)
MAX_CANDIDATES = 8
MAX_REPEATS = 50
# Prompt lengths to measure at before the engine has served anything: chat turns to a document. Not round
# numbers, which would fill every power-of-two block exactly and hide fragmentation.
DEFAULT_PROMPT_LENS = (40, 100, 300, 900)
DEFAULT_GENERATED_TOKENS = 64
_FILL_CHUNK = 8192  # tokens of random K/V generated at a time: bounds the fill's scratch memory
_SEED = 0


@dataclasses.dataclass
class _Workload:
    context_lens: list[int]
    lengths_from: str  # recent | default
    generated_tokens: int


def fragmentation(context_lens: Sequence[int], block_size: int) -> float:
    """Share of allocated slots left empty when each sequence holds whole blocks: 1 - used / allocated."""
    allocated = _slots_needed(context_lens, block_size)
    return 1 - sum(context_lens) / allocated if allocated else 0.0


def _spread(values: Sequence[int], count: int) -> list[int]:
    """`count` values at evenly spaced quantiles of `values`: the distribution's shape without the noise
    (and the same draw every time, so two profiles of one workload are comparable)."""
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / count))] for i in range(count)]


def _iqr(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")  # within the samples, even for few
    return high - low


def _slots_needed(context_lens: Sequence[int], block_size: int) -> int:
    return sum(-(-length // block_size) * block_size for length in context_lens)


def _workload(engine: LLMEngine, sizes: Sequence[int], batch_size: int | None,
              max_context: int) -> tuple[int, _Workload]:
    stats = engine.stats
    recent = stats.recent_prompt_lengths()
    if recent:
        lengths_from = "recent"
        # Lifetime, not recent: output lengths are counted only as totals. Requests still running count as
        # admitted with part of their output, which leans short.
        generated = round(stats.generation_tokens_total / stats.prompt_length_count)
    else:
        lengths_from, recent, generated = "default", list(DEFAULT_PROMPT_LENS), DEFAULT_GENERATED_TOKENS
    max_num_seqs = engine.config.max_num_seqs
    samples = [step.num_seqs for step in stats.steps]
    if batch_size is not None:
        batch = batch_size
    elif samples:
        batch = min(max_num_seqs, max(1, round(statistics.fmean(samples))))
    else:
        # Nothing has run: measure the whole default set at once rather than one sequence, whose step
        # is all weight matmuls and would hide the block size.
        batch = min(max_num_seqs, len(DEFAULT_PROMPT_LENS))

    def draw(count: int) -> list[int]:
        return [min(max_context, length + generated) for length in _spread(recent, count)]

    # A batch whose blocks do not fit the serving pool never runs at once, and would make this profile
    # allocate more than the pool itself: a default batch shrinks to fit, an asked-for one is refused.
    pool_tokens = engine.capacity.tokens
    largest = max(sizes)  # pads the most
    lens = draw(batch)
    while _slots_needed(lens, largest) > pool_tokens and batch > 1 and batch_size is None:
        batch -= 1
        lens = draw(batch)
    needed = _slots_needed(lens, largest)
    if needed > pool_tokens:
        raise InvalidRequestError(
            f"batch_size {batch} at context lengths {lens} needs {needed} slots of KV at block size {largest}, "
            f"more than the serving pool's {pool_tokens}: ask for a smaller batch_size, max_context or block size",
            "batch_size")
    return batch, _Workload(lens, lengths_from, generated)


def _blocked(base: KVCacheLayer, block_size: int, num_blocks: int) -> KVCacheLayer:
    """`base` (block size 1) seen as `num_blocks` blocks of `block_size`: the same memory, another layout."""

    def view(t: torch.Tensor) -> torch.Tensor:
        return t[:, : num_blocks * block_size].view(2, num_blocks, block_size, *t.shape[3:])

    per_slot_scales = base.kind in ("int8", "int4")  # fp8's scale is per layer, not per slot
    return dataclasses.replace(base, data=view(base.data),
                               scale=view(base.scale) if per_slot_scales and base.scale is not None else base.scale,
                               zero=view(base.zero) if base.zero is not None else None)


@dataclasses.dataclass
class _Candidate:
    block_size: int
    cache: list[KVCacheLayer]
    tables: list[list[int]]  # padded with 0 to the widest, as the engine's step pads them
    slots: list[int]  # where each sequence's new token goes
    times: list[float] = dataclasses.field(default_factory=list)


def _candidate(base: list[KVCacheLayer], block_size: int, context_lens: list[int],
               generator: torch.Generator) -> _Candidate:
    per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(per_seq)
    # A pool that has served a while hands out scattered blocks; contiguous tables would flatter the
    # gather with a locality that serving never has.
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in per_seq:
        tables.append(order[start : start + count])
        start += count
    width = max(per_seq)
    slots = [table[(length - 1) // block_size] * block_size + (length - 1) % block_size
             for table, length in zip(tables, context_lens, strict=True)]
    return _Candidate(block_size, [_blocked(layer, block_size, num_blocks) for layer in base],
                      [table + [0] * (width - len(table)) for table in tables], slots)


def _fill(engine: LLMEngine, base: list[KVCacheLayer], num_slots: int, generator: torch.Generator) -> None:
    model = engine.model
    for start in range(0, num_slots, _FILL_CHUNK):
        end = min(num_slots, start + _FILL_CHUNK)
        shape = (end - start, model.num_kv_heads, model.head_dim)
        k = torch.randn(shape, generator=generator).to(engine.device, engine.dtype)
        v = torch.randn(shape, generator=generator).to(engine.device, engine.dtype)
        slots = torch.arange(start, end, device=engine.device)
        for layer in base:  # every layer the same values: only the cost is measured
            kernels.write_kv_cache(k, v, layer, slots)


def _decode_step(engine: LLMEngine, candidate: _Candidate, input_ids: torch.Tensor, positions: torch.Tensor,
                 context_lens: list[int]) -> float:
    """Seconds for one decode step: the block tables to tensors (as the engine's step builds them, a cost
    that grows with blocks per sequence) and the forward pass."""
    started = time.perf_counter()
    meta = AttentionMetadata(
        block_size=candidate.block_size,
        slot_mapping=torch.tensor(candidate.slots, dtype=torch.long),
        num_decode_tokens=len(context_lens),
        decode_block_tables=torch.tensor(candidate.tables, dtype=torch.long),
        decode_context_lens=torch.tensor(context_lens, dtype=torch.long),
    )
    engine.model.forward(input_ids, positions, meta, candidate.cache, torch.arange(len(context_lens)))
    if candidate.cache[0].data.is_cuda:  # kernels run asynchronously there: wait for them before reading the clock
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _check(engine: LLMEngine, candidates: Sequence[int], batch_size: int | None, repeats: int,
           max_context: int | None) -> list[int]:
    sizes = sorted(set(candidates))
    if not sizes:
        raise InvalidRequestError("candidates is empty: give at least one block size, e.g. 8,16,32", "candidates")
    if len(sizes) > MAX_CANDIDATES:
        raise InvalidRequestError(f"{len(sizes)} candidates given: profile at most {MAX_CANDIDATES} block sizes "
                                  "at a time", "candidates")
    bad = [size for size in sizes if not 1 <= size <= engine.max_model_len]
    if bad:
        raise InvalidRequestError(f"block size {bad[0]} is out of range: candidates must be between 1 and "
                                  f"max_model_len {engine.max_model_len}", "candidates")
    if not 1 <= repeats <= MAX_REPEATS:
        raise InvalidRequestError(f"repeats {repeats} is out of range: use 1 to {MAX_REPEATS}", "repeats")
    if batch_size is not None and not 1 <= batch_size <= engine.config.max_num_seqs:
        raise InvalidRequestError(f"batch_size {batch_size} is out of range: use 1 to max_num_seqs "
                                  f"{engine.config.max_num_seqs}", "batch_size")
    if max_context is not None and max_context < 1:
        raise InvalidRequestError(f"max_context {max_context} must be at least 1", "max_context")
    return sizes


def profile_block_size(
    engine: LLMEngine,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    batch_size: int | None = None,
    repeats: int = 5,
    max_context: int | None = None,
) -> BlockSizeProfile:
    """Median decode-step time of each candidate block size at the engine's recent batch size and lengths.

    Runs on the caller's thread (the server runs it on the step loop, so serving pauses meanwhile).
    """
    started = time.perf_counter()
    # The configured size is always measured: it is what every other candidate is compared with.
    sizes = _check(engine, sorted({*candidates, engine.config.block_size}), batch_size, repeats, max_context)
    cap = min(engine.max_model_len, max_context or engine.max_model_len)
    batch, workload = _workload(engine, sizes, batch_size, cap)
    lens = workload.context_lens

    # Private RNG: the global one may drive sampling of requests without a seed.
    generator = torch.Generator().manual_seed(_SEED)
    # One cache at block size 1, viewed at each candidate's block size: all candidates stay alive for
    # the interleaved timing at the memory of one, and read the same memory.
    num_slots = max(_slots_needed(lens, size) for size in sizes)
    group = engine.config.kv_cache_group_size
    model = engine.model
    base = [kernels.allocate_kv_cache_layer(kind, num_slots, 1, model.num_kv_heads, model.head_dim, engine.dtype,
                                            group, engine.device) for kind in engine.kv_pool.layer_dtypes]
    _fill(engine, base, num_slots, generator)
    runs = [_candidate(base, size, lens, generator) for size in sizes]
    input_ids = torch.randint(0, engine.vocab_size, (batch,), generator=generator)
    positions = torch.tensor([length - 1 for length in lens], dtype=torch.long)

    for run in runs:  # warm-up: first-call allocations and lazy initialization are not the block size's doing
        _decode_step(engine, run, input_ids, positions, lens)
    # Round-robin, starting one further along each round, so load that comes and goes (other processes,
    # frequency scaling) falls on every candidate alike instead of on whichever ran during it.
    for round_ in range(repeats):
        for i in range(len(runs)):
            run = runs[(round_ + i) % len(runs)]
            run.times.append(_decode_step(engine, run, input_ids, positions, lens))

    medians = {run.block_size: statistics.median(run.times) for run in runs}
    best = min(sizes, key=lambda size: medians[size])
    timings = [BlockSizeTiming(block_size=run.block_size, decode_step_ms=round(medians[run.block_size] * 1000, 4),
                               relative=round(medians[run.block_size] / medians[best], 4),
                               fragmentation=round(fragmentation(lens, run.block_size), 6),
                               iqr_ms=round(_iqr(run.times) * 1000, 4)) for run in runs]
    return BlockSizeProfile(configured=engine.config.block_size, best=best, candidates=timings, context_lens=lens,
                            batch_size=batch, repeats=repeats, measured_at=time.time(),
                            duration_s=round(time.perf_counter() - started, 3),
                            lengths_from=workload.lengths_from, generated_tokens=workload.generated_tokens)
