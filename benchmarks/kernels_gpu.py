"""GPU benchmark for the Triton kernels: correctness against the torch reference, then paged decode
attention's effective bandwidth against the device's copy bandwidth and against SDPA on contiguous KV.

    python benchmarks/kernels_gpu.py [--quick] [--json kernels_gpu.json] [--max-gib 48]

Effective bandwidth = the KV bytes a decode step must read (K and V of every context token, scales
included) / its time. The target is at least 70% of the measured copy bandwidth at long contexts.
Without a CUDA device (or without triton) it says so and exits 0, so it is safe to run anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvops import kernels
from kvops.kernels import reference
from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan

TARGET = 0.70  # of copy bandwidth, at contexts >= LONG
LONG = 32 * 1024
# A Llama-3-8B attention layer: 32 query heads over 8 KV heads of 128, bfloat16.
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


def _time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
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
    ms = _time_ms(lambda: buffers[1].copy_(buffers[0]), iters=10)
    buffers = buffers[:0]
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def _layer(kind: str, lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int = 0) -> tuple[kernels.KVCacheLayer, torch.Tensor]:
    """A cache holding the sequences on shuffled blocks, filled with random K/V; returns its block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lens]
    layer = kernels.allocate_kv_cache_layer(kind, sum(needed), block_size, kv_heads, head_dim, dtype)
    layer = kernels.KVCacheLayer(layer.kind, layer.dtype, layer.head_dim, *(
        t.cuda() if t is not None else None for t in (layer.data, layer.scale, layer.zero)), layer.group_size)
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


def _decode_meta(lens: list[int], tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    return AttentionMetadata(block_size, torch.zeros(len(lens), dtype=torch.long), len(lens), tables,
                             torch.tensor(lens))


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """fp8 as raw bytes, as the reference moves it: the kernel's write must produce the same bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _to_cpu(layer: kernels.KVCacheLayer) -> kernels.KVCacheLayer:
    return kernels.KVCacheLayer(layer.kind, layer.dtype, layer.head_dim, *(
        t.cpu() if t is not None else None for t in (layer.data, layer.scale, layer.zero)), layer.group_size)


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
            layer, tables = _layer(kind, lens, block_size, 2, head_dim, torch.float32)
            k = torch.randn(64, 2, head_dim, device="cuda") * 3
            slots = torch.randperm(layer.num_blocks * block_size, device="cuda")[:64]
            slots[::7] = -1
            ref_layer = _to_cpu(layer)
            kernels.write_kv_cache(k, k, layer, slots)
            reference.write_kv_cache(k.cpu(), k.cpu(), ref_layer, slots.cpu())
            diff = max(int((_comparable(a).cpu().int() != _comparable(b).int()).sum())
                       for a, b in zip(layer.per_slot(), ref_layer.per_slot(), strict=True))
            checks.append(Check("write_kv_cache", name, float(diff), diff == 0))
            # Decode and prefill, in float32 (exact dots) and bfloat16.
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 8e-2)):  # bf16: K, V and P rounded for the dots
                meta = _decode_meta(lens, tables, block_size)
                q = torch.randn(len(lens), 8, head_dim, device="cuda").to(dtype) / 4
                got = kernels.paged_decode_attention(q, layer, meta, head_dim**-0.5).float().cpu()
                cpu_meta = _decode_meta(lens, tables, block_size)
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
    layer, tables = _layer(kind, lens, block_size, KV_HEADS, HEAD_DIM, DTYPE)
    meta = _decode_meta(lens, tables, block_size)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    per_token = kernels.layer_bytes_per_token(kind, KV_HEADS, HEAD_DIM, DTYPE)
    kv_bytes = batch * context * per_token
    ms = _time_ms(lambda: kernels.paged_decode_attention(q, layer, meta, scale))
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    sdpa_ms = sdpa_gbs = None
    if kind == "auto":
        del layer
        torch.cuda.empty_cache()
        k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        q4 = q.unsqueeze(2)
        sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
        sdpa_gbs = kv_bytes / (sdpa_ms * 1e-3) / 1e9
        del k, v
    torch.cuda.empty_cache()
    return Row(kind, batch, context, round(kv_bytes / 2**30, 3), round(ms, 4), round(gbs, 1),
               round(gbs / copy_gbs, 3), None if sdpa_ms is None else round(sdpa_ms, 4),
               None if sdpa_gbs is None else round(sdpa_gbs, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", default="kernels_gpu.json", help="where to write the results")
    parser.add_argument("--max-gib", type=float, default=48.0, help="skip shapes whose KV exceeds this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing measured. Run it on a machine with a GPU.")
        return 0
    if not kernels.dispatch.triton_available():
        print("kernels_gpu: triton is not installed (pip install triton); nothing measured.")
        return 0
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}")
    checks = correctness()
    for c in checks:
        print(f"  {'ok ' if c.ok else 'BAD'} {c.op:24} {c.case:32} max err {c.max_abs_err:.2e}")
    failed = [c for c in checks if not c.ok]
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} ok")

    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    contexts = [1024, 8192, 32768, 131072] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072]
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 64]
    rows: list[Row] = []
    print(f"{'kind':5} {'batch':>5} {'context':>8} {'KV GiB':>7} {'ms':>8} {'GB/s':>7} {'of copy':>7} "
          f"{'SDPA ms':>8} {'SDPA GB/s':>9}")
    for kind in ("auto", "int8", "fp8", "int4"):
        for batch in batches if kind == "auto" else [16]:
            for context in contexts:
                gib = batch * context * kernels.layer_bytes_per_token(kind, KV_HEADS, HEAD_DIM, DTYPE) / 2**30
                if gib * (2 if kind == "auto" else 1) > args.max_gib:
                    continue
                row = decode_bandwidth(kind, batch, context, copy_gbs)
                rows.append(row)
                sdpa = f"{row.sdpa_ms:8.3f} {row.sdpa_gbs:9.0f}" if row.sdpa_ms is not None else ""
                print(f"{kind:5} {batch:5} {context:8} {row.kv_gib:7.2f} {row.kernel_ms:8.3f} {row.kernel_gbs:7.0f} "
                      f"{row.of_copy:7.0%} {sdpa}")
    long_rows = [r for r in rows if r.kind == "auto" and r.context >= LONG and r.batch * r.context >= 4 * LONG]
    best = max((r.of_copy for r in long_rows), default=0.0)
    met = bool(long_rows) and min(r.of_copy for r in long_rows) >= TARGET
    print(f"target: >= {TARGET:.0%} of copy bandwidth at long contexts: {'met' if met else 'NOT met'} "
          f"(best {best:.0%}, worst {min((r.of_copy for r in long_rows), default=0.0):.0%})")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs, "target_met": met,
                   "checks": [asdict(c) for c in checks], "decode": [asdict(r) for r in rows]}, f, indent=2)
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
