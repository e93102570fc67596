"""The Triton kernels on a CUDA device: correctness against the torch reference, the device's copy bandwidth,
and paged decode attention's effective bandwidth (KV bytes read / time) against it and against SDPA on
contiguous KV. Shared by `benchmarks/kernels_gpu.py` (the full sweep) and `scripts/gpu-check` (a few shapes).

Everything here needs a CUDA device; nothing runs at import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvops import kernels
from kvops.kernels import reference
from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan

TARGET = 0.70  # of copy bandwidth, at contexts >= LONG
LONG = 32 * 1024
# A Llama-3-8B attention layer: 32 query heads over 8 KV heads of 128, bfloat16.
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


def time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs(gib: float = 4.0) -> float:
    """Device-to-device copy of a large buffer: bytes read + bytes written per second."""
    n = int(gib * 2**30)
    buffers = torch.empty(2, n, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: buffers[1].copy_(buffers[0]), iters=10)
    buffers = buffers[:0]
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def make_layer(kind: str, lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int = 0) -> tuple[kernels.KVCacheLayer, torch.Tensor]:
    """A cache holding the sequences on shuffled blocks, filled with random K/V; returns its block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lens]
    layer = kernels.allocate_kv_cache_layer(kind, sum(needed), block_size, kv_heads, head_dim, dtype, device="cuda")
    slots = layer.num_blocks * block_size
    chunk = 1 << 20
    for start in range(0, slots, chunk):  # written in chunks to bound the float staging buffers
        n = min(chunk, slots - start)
        kv = torch.randn(2, n, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
        kernels.write_kv_cache(kv[0], kv[1], layer, torch.arange(start, start + n, device="cuda"))
    perm = torch.randperm(layer.num_blocks, device="cuda", generator=g)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.long)
    offset = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[offset : offset + n].cpu()
        offset += n
    return layer, tables


def decode_meta(lens: list[int], tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    return AttentionMetadata(block_size, torch.zeros(len(lens), dtype=torch.long), len(lens), tables,
                             torch.tensor(lens))


def comparable_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as raw bytes, as the reference moves it: the kernel's write must produce the same bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def layer_to_cpu(layer: kernels.KVCacheLayer) -> kernels.KVCacheLayer:
    # replace() keeps every other field (an fp8 layer's calibration state among them) as it is.
    return dataclasses.replace(layer, data=layer.data.cpu(), scale=None if layer.scale is None else layer.scale.cpu(),
                               zero=None if layer.zero is None else layer.zero.cpu())


@dataclass
class Check:
    op: str
    case: str
    max_abs_err: float
    ok: bool


def correctness() -> list[Check]:
    """Each kernel against the torch reference (run on CPU copies of the same cache)."""
    checks = []
    for kind in ("auto", "int8", "fp8", "int4"):
        for head_dim, block_size in ((64, 16), (96, 1), (128, 128), (80, 5)):
            if kind == "int4" and head_dim % 32:
                continue
            name = f"{kind} d={head_dim} bs={block_size}"
            lens = [1, 37, 300, 1000]
            # The write: the same K/V through the kernel and through the reference, bytes compared.
            layer, tables = make_layer(kind, lens, block_size, 2, head_dim, torch.float32)
            k = torch.randn(64, 2, head_dim, device="cuda") * 3
            slots = torch.randperm(layer.num_blocks * block_size, device="cuda")[:64]
            slots[::7] = -1
            ref_layer = layer_to_cpu(layer)
            kernels.write_kv_cache(k, k, layer, slots)
            reference.write_kv_cache(k.cpu(), k.cpu(), ref_layer, slots.cpu())
            diff = max(int((comparable_bytes(a).cpu().int() != comparable_bytes(b).int()).sum())
                       for a, b in zip(layer.per_slot(), ref_layer.per_slot(), strict=True))
            checks.append(Check("write_kv_cache", name, float(diff), diff == 0))
            # Decode and prefill, in float32 (exact dots) and bfloat16.
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 8e-2)):  # bf16: K, V and P rounded for the dots
                meta = decode_meta(lens, tables, block_size)
                q = torch.randn(len(lens), 8, head_dim, device="cuda").to(dtype) / 4
                got = kernels.paged_decode_attention(q, layer, meta, head_dim**-0.5).float().cpu()
                cpu_meta = decode_meta(lens, tables, block_size)
                want = reference.paged_decode_attention(q.float().cpu(), ref_layer, cpu_meta, head_dim**-0.5)
                err = float((got - want).abs().max())
                checks.append(Check("paged_decode_attention", f"{name} {str(dtype)[6:]}", err, err <= tol))
                spans, flat = [], 0
                for i, (n, prefix) in enumerate(((37, 0), (17, 283), (100, 900))):
                    used = math.ceil((n + prefix) / block_size)
                    spans.append(PrefillSpan(flat, flat + n, n + prefix, tables[i + 1, :used]))
                    flat += n
                meta = AttentionMetadata(block_size, torch.zeros(flat, dtype=torch.long), 0, tables[:0], tables[:0, 0],
                                         spans)
                q = torch.randn(flat, 8, head_dim, device="cuda").to(dtype) / 4
                got = kernels.paged_prefill_attention(q, layer, meta, head_dim**-0.5).float().cpu()
                meta._cache.clear()
                want = reference.paged_prefill_attention(q.float().cpu(), ref_layer, meta, head_dim**-0.5)
                err = float((got - want).abs().max())
                checks.append(Check("paged_prefill_attention", f"{name} {str(dtype)[6:]}", err, err <= tol))
            del layer, ref_layer
    return checks


@dataclass
class Row:
    kind: str
    batch: int
    context: int
    kv_gib: float
    kernel_ms: float
    kernel_gbs: float
    of_copy: float  # kernel bandwidth / copy bandwidth
    sdpa_ms: float | None  # SDPA on contiguous K/V (auto only)
    sdpa_gbs: float | None


def decode_bandwidth(kind: str, batch: int, context: int, copy_gbs: float) -> Row:
    block_size = 16
    lens = [context] * batch
    layer, tables = make_layer(kind, lens, block_size, KV_HEADS, HEAD_DIM, DTYPE)
    meta = decode_meta(lens, tables, block_size)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    per_token = kernels.layer_bytes_per_token(kind, KV_HEADS, HEAD_DIM, DTYPE)
    kv_bytes = batch * context * per_token
    ms = time_ms(lambda: kernels.paged_decode_attention(q, layer, meta, scale))
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    sdpa_ms = sdpa_gbs = None
    if kind == "auto":
        del layer
        torch.cuda.empty_cache()
        k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        q4 = q.unsqueeze(2)
        sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
        sdpa_gbs = kv_bytes / (sdpa_ms * 1e-3) / 1e9
        del k, v
    torch.cuda.empty_cache()
    return Row(kind, batch, context, round(kv_bytes / 2**30, 3), round(ms, 4), round(gbs, 1),
               round(gbs / copy_gbs, 3), None if sdpa_ms is None else round(sdpa_ms, 4),
               None if sdpa_gbs is None else round(sdpa_gbs, 1))


def kv_gib(kind: str, batch: int, context: int) -> float:
    """The KV bytes one decode step of `batch` sequences of `context` tokens reads, in GiB."""
    return batch * context * kernels.layer_bytes_per_token(kind, KV_HEADS, HEAD_DIM, DTYPE) / 2**30


@dataclass
class Verdict:
    met: bool  # every long-context row reaches TARGET of the copy bandwidth
    best: float
    worst: float
    rows: int  # how many rows count as long context


def long_context_verdict(rows: list[Row]) -> Verdict:
    """The target at long contexts: unquantized rows of at least LONG tokens and 4 * LONG tokens in all."""
    long_rows = [r.of_copy for r in rows if r.kind == "auto" and r.context >= LONG and r.batch * r.context >= 4 * LONG]
    if not long_rows:
        return Verdict(False, 0.0, 0.0, 0)
    return Verdict(min(long_rows) >= TARGET, max(long_rows), min(long_rows), len(long_rows))
