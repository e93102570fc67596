"""Any local Llama-family directory loads: small random Llama, Qwen2 and Mistral models written by
transformers itself, each checked token-for-token against transformers' greedy `generate`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams
from kvops.schema.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny_model(kind: str, directory: Path, tokenizer_dir: Path, **extra) -> Path:
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[kind]
    config = config_class(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.3, tie_word_embeddings=kind != "mistral", **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {}),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": None}),
    ],
    ids=["llama", "llama3-rope", "qwen2", "mistral"],
)
def test_local_directory_matches_transformers(kind, extra, tmp_path, llm):
    from transformers import AutoModelForCausalLM

    directory = _tiny_model(kind, tmp_path / kind, llm.engine.model_dir, **extra)
    prompts = [[1, 400, 500, 600, 700, 800, 900], [5, 6, 7], list(range(100, 160))]
    engine_llm = LLM(EngineConfig(model=str(directory), block_size=4, kv_cache_memory="8MiB", max_model_len=512))
    got = [o.token_ids for o in engine_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True))]
    reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    for prompt, tokens in zip(prompts, got, strict=True):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 top_p=None, top_k=None, temperature=None, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ConfigError, match=r"architecture 'gpt2'.*supported are llama, mistral, qwen2"):
        LLM(EngineConfig(model=str(tmp_path)))


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*never downloads"):
        LLM(EngineConfig(model=str(tmp_path / "nope")))


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        LLM(EngineConfig(model=str(tmp_path)))
