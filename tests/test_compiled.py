"""The compiled step (kvops/engine/compiled.py, kvops/engine/step_*.cpp) against the unfused ops it replaces.

The ops are built with this machine's compiler the first time (~20-30 s here) and loaded from the cache after,
so the session pays for one build at most; every engine the other tests start reuses it (`--compile auto`).
Exactness of whole generations, compiled and not, against transformers: tests/test_engine_correctness.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvops.engine.compiled import compile_step
from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.engine.model import apply_rope
from kvops.engine.sampling import SamplingParams
from kvops.kernels import AttentionMetadata, KVCacheLayer, allocate_kv_cache_layer, reference
from kvops.schema.errors import ConfigError
from tests.test_model import _tiny

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    step = compile_step("on", CPU, "torch")
    assert step.state in ("built", "cached") and step.on, step
    return step.ops


def _qkv(tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    x = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(tokens)) * 2
    # oneDNN's projection comes back as a transposed view (kvops/engine/linear.py): the op reads its strides
    return x.to(dtype).t().contiguous().t() if transposed else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "transposed"), [(1, False), (7, True), (40, False)])
def test_rope_write_ropes_and_writes_as_the_unfused_step_bit_for_bit(ops, dtype, tokens, transposed):
    model = _tiny(dtype)
    h, kvh, d = model.num_heads, model.num_kv_heads, model.head_dim
    qkv = _qkv(tokens, h, kvh, d, dtype, transposed)
    positions = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:tokens]
    if tokens > 1:
        slots[0] = -1  # a padding token: skipped
    # K and V as slices of a larger pool, as the block size profile's trial pools are (stride(0) is the pool's)
    compiled = allocate_kv_cache_layer("auto", 8, 8, kvh, d, dtype)
    compiled.data = allocate_kv_cache_layer("auto", 12, 8, kvh, d, dtype).data.flatten(1, 2)[:, :64].view(
        compiled.data.shape)
    unfused = allocate_kv_cache_layer("auto", 8, 8, kvh, d, dtype)

    q = ops.rope_write(qkv, positions, model.cos, model.sin_signed, compiled.data, slots, h, kvh)

    flat = qkv.contiguous()
    qk = apply_rope(flat[:, : (h + kvh) * d].view(tokens, h + kvh, d), model.cos[positions].unsqueeze(1),
                    model.sin_signed[positions].unsqueeze(1))
    reference.write_kv_cache(qk[:, h:], flat[:, (h + kvh) * d:].view(tokens, kvh, d), unfused, slots)
    assert torch.equal(q, qk[:, :h])
    assert torch.equal(compiled.data, unfused.data)
    assert compiled.data.flatten(1, 2)[:, slots[-1]].abs().sum() > 0  # written, not both left zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_add_rms_norm_adds_the_residual_exactly_and_normalizes_as_the_unfused_step(ops, dtype, rows):
    model = _tiny(dtype)
    weight = model.layers[0].input_norm
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 64, generator=generator) * 7).to(dtype)
    delta = (torch.randn(64, rows, generator=generator) * 3).to(dtype).t()  # a transposed view, as oneDNN gives
    expected_x = x + delta
    expected = model._rms_norm(expected_x, weight)
    got = ops.add_rms_norm(x, delta, weight, model.eps)
    assert torch.equal(x, expected_x)  # in place, rounded as `x + delta` rounds
    # the mean of squares is summed in another order: float rounding apart, and one bf16 step at most
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.008}
    torch.testing.assert_close(got, expected, **tolerance)
    assert torch.equal(ops.add_rms_norm(expected_x.clone(), None, weight, model.eps), got)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 40])
@pytest.mark.parametrize("k", [576, 70])  # whole 16-float chunks (and 8-column transposes), and a tail
def test_the_compiled_matmul_is_f_linear_to_float_rounding(ops, rows, k):
    generator = torch.Generator().manual_seed(rows * k)
    x, w = torch.randn(rows, k, generator=generator), torch.randn(100, k, generator=generator)
    torch.testing.assert_close(ops.gemv(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.gemv(x.t().contiguous().t(), w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_silu_mul_is_the_unfused_activation_bit_for_bit_through_aten(ops):  # bf16, and float32 of odd widths
    gate_up = (torch.randn(5, 92, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    gate, up = gate_up.split(46, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)
    gate_up = gate_up.float()  # float32 whose halves are not whole vectors
    gate, up = gate_up.split(46, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("scale", [1.0, 4.0, 200.0])  # 200: exp's argument past float's range both ways
@pytest.mark.parametrize("transposed", [False, True])  # oneDNN's product is a transposed view
def test_silu_mul_in_one_loop_is_the_unfused_activation_to_float_rounding(ops, scale, transposed):
    # float32, halves of whole vectors: the fused loop with its own exp (within 2 ulp of ATen's)
    gate_up = torch.randn(7, 96, generator=torch.Generator().manual_seed(4)) * scale
    gate_up = gate_up.t().contiguous().t() if transposed else gate_up
    gate, up = gate_up.split(48, dim=-1)
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    assert got.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (9, 3), (2, 2)])
def test_paged_decode_reads_blocks_in_place_as_the_gathering_reference_attends(ops, dtype, heads, kv_heads):
    d, bs, blocks = 64, 16, 40
    generator = torch.Generator().manual_seed(heads)
    layer = allocate_kv_cache_layer("auto", blocks, bs, kv_heads, d, dtype)
    layer.data.copy_(torch.randn(layer.data.shape, generator=generator).to(dtype))
    lens = torch.tensor([1, 16, 17, 100, 250, 33])  # one token, a full block, a block and one, longer ones
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:width] for _ in lens])  # scattered blocks
    q = torch.randn(len(lens), heads, d, generator=generator).to(dtype)
    meta = AttentionMetadata(bs, torch.zeros(len(lens), dtype=torch.long), len(lens), tables, lens)
    expected = reference.paged_decode_attention(q, layer, meta, d**-0.5)
    got = ops.paged_decode(q, layer.data, tables, lens, d**-0.5)
    tolerance = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(got, expected, **tolerance)
    # one token: its V, whatever the score
    assert torch.equal(got[0], layer.data[1, tables[0, 0], 0].repeat_interleave(heads // kv_heads, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_behind_a_shared_prefix_read_it_once_and_get_the_bits_of_one_row_at_a_time(ops, dtype):
    d, bs, heads, kv_heads = 64, 16, 9, 3
    generator = torch.Generator().manual_seed(5)
    layer = allocate_kv_cache_layer("auto", 200, bs, kv_heads, d, dtype)
    layer.data.copy_(torch.randn(layer.data.shape, generator=generator).to(dtype))
    free = torch.randperm(200, generator=generator).tolist()
    prefix_a, prefix_b = [free.pop() for _ in range(6)], [free.pop() for _ in range(3)]
    # ten rows behind prefix A (more than a span holds), one of them ending inside it; three behind B, which
    # share only its first two blocks; two of their own. Shuffled, so a span's rows are not neighbours.
    rows = [(prefix_a, 96 + 5 * i) for i in range(9)] + [(prefix_a, 70)]
    rows += [(prefix_b[:2] + ([prefix_b[2]] if i == 0 else []), 40 + i) for i in range(3)] + [([], 30), ([], 1)]
    order = torch.randperm(len(rows), generator=generator).tolist()
    rows = [rows[i] for i in order]
    width = 12
    tables = torch.tensor([(lead + [free.pop() for _ in range(width)])[:width] for lead, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), heads, d, generator=generator).to(dtype)
    scale = d**-0.5

    order_out, spans = ops.decode_spans(tables, lens, bs)
    plan = {tuple(sorted(order_out[f:f + c].tolist())): s for f, c, s in spans.tolist()}
    behind_a = sorted(i for i, (lead, _) in enumerate(rows) if lead is prefix_a)
    # ten rows: two spans, the one with the short row sharing its 70 tokens, the other all six blocks
    assert sorted(s for members, s in plan.items() if set(members) <= set(behind_a)) == [70, 6 * bs]
    behind_b = tuple(sorted(i for i, (lead, _) in enumerate(rows) if lead[:1] == prefix_b[:1]))
    assert plan[behind_b] == 2 * bs  # the third block is one row's own
    assert sorted(order_out.tolist()) == list(range(len(rows)))

    got = ops.paged_decode(q, layer.data, tables, lens, scale)
    one_at_a_time = torch.cat([ops.paged_decode(q[i:i + 1], layer.data, tables[i:i + 1].contiguous(),
                                                lens[i:i + 1], scale) for i in range(len(rows))])
    assert torch.equal(got, one_at_a_time)
    meta = AttentionMetadata(bs, torch.zeros(len(rows), dtype=torch.long), len(rows), tables, lens)
    tolerance = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(got, reference.paged_decode_attention(q, layer, meta, scale), **tolerance)


def test_decode_steps_run_every_layer_in_one_call_and_other_steps_op_by_op(ops, chat_prompts):
    llm = LLM(EngineConfig(kv_cache_memory="32MiB", max_model_len=512, compile="on"))
    calls: Counter[str] = Counter()

    class Counting:
        def __getattr__(self, name: str) -> Any:
            calls[name] += 1
            return getattr(ops, name)

    llm.engine.model.use_compiled(Counting())
    calls.clear()  # use_compiled measured the matmul backends, the compiled one through it
    llm.generate(chat_prompts[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    layers = llm.engine.model.num_layers
    # the head's matmul of each of the seven steps (logits rows 1, 2, 2, 2, 2, 2, 1) where the compiled one was
    # measured faster at that row count
    split = llm.engine.model._dispatch.split
    assert calls.pop("gemv", 0) == sum(rows <= split.compiled_rows for rows in (1, 2, 2, 2, 2, 2, 1))
    # op by op: the first prompt's prefill, then its first decode beside the second prompt's prefill; then five
    # steps where every row decodes, one call each (and the final norm)
    assert calls == {"add_rms_norm": 2 * (2 * layers + 1) + 5, "rope_write": 2 * layers, "silu_mul": 2 * layers,
                     "paged_decode": layers, "decode_layers": 5}, calls


def test_the_compiled_step_reads_the_caches_it_can_and_sees_each_new_pool():
    model = _tiny(torch.float32)

    def layer(kind: str) -> KVCacheLayer:
        return allocate_kv_cache_layer(kind, 4, 16, 2, 16, torch.float32)

    served, quantized = [layer("auto")], [layer("int8")]
    assert model._compiled_caches(served) == [served[0].data]
    assert model._compiled_caches(quantized) is None  # int8 is read op by op
    # a trial pool of K and V slices of a larger pool's memory: not one piece each
    sliced = layer("auto")
    sliced.data = torch.zeros(2, 4, 16, 4, 16)[:, :, :, :2]
    assert model._compiled_caches([sliced]) is None
    # the same pool again, and a layer replaced inside the same list, each seen for what it is now
    caches = model._compiled_caches(served)
    assert caches is not None and caches[0] is served[0].data
    served[0] = quantized[0]
    assert model._compiled_caches(served) is None


def test_a_second_start_loads_the_cached_build(ops):
    again = compile_step("auto", CPU, "torch")
    assert again.state == "cached" and Path(again.reason).is_file(), again


def test_auto_falls_back_and_on_refuses_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, no g++
    step = compile_step("auto", CPU, "torch", tmp_path)
    assert step.state == "off" and not step.on and "no C++ compiler" in step.reason
    with pytest.raises(ConfigError, match="--compile on, but no C\\+\\+ compiler"):
        compile_step("on", CPU, "torch", tmp_path)


def test_a_failing_build_falls_back_leaving_nothing_to_load(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/bin/false")
    step = compile_step("auto", CPU, "torch", tmp_path)
    assert step.state == "off" and "the build failed: /bin/false failed (1)" in step.reason, step
    assert not list(tmp_path.glob("*.so"))
    with pytest.raises(ConfigError, match="the build failed"):
        compile_step("on", CPU, "torch", tmp_path)


def test_the_triton_kernels_and_cuda_keep_their_path():
    assert "KVOPS_KERNELS=triton" in compile_step("auto", CPU, "triton").reason
    with pytest.raises(ConfigError, match="on cuda the Triton kernels run"):
        compile_step("on", torch.device("cuda"), "triton")
    assert compile_step("off", CPU, "torch").reason == "--compile off"


def test_the_snapshot_says_whether_the_step_is_compiled_and_what_it_cost(ops, chat_prompts):
    tokens = {}
    for mode in ("on", "off"):
        llm = LLM(EngineConfig(kv_cache_memory="32MiB", max_model_len=512, compile=mode))
        assert (llm.engine.model.ops is not None) == (mode == "on")
        engine = llm.engine.snapshot(include_gpu=False).engine
        if mode == "on":
            assert engine.compile == "cached" and engine.compile_s < 30, engine  # the fixture built it
        else:
            assert engine.compile == "off" and engine.compile_s == 0, engine
        outputs = llm.generate(chat_prompts[:3], SamplingParams(temperature=0, max_tokens=16))
        tokens[mode] = [o.token_ids for o in outputs]
    assert tokens["on"] == tokens["off"] and all(tokens["on"]), tokens
