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
    assert "prefix hit rate 0.0% (0/74 tokens)" in result.stdout  # admitted together: nothing cached yet


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
