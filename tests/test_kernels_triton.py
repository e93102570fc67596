"""Every Triton kernel against its torch reference, run on CPU in triton's interpreter.

Shapes are small (the interpreter runs each program in numpy) but cover what the kernels special-case:
block sizes 1 to 128, GQA ratios, ragged lengths, split-K with empty splits, quantized KV and head dims
that are not a power of two. The cache write must produce the reference's bytes exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvops import kernels
from kvops.kernels import reference
from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan
from kvops.kernels.kv_cache import fixed_fp8_scale

pytest.importorskip("triton")

# Triton reads TRITON_INTERPRET when it is imported (its own tl.max etc. are jit functions) and when a
# kernel is defined, so the interpreter cannot be switched on inside a session that may already have
# imported triton. Unless the variable was set from the start, these tests run in a child pytest that
# has it from the start, and this session only sees that one outcome.
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {"auto": 2e-5, "int8": 2e-5, "fp8": 2e-5, "int4": 2e-5}  # same dequantized K/V: fp32 rounding only


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter session")
def test_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary


needs_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.fixture(scope="module", autouse=True)
def interpreted() -> Iterator[ModuleType | None]:
    if not IN_INTERPRETER:
        yield None
        return
    from kvops.kernels import triton_attention, triton_common

    assert triton_common.INTERPRETED
    with kernels.use_backend("triton"):
        yield triton_attention


def _randn(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :4] *= 8  # a few large channels, as real keys have: stresses the per-token / per-group scales
    return x


def _filled(kind: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, group: int = 32,
            seed: int = 0, writer: Callable[..., None] = reference.write_kv_cache) -> kernels.KVCacheLayer:
    """A cache with every slot written (in a shuffled order) from seeded K/V by `writer`."""
    layer = kernels.allocate_kv_cache_layer(kind, num_blocks, block_size, kv_heads, head_dim, torch.float32, group)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(seed))
    k = _randn(slots.numel(), kv_heads, head_dim, seed=seed)
    v = _randn(slots.numel(), kv_heads, head_dim, seed=seed + 1)
    writer(k, v, layer, slots)
    return layer


def _assert_same_bytes(a: kernels.KVCacheLayer, b: kernels.KVCacheLayer) -> None:
    for x, y in zip(a.per_slot(), b.per_slot(), strict=True):
        x, y = reference._bits(x), reference._bits(y)
        assert torch.equal(x, y), f"{(x != y).sum()} of {x.numel()} entries differ"


@needs_interpreter
@pytest.mark.parametrize(
    ("kind", "head_dim", "block_size", "group"),
    [("auto", 64, 16, 32), ("auto", 80, 1, 32), ("int8", 96, 4, 32), ("int8", 80, 16, 32),
     ("fp8", 64, 8, 32), ("fp8", 80, 3, 32), ("int4", 64, 16, 32), ("int4", 64, 2, 64), ("int4", 96, 16, 32)],
)
def test_cache_write_stores_exactly_the_reference_bytes(kind: str, head_dim: int, block_size: int, group: int):
    num_blocks = max(1, 16 // block_size)
    expected = _filled(kind, num_blocks, block_size, 2, head_dim, group)
    got = _filled(kind, num_blocks, block_size, 2, head_dim, group, writer=kernels.write_kv_cache)
    _assert_same_bytes(expected, got)


@needs_interpreter
def test_cache_write_skips_negative_slots():
    layer = kernels.allocate_kv_cache_layer("int8", 4, 4, 2, 64, torch.float32)
    before = [t.clone() for t in layer.per_slot()]
    k = _randn(5, 2, 64, seed=3)
    kernels.write_kv_cache(k, k, layer, torch.tensor([-1, 6, -1, -1, 2]))
    changed = (layer.data != before[0]).view(2, 16, -1).any(-1).any(0)  # per slot
    assert changed.nonzero().flatten().tolist() == [2, 6]
    assert torch.equal(kernels.gather_kv(layer, torch.tensor([6, 2])),
                       reference.dequantize_kv(layer, reference.quantize_kv(layer, torch.stack((k, k))[:, [1, 4]])))


@needs_interpreter
def test_fp8_encoding_matches_torch_for_every_code_and_every_tie():
    """Every finite e4m3 value, the midpoints between neighbours (ties round to even), values just off
    them, and values beyond ±448 (saturate): the kernel's integer encoder must agree with torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                        torch.tensor([500.0, -1e4, 449.0, 1e-12, -0.0])])
    probes = torch.cat([probes, torch.zeros(-probes.numel() % 64)]).view(-1, 1, 64)
    with fixed_fp8_scale(1.0):  # every code at its own value: a calibrated scale would move the probes off them
        ref_layer = kernels.allocate_kv_cache_layer("fp8", probes.shape[0], 1, 1, 64, torch.float32)
        tri_layer = kernels.allocate_kv_cache_layer("fp8", probes.shape[0], 1, 1, 64, torch.float32)
    slots = torch.arange(probes.shape[0])
    reference.write_kv_cache(probes, probes, ref_layer, slots)
    kernels.write_kv_cache(probes, probes, tri_layer, slots)
    _assert_same_bytes(ref_layer, tri_layer)


def _decode_meta(lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Ragged sequences on scattered, non-overlapping blocks, tables padded with 0 as the engine does."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    needed = [-(-n // block_size) for n in lens]
    width = max(needed)
    tables, start = torch.zeros(len(lens), width, dtype=torch.long), 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start : start + n]
        start += n
    assert start <= num_blocks
    return AttentionMetadata(block_size, torch.zeros(len(lens), dtype=torch.long), len(lens), tables,
                             torch.tensor(lens))


DECODE_CASES = [
    # kind, block_size, heads, kv_heads, head_dim, lens, num_splits (None: the heuristic)
    ("auto", 16, 4, 4, 64, [1, 17, 40, 33], None),  # MHA, one-token context
    ("auto", 1, 6, 2, 64, [9, 23], None),  # block size 1
    ("auto", 128, 8, 1, 32, [300, 70], 4),  # MQA, one block holds the whole context; the short row has empty splits
    ("auto", 5, 9, 3, 80, [31, 12, 64], 3),  # SmolLM's 3:1 GQA, odd block size and head dim
    ("int8", 16, 8, 2, 96, [50, 7], 2),
    ("fp8", 8, 4, 2, 64, [45, 16, 3], None),
    ("int4", 16, 6, 2, 64, [38, 21], 2),
    ("int4", 4, 4, 1, 96, [29], None),
]


@needs_interpreter
@pytest.mark.parametrize(("kind", "block_size", "heads", "kv_heads", "head_dim", "lens", "splits"), DECODE_CASES)
def test_paged_decode_attention_matches_the_reference(interpreted: ModuleType, kind: str, block_size: int,
                                                      heads: int, kv_heads: int, head_dim: int, lens: list[int],
                                                      splits: int | None):
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    layer = _filled(kind, num_blocks, block_size, kv_heads, head_dim, seed=len(lens))
    meta = _decode_meta(lens, block_size, num_blocks, seed=block_size)
    q = _randn(len(lens), heads, head_dim, seed=7) / 4
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(q, layer, meta, scale)
    got = interpreted.paged_decode_attention(q, layer, meta, scale, num_splits=splits)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[kind], rtol=1e-4)
    if splits is not None:  # one split (no merge) agrees too
        torch.testing.assert_close(interpreted.paged_decode_attention(q, layer, meta, scale, num_splits=1), expected,
                                   atol=TOLERANCE[kind], rtol=1e-4)


@needs_interpreter
def test_decode_in_bfloat16_stays_within_bfloat16_error():
    layer = kernels.allocate_kv_cache_layer("auto", 12, 8, 2, 64, torch.bfloat16)
    slots = torch.arange(96)
    reference.write_kv_cache(_randn(96, 2, 64, seed=1), _randn(96, 2, 64, seed=2), layer, slots)
    meta = _decode_meta([60, 25], 8, 12, seed=0)
    q = (_randn(2, 8, 64, seed=3) / 4).to(torch.bfloat16)
    expected = reference.paged_decode_attention(q.float(), _as_float(layer), meta, 0.125)
    got = kernels.paged_decode_attention(q, layer, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def _as_float(layer: kernels.KVCacheLayer) -> kernels.KVCacheLayer:
    return kernels.KVCacheLayer("auto", torch.float32, layer.head_dim, layer.data.float())


PREFILL_CASES = [
    # kind, block_size, heads, kv_heads, head_dim, spans as (new tokens, cached prefix)
    ("auto", 16, 4, 2, 64, [(21, 0)]),  # plain causal prefill
    ("auto", 4, 6, 2, 80, [(7, 5), (19, 0), (3, 30)]),  # prefix-cache hits and a chunk, ragged
    ("auto", 1, 4, 4, 32, [(5, 11)]),
    ("int8", 16, 8, 2, 64, [(18, 20), (6, 0)]),
    ("fp8", 128, 4, 1, 96, [(12, 40)]),
    ("int4", 8, 4, 2, 64, [(9, 14), (17, 0)]),
]


@needs_interpreter
@pytest.mark.parametrize(("kind", "block_size", "heads", "kv_heads", "head_dim", "spans"), PREFILL_CASES)
def test_paged_prefill_attention_matches_the_reference(kind: str, block_size: int, heads: int, kv_heads: int,
                                                       head_dim: int, spans: list[tuple[int, int]]):
    lens = [n + prefix for n, prefix in spans]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    layer = _filled(kind, num_blocks, block_size, kv_heads, head_dim, seed=3)
    tables = _decode_meta(lens, block_size, num_blocks, seed=5).decode_block_tables
    num_decodes = 2  # decode tokens come first in the flat batch: the prefill q is offset by them
    flat, prefill_spans = num_decodes, []
    for i, (n, _) in enumerate(spans):
        used = -(-lens[i] // block_size)
        prefill_spans.append(PrefillSpan(flat, flat + n, lens[i], tables[i, :used]))
        flat += n
    meta = AttentionMetadata(block_size, torch.zeros(flat, dtype=torch.long), num_decodes, tables[:num_decodes],
                             torch.tensor(lens[:1] * num_decodes), prefill_spans)
    q = _randn(flat - num_decodes, heads, head_dim, seed=11) / 4
    scale = head_dim**-0.5
    expected = reference.paged_prefill_attention(q, layer, meta, scale)
    got = kernels.paged_prefill_attention(q, layer, meta, scale)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[kind], rtol=1e-4)


@needs_interpreter
def test_chunked_prefill_then_decode_through_the_kernels_equals_one_pass():
    """The engine's use: write K/V, then attend. Prefill 24 tokens in chunks of 10/10/4 with the Triton
    write + prefill kernels, then one decode step; the outputs equal a one-pass reference."""
    heads, kv_heads, d, bs = 4, 2, 64, 4
    k, v, q = _randn(25, kv_heads, d, seed=1), _randn(25, kv_heads, d, seed=2), _randn(25, heads, d, seed=3) / 4
    table = torch.tensor([5, 2, 7, 0, 3, 6, 1])
    slots = table[torch.arange(25) // bs] * bs + torch.arange(25) % bs
    tri = kernels.allocate_kv_cache_layer("int8", 8, bs, kv_heads, d, torch.float32)
    ref = kernels.allocate_kv_cache_layer("int8", 8, bs, kv_heads, d, torch.float32)
    outputs = []
    for start, end in ((0, 10), (10, 20), (20, 24)):
        kernels.write_kv_cache(k[start:end], v[start:end], tri, slots[start:end])
        meta = AttentionMetadata(bs, slots[start:end], 0, torch.zeros(0, 1, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), [PrefillSpan(0, end - start, end, table)])
        outputs.append(kernels.paged_prefill_attention(q[start:end], tri, meta, 0.125))
    kernels.write_kv_cache(k[24:], v[24:], tri, slots[24:])
    decode = AttentionMetadata(bs, slots[24:], 1, table[None], torch.tensor([25]))
    outputs.append(kernels.paged_decode_attention(q[24:], tri, decode, 0.125))

    reference.write_kv_cache(k, v, ref, slots)
    whole = AttentionMetadata(bs, slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                              [PrefillSpan(0, 25, 25, table)])
    torch.testing.assert_close(torch.cat(outputs), reference.paged_prefill_attention(q, ref, whole, 0.125),
                               atol=2e-5, rtol=1e-4)
