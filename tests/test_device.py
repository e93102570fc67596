"""The engine's device: `--device` resolution and its errors, the CUDA KV budget arithmetic, the pools'
placement, and the whole engine through the Triton kernels (in triton's interpreter, on CPU tensors)
matching the torch reference token for token.

Nothing here has a GPU: the CUDA paths are checked by their arithmetic and by what they ask torch for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvops import kernels
from kvops.engine import device as engine_device
from kvops.engine.config import EngineConfig, parse_bytes
from kvops.engine.device import activation_headroom, gpu_kv_budget, plan_gpu_kv_budget, resolve_device
from kvops.engine.errors import CapacityError
from kvops.engine.kv_pool import allocate_kv_pool
from kvops.kernels import AttentionMetadata, PrefillSpan
from kvops.schema.errors import ConfigError

# Triton reads TRITON_INTERPRET when it is imported, so the engine-through-Triton tests run in a child
# pytest that has it from the start (as tests/test_kernels_triton.py does); this session sees one outcome.
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child")
parent_only = pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter session")
GiB = 2**30


def _run_interpreted(select: str, *options: str) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "KVOPS_KERNELS"} | {"TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    # hypothesis's plugin is not needed there and costs a few seconds of start-up on two cores.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-x",
               "-k", select, *options, __file__]
    child = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary


# ------------------------------------------------------------------ --device


@parent_only
def test_auto_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_a_device_is_a_config_error_naming_cuda(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"--device {name}: no CUDA device is visible to torch .*--device cpu"):
            resolve_device(name)
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_indices_resolve_against_the_visible_count(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CUDA", "mps", "cuda:0,1"])
def test_bad_device_spellings_are_refused_by_the_config(name: str):
    with pytest.raises(ConfigError, match=r"is not a device kvops runs on: use auto, cpu, cuda or cuda:N"):
        EngineConfig(device=name)


@pytest.mark.parametrize(("value", "ok"), [(0.9, True), ("0.5", True), (1, True), (0, False), (1.2, False),
                                           ("most", False)])
def test_gpu_memory_utilization_is_a_fraction(value: Any, ok: bool):
    if ok:
        assert EngineConfig(gpu_memory_utilization=value).gpu_memory_utilization == float(value)
    else:
        with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
            EngineConfig(gpu_memory_utilization=value)


def _kvops() -> str:
    return shutil.which("kvops", path=str(Path(sys.executable).parent)) or shutil.which("kvops") or "kvops"


@parent_only
@pytest.mark.parametrize(("device", "expected"), [
    ("cuda", "--device cuda: no CUDA device is visible to torch"),
    ("gpu", "--device 'gpu' is not a device kvops runs on"),
])
def test_cli_refuses_a_device_it_cannot_use_with_exit_2_and_no_traceback(device: str, expected: str):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so the error path runs on GPU machines too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([_kvops(), "engine", "generate", "--device", device, "--max-tokens", "1", "hi"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert "CUDA" in result.stderr or device == "gpu"
    assert "Traceback" not in result.stderr


@parent_only
@pytest.mark.parametrize(("kernels_env", "expected"), [
    ("triton", "KVOPS_KERNELS=triton on cpu tensors needs triton's interpreter: set TRITON_INTERPRET=1"),
])
def test_cli_refuses_kernels_that_cannot_run_at_start(kernels_env: str, expected: str):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"KVOPS_KERNELS": kernels_env}
    result = subprocess.run([_kvops(), "engine", "generate", "--device", "cpu", "--max-tokens", "1", "hi"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


@parent_only
def test_engine_commands_have_the_device_flags():
    for command in ("generate", "serve"):
        result = subprocess.run([_kvops(), "engine", command, "--help"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0
        assert "--device auto|cpu|cuda|cuda:N" in result.stdout
        assert "--gpu-memory-utilization FRACTION" in result.stdout


# ------------------------------------------------------------ the CUDA budget


def test_kv_budget_is_the_utilization_share_after_weights_and_headroom():
    budget = gpu_kv_budget(total=80 * GiB, free=70 * GiB, weights=16 * GiB, headroom=2 * GiB, utilization=0.9)
    assert budget.kv_bytes == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB  # 54 GiB
    assert budget.limited_by == "--gpu-memory-utilization 0.9"


def test_kv_budget_never_exceeds_what_is_free():
    # Another process holds 40 GiB: the share would be 54 GiB, but only 20 GiB are free.
    budget = gpu_kv_budget(total=80 * GiB, free=20 * GiB, weights=16 * GiB, headroom=2 * GiB, utilization=0.9)
    assert budget.kv_bytes == 18 * GiB
    assert budget.limited_by == "free device memory"


def test_an_explicit_kv_cache_memory_caps_the_budget():
    budget = gpu_kv_budget(80 * GiB, 70 * GiB, 16 * GiB, 2 * GiB, 0.9, requested=10 * GiB)
    assert (budget.kv_bytes, budget.limited_by) == (10 * GiB, "--kv-cache-memory")
    # ... but never raises it past the share.
    assert gpu_kv_budget(80 * GiB, 70 * GiB, 16 * GiB, 2 * GiB, 0.5, requested=60 * GiB).kv_bytes == 22 * GiB


def test_no_room_left_is_a_capacity_error_with_the_numbers():
    with pytest.raises(CapacityError, match=r"no device memory is left for the KV cache: .*weights 30.0 GiB.*"
                                            r"raise --gpu-memory-utilization"):
        gpu_kv_budget(total=40 * GiB, free=9 * GiB, weights=30 * GiB, headroom=2 * GiB, utilization=0.8)


def test_activation_headroom_grows_with_the_token_budget():
    # SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, vocab 49152, bfloat16.
    small = activation_headroom(2048, 64, 576, 1536, 576, 192, 49152, 2)
    assert small == 2 * (2048 * (3 * 576 + 3 * (576 + 384) + 3 * 1536) * 2 + 64 * 49152 * 10) + 512 * 2**20
    assert activation_headroom(8192, 64, 576, 1536, 576, 192, 49152, 2) > small


def test_plan_reads_the_device_and_treats_the_default_kv_cache_memory_as_unset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(engine_device, "device_memory", lambda device: (24 * GiB, 22 * GiB))
    cuda = torch.device("cuda", 0)
    default = plan_gpu_kv_budget(EngineConfig(), cuda, weights=1 * GiB, headroom=1 * GiB)
    assert default.kv_bytes == int(0.9 * 24 * GiB) - 2 * GiB
    capped = plan_gpu_kv_budget(EngineConfig(kv_cache_memory="3GiB"), cuda, weights=1 * GiB, headroom=1 * GiB)
    assert (capped.kv_bytes, capped.limited_by) == (3 * GiB, "--kv-cache-memory")
    assert parse_bytes("512MiB") == engine_device.DEFAULT_KV_CACHE_MEMORY


# ------------------------------------------------------------ placement


def test_a_cuda_pool_is_allocated_on_the_device_with_a_pinned_host_pool(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[Any, bool]] = []
    real = kernels.allocate_kv_cache_layer

    def record(*args: Any) -> kernels.KVCacheLayer:
        calls.append((args[7], args[8]))
        return real(*args[:7])  # allocated on the CPU: this machine has no device

    monkeypatch.setattr(kernels, "allocate_kv_cache_layer", record)
    config = EngineConfig(block_size=16, kv_cache_memory="1MiB", swap_space="1MiB")
    cuda = torch.device("cuda", 0)
    pool = allocate_kv_pool(config, 2, 2, 16, torch.bfloat16, 64, cuda, budget_bytes=256 * 2**10)
    assert pool.capacity.num_blocks == 256 * 2**10 // (16 * 2 * 2 * 2 * 16 * 2)
    assert calls[:2] == [(torch.device("cpu"), True)] * 2  # the host pool first, page-locked
    assert calls[2:] == [(cuda, False)] * 2
    calls.clear()
    allocate_kv_pool(config, 2, 2, 16, torch.float32, 64)  # CPU: pageable host pool, budget from the flag
    assert calls == [(torch.device("cpu"), False)] * 4


def test_metadata_moves_once_and_keeps_its_host_copy():
    meta = AttentionMetadata(4, torch.arange(6), 1, torch.tensor([[0, 1]]), torch.tensor([5]),
                             [PrefillSpan(1, 6, 5, torch.tensor([2, 3]))])
    assert meta.to(torch.device("cpu")) is meta and meta.on_host is meta
    moved = meta.to(torch.device("meta"))
    assert moved.device.type == "meta" and moved.prefills[0].block_table.device.type == "meta"
    assert moved.decode_context_lens.device.type == "meta"
    assert moved.on_host is meta and moved.to(torch.device("meta")) is moved


# ------------------------------------------------------- the engine through Triton


@parent_only
def test_engine_through_triton_matches_torch_in_the_interpreter():
    _run_interpreted("interpreted_tiny")


@parent_only
@pytest.mark.slow
def test_real_model_through_triton_matches_torch_in_the_interpreter():
    _run_interpreted("interpreted", "-m", "slow")  # the real model, and the tiny one in the quantized formats


def _tiny_llama(directory: Path) -> Path:
    """A random 2-layer Llama (hidden 64, 4 heads of 32 over 2 KV heads, vocab 256) with the default model's
    tokenizer files, which the loader needs; prompts are given as token ids below 256."""
    import transformers

    from kvops.engine.weights import resolve_model_dir

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer_dir = resolve_model_dir(None)[1]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def _run_engine(config: EngineConfig, backend: str, first: list[int], later: list[list[int]],
                max_tokens: int) -> list[Any]:
    """`first` alone until it has a token, then `later` join: prefix-cache hits on `first`'s blocks,
    chunked prefills and decodes in the same steps."""
    from kvops.engine.llm import LLM
    from kvops.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with kernels.use_backend(backend):
        engine = LLM(config).engine
        ids = [engine.add_request(first, params)]
        while not engine.sequences[ids[0]].output_token_ids:
            engine.step()
        ids += [engine.add_request(prompt, params) for prompt in later]
        done = {}
        while engine.has_unfinished():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
    return [done[i] for i in ids]


class _Counted:
    """Counts the Triton ops the dispatch actually calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvops.kernels import triton_attention, triton_cache

        self.calls: dict[str, int] = {}
        for module, name in ((triton_cache, "write_kv_cache"), (triton_attention, "paged_decode_attention"),
                             (triton_attention, "paged_prefill_attention")):
            monkeypatch.setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name: str, op: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return op(*args, **kwargs)

        return counted


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


# The quantized formats' fused dequantization is checked kernel by kernel in test_kernels_triton.py; through
# the whole engine each costs another ~10 s of interpreter, so only the model dtype runs by default.
@needs_interpreter
@pytest.mark.parametrize("kv_cache_dtype", ["auto", *(pytest.param(kind, marks=pytest.mark.slow)
                                                      for kind in ("int8", "fp8", "int4"))])
def test_interpreted_tiny_engine_matches_torch(kv_cache_dtype: str, tiny_model: Path,
                                               monkeypatch: pytest.MonkeyPatch):
    config = EngineConfig(model=str(tiny_model), device="cpu", block_size=16, kv_cache_memory="1MiB",
                          max_model_len=256, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    shared = [(7 * i + 3) % 256 for i in range(32)]  # two blocks
    # The first prompt prefills in three chunks (16, 16, 2 tokens); the others join while it decodes.
    first, later = [*shared, 11, 12], [[*shared, 21, 22, 23], [*shared[:16], 31, 32]]
    expected = _run_engine(config, "torch", first, later, max_tokens=3)
    counted = _Counted(monkeypatch)
    got = _run_engine(config, "triton", first, later, max_tokens=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.num_cached_tokens for o in got] == [0, 32, 16]  # whole blocks of `shared` came from the cache
    assert set(counted.calls) == {"write_kv_cache", "paged_decode_attention", "paged_prefill_attention"}


@needs_interpreter
@pytest.mark.slow
def test_interpreted_real_model_matches_torch(monkeypatch: pytest.MonkeyPatch):
    from kvops.engine.weights import load_tokenizer

    tokenizer = load_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is a KV cache?", "What is a KV cache used for?")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    config = EngineConfig(device="cpu", kv_cache_memory="32MiB", max_model_len=256)
    expected = _run_engine(config, "torch", prompts[0], prompts[1:], max_tokens=2)
    counted = _Counted(monkeypatch)
    got = _run_engine(config, "triton", prompts[0], prompts[1:], max_tokens=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert got[1].num_cached_tokens > 0
    assert counted.calls["paged_prefill_attention"] and counted.calls["paged_decode_attention"]
