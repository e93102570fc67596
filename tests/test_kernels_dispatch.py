"""The dispatch layer and the CPU reference path: which backend runs where, how it is forced, and that the
reference's bucketed, block-wise attention equals gathering each sequence's blocks and calling SDPA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvops import kernels
from kvops.kernels import allocate_kv_cache_layer, dispatch, reference


def _load_benchmark() -> ModuleType:
    """benchmarks/kernels_cpu.py, whose gather-blocks-then-SDPA baseline is the oracle here."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "kernels_cpu.py"
    spec = importlib.util.spec_from_file_location("kernels_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels_cpu"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


kernels_cpu = _load_benchmark()


def test_cpu_tensors_use_the_reference_by_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernels.backend_for(torch.device("cpu")) == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert kernels.backend_for(torch.device("cuda")) == "torch"  # forced, even for GPU tensors
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    expected = "triton" if dispatch.triton_available() else "torch"
    assert kernels.backend_for(torch.device("cuda")) == expected


def test_an_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="KVOPS_KERNELS='cuda' is not one of auto, triton, torch"):
        kernels.backend_for(torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of"), kernels.use_backend("fast"):
        pass


def test_use_backend_overrides_the_environment_and_restores(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with kernels.use_backend("torch"):
        assert kernels.backend_for(torch.device("cpu")) == "torch"
    assert dispatch.requested_backend() == "triton"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dispatch.ENV_VAR)}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)


def test_the_cpu_engine_path_never_imports_triton_and_forcing_it_without_the_interpreter_says_how():
    code = (
        "import sys, torch\n"
        "from kvops import kernels\n"
        "layer = kernels.allocate_kv_cache_layer('int8', 2, 4, 1, 64, torch.float32)\n"
        "kernels.write_kv_cache(torch.ones(3, 1, 64), torch.ones(3, 1, 64), layer, torch.tensor([0, -1, 5]))\n"
        "print('triton' in sys.modules)\n"
        "with kernels.use_backend('triton'):\n"
        "    kernels.write_kv_cache(torch.ones(1, 1, 64), torch.ones(1, 1, 64), layer, torch.tensor([1]))\n"
    )
    result = _run(code)
    assert result.stdout.strip() == "False", result.stderr
    if dispatch.triton_available():
        assert "needs triton's interpreter: set TRITON_INTERPRET=1" in result.stderr
    else:
        assert "triton is not installed" in result.stderr


def _ragged_cases() -> list[Any]:  # kernels_cpu.Case, loaded from a file
    return [
        kernels_cpu.Case("equal lengths", "decode", "auto", 3, [40, 40, 40], block_size=8),
        kernels_cpu.Case("two buckets and a lone long one", "decode", "int8", 6, [1, 700, 30, 33, 2000, 690],
                         block_size=16),
        kernels_cpu.Case("block size 1, fp8", "decode", "fp8", 2, [5, 9], block_size=1),
        kernels_cpu.Case("int4, odd head dim", "decode", "int4", 3, [70, 3, 64], head_dim=96, block_size=32),
        kernels_cpu.Case("prefix hits", "prefill", "auto", 3, [40, 25, 64], new_tokens=9, block_size=16),
        kernels_cpu.Case("whole prompts", "prefill", "int4", 2, [12, 12], new_tokens=12, block_size=4),
    ]


@pytest.mark.parametrize("case", _ragged_cases(), ids=lambda c: c.name)
def test_reference_equals_gathering_blocks_and_sdpa(case: Any):
    q, layer, meta = kernels_cpu._setup(case)
    scale = case.head_dim**-0.5
    if case.op == "decode":
        got = reference.paged_decode_attention(q, layer, meta, scale)
        want = kernels_cpu.baseline_decode(q, layer, meta, scale)
    else:
        got = reference.paged_prefill_attention(q, layer, meta, scale)
        want = kernels_cpu.baseline_prefill(q, layer, meta, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_buckets_split_only_where_padding_would_cost_more_than_a_call():
    case = kernels_cpu.Case("", "decode", "auto", 6, [1, 700, 30, 33, 2000, 690], block_size=16)
    q, layer, meta = kernels_cpu._setup(case)
    reference.paged_decode_attention(q, layer, meta, 0.125)
    buckets = meta._cache["decode_buckets"]
    assert sorted(b.length for b in buckets) == [33, 700, 2000]  # {1, 30, 33}, {690, 700}, {2000}
    assert all((b.mask is None) == (b.length == 2000) for b in buckets)


@pytest.mark.slow
def test_reference_is_not_slower_than_gather_plus_sdpa():
    """Timing on a shared 2-core machine is noisy: best of several, interleaved, with 15% slack."""
    torch.manual_seed(0)
    slower = []
    for case in kernels_cpu.cases(quick=True):
        row = kernels_cpu.run_case(case, reps=7)
        if row.ratio < 0.85:
            slower.append(row)
        time.sleep(0.1)
    assert not slower, slower


def _cascade_cases() -> list[Any]:  # kernels_cpu.Case
    return [
        kernels_cpu.Case("one prefix", "decode", "auto", 5, [300, 129, 131, 190, 260], shared_prefix=128),
        kernels_cpu.Case("two prefixes and loners", "decode", "auto", 7, [90, 200, 70, 150, 64, 300, 66],
                         shared_prefix=64, groups=2),
        kernels_cpu.Case("int8", "decode", "int8", 4, [100, 120, 140, 99], shared_prefix=96, block_size=8),
        kernels_cpu.Case("fp8, block size 1", "decode", "fp8", 3, [80, 81, 90], shared_prefix=72, block_size=1),
        kernels_cpu.Case("int4", "decode", "int4", 3, [160, 170, 200], shared_prefix=128, block_size=32),
    ]


@pytest.mark.parametrize("case", _cascade_cases(), ids=lambda c: c.name)
def test_rows_sharing_prefix_blocks_read_them_once_and_get_the_same_attention(case: Any):
    q, layer, meta = kernels_cpu._setup(case)
    scale = case.head_dim**-0.5
    got = reference.paged_decode_attention(q, layer, meta, scale)
    torch.testing.assert_close(got, kernels_cpu.baseline_decode(q, layer, meta, scale), atol=1e-5, rtol=1e-5)
    plan = meta._cache["cascade"]
    assert plan is not None, "rows sharing whole blocks were not found"
    lens = case.context
    sharing = [i for i, n in enumerate(lens) if n > case.shared_prefix]
    assert sorted(r for g in plan.groups for r in g.rows.tolist()) == sharing
    for group in plan.groups:
        rows = group.rows.tolist()
        assert len(rows) >= 2 and {i % case.groups for i in rows} == {rows[0] % case.groups}
        # Every shared block, and only those: each row keeps at least its last token for itself.
        want = min(case.shared_prefix, (min(lens[r] for r in rows) - 1) // case.block_size * case.block_size)
        assert group.prefix_blocks.numel() * case.block_size == want
    loners = [i for i in range(len(lens)) if i not in sharing]
    assert (plan.plain_rows.tolist() if plan.plain is not None else []) == loners


def test_a_short_shared_prefix_is_not_worth_splitting_off():
    case = kernels_cpu.Case("", "decode", "auto", 3, [60, 70, 80], shared_prefix=48)
    q, layer, meta = kernels_cpu._setup(case)
    reference.paged_decode_attention(q, layer, meta, 0.125)
    assert meta._cache["cascade"] is None  # 48 tokens < MIN_SHARED_TOKENS: the plain path


def test_rows_sharing_a_prefix_attend_in_bfloat16_too():
    # The merge of the prefix's and the rows' own attention runs in float; the rows are written back in the
    # model's dtype (a bf16 engine answered 500 on the shared-prefix workload when they were not).
    case = _cascade_cases()[0]
    q, layer, meta = kernels_cpu._setup(case)
    half = allocate_kv_cache_layer("auto", layer.data.shape[1], case.block_size, case.kv_heads, case.head_dim,
                                   torch.bfloat16)
    half.data.copy_(layer.data.to(torch.bfloat16))
    q = q.to(torch.bfloat16)
    scale = case.head_dim**-0.5
    got = reference.paged_decode_attention(q, half, meta, scale)
    assert meta._cache["cascade"] is not None and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, kernels_cpu.baseline_decode(q, half, meta, scale), atol=2e-2, rtol=2e-2)
