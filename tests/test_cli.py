"""`kvops engine generate` as a person runs it: a real subprocess, real output, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def kvops(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvops", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_completions_and_cache_state():
    result = kvops("engine", "generate", "What is the capital of France?", "What is the capital of Italy?",
                   "--max-tokens", "12", "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--stats")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and result.stdout.count("finish: ") == 2
    assert "KV cache: 45 blocks × 16 tokens = 720 tokens, 46080 bytes/token" in result.stdout
    snapshot = json.loads(result.stdout[result.stdout.index("{"):])
    assert snapshot["schema_version"] == 1 and snapshot["prefix_cache"]["queries_total"] > 0
    # Submitted together: the second waits one step for the first block they share (the chat template's
    # system prompt) instead of computing it beside the first, and hits it.
    assert "prefix hit rate 21.6% (16/74 tokens)" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-memory", "16MiB"], "largest max_model_len that fits is 352"),
        (["--model", "/no/such/model"], "does not exist"),
        (["--kv-cache-memory", "lots"], "cannot read 'lots' as a size"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--block-size", "0"], "--block-size must be at least 1"),
    ],
)
def test_bad_settings_exit_2_with_a_message_not_a_traceback(args, message):
    result = kvops("engine", "generate", "hello", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_every_engine_setting_has_a_flag_that_round_trips():
    import argparse

    from kvops.engine.args import ENGINE_SETTINGS, add_engine_args, engine_config_from_args, engine_flags
    from kvops.engine.config import EngineConfig, flag_name

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {flag_name(name) for name in ENGINE_SETTINGS} <= flags
    assert "--no-enable-prefix-caching" in flags
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    # A value other than the default for every setting (a new setting must be added here).
    settings = {"model": "/models/x", "dtype": "bfloat16", "block_size": 32, "kv_cache_memory": "1GiB",
                "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                "enable_prefix_caching": False, "eviction_policy": "lfu", "normalize_prompts": "shadow", "seed": 7,
                "kv_cache_dtype": "int4", "kv_cache_scale": "1.0", "kv_cache_group_size": 64,
                "kv_cache_dtype_skip_layers": [0, 5],
                "swap_space": "1GiB", "preemption_mode": "swap", "api_keys_file": "/etc/kvops/keys",
                "api_keys_env": "KVOPS_API_KEYS", "trust_client_tenant": True, "max_tenant_labels": 5,
                "debug_scale_k": "3:1000", "threads": "1", "device": "cpu", "compile": "off",
                "gpu_memory_utilization": 0.5}
    assert tuple(settings) == ENGINE_SETTINGS
    config = engine_config_from_args(parser.parse_args(engine_flags(settings)))
    assert config == EngineConfig(**settings)
    assert all(getattr(config, name) != getattr(EngineConfig(), name) for name in ENGINE_SETTINGS)


def test_the_engine_flags_import_without_torch():
    code = "import sys, kvops.engine.args, kvops.engine.errors; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0
