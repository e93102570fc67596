"""Decode attention over a shared prefix, read once for every sequence that shares it (CPU reference path).

With prefix caching, sequences that share a system prompt or a document point at the *same* physical
blocks for it. The plain decode path gathers each sequence's whole context and attends over its own copy,
so sixteen sequences behind a 600-token prefix copy and read that prefix sixteen times per layer per step.
Here attention is split in two (cascade attention, as in FlashInfer and vLLM's GPU backend):

1. the shared blocks are gathered once, and every query of the group attends over them in one call, the
   queries of a KV head stacked as the query length (a matmul over the prefix, not sixteen reads of it);
2. each sequence attends over its own remaining blocks as in the plain path;

and the two partial results are merged by their log-sum-exp, which gives the softmax over the whole
context exactly (up to float rounding). A step's metadata is planned once and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvops.kernels.attention_metadata import AttentionMetadata

# A group splits off only when it shares at least this many tokens: below it the extra call and the merge
# would outweigh the copies saved. A judgement, not a measured crossover: the shared cases of
# benchmarks/kernels_cpu.py (400 and 592 shared tokens) measure only well above it.
MIN_SHARED_TOKENS = 64


@dataclass
class CascadeGroup:
    """Decode rows sharing their first `shared_blocks` physical blocks; `suffix` is their remaining context."""

    rows: torch.Tensor  # int64 indices into the step's decode rows
    prefix_blocks: torch.Tensor  # [shared_blocks]
    suffix: AttentionMetadata  # the group's rows only, block tables shifted past the prefix


@dataclass
class CascadePlan:
    groups: list[CascadeGroup]
    plain: AttentionMetadata | None  # the rows that share nothing worth splitting off
    plain_rows: torch.Tensor | None


def _subset(meta: AttentionMetadata, rows: list[int], skip_blocks: int) -> AttentionMetadata:
    """Decode-only metadata for some rows, their block tables starting `skip_blocks` in (host tensors)."""
    host = meta.on_host
    index = torch.tensor(rows)
    lens = host.decode_context_lens[index] - skip_blocks * host.block_size
    tables = host.decode_block_tables[index, skip_blocks:]
    sub = AttentionMetadata(host.block_size, host.slot_mapping[:0], len(rows), tables, lens)
    return sub.to(meta.device)


def plan(meta: AttentionMetadata) -> CascadePlan | None:
    """Which decode rows share a prefix long enough to attend over once; None when none do."""
    if "cascade" in meta._cache:
        return meta._cache["cascade"]  # type: ignore[return-value]
    host = meta.on_host
    bs = host.block_size
    lens = host.decode_context_lens.tolist()
    tables = host.decode_block_tables
    by_first: dict[int, list[int]] = {}
    for row, length in enumerate(lens):
        if length > bs:  # a row whose context fits in one block has nothing to share and keep a suffix
            by_first.setdefault(int(tables[row, 0]), []).append(row)
    groups: list[CascadeGroup] = []
    grouped: set[int] = set()
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        # Leading blocks equal in every row, and each row keeps at least one token of its own after them
        # (the block being written this step is never shared).
        limit = (min(lens[r] for r in rows) - 1) // bs
        same = (tables[rows, :limit] == tables[rows[0], :limit]).all(0).tolist()
        shared = next((i for i, s in enumerate(same) if not s), limit)
        if shared * bs < MIN_SHARED_TOKENS:
            continue
        groups.append(CascadeGroup(torch.tensor(rows, device=meta.device),
                                   meta.decode_block_tables[rows[0], :shared], _subset(meta, rows, shared)))
        grouped.update(rows)
    result: CascadePlan | None = None
    if groups:
        rest = [r for r in range(len(lens)) if r not in grouped]
        result = CascadePlan(groups, _subset(meta, rest, 0) if rest else None,
                             torch.tensor(rest, device=meta.device) if rest else None)
    meta._cache["cascade"] = result
    return result


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, kv_heads, g, d] over k/v [n, kv_heads, len, d]: the output and its log-sum-exp [n, kv_heads, g]
    (the CPU flash kernel SDPA itself dispatches to, which returns both)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two softmax-weighted partial results over disjoint keys -> the result over all of them."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top).unsqueeze(-1), torch.exp(lse2 - top).unsqueeze(-1)
    return (o1 * w1 + o2 * w2) / (w1 + w2)
