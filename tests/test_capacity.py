"""Sizing the KV pool from a budget, and refusing configurations that cannot serve one request."""

from __future__ import annotations

import pytest

from kvops.engine.capacity import kv_bytes_per_token, plan_capacity
from kvops.engine.config import EngineConfig, parse_bytes
from kvops.engine.errors import CapacityError
from kvops.engine.llm import LLM
from kvops.schema.errors import ConfigError


def test_capacity_counts_blocks_tokens_and_concurrency():
    per_token = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, element_bytes=4)
    assert per_token == 46080
    cap = plan_capacity(parse_bytes("256MiB"), 16, per_token, 2048)
    assert cap.num_blocks == 256 * 2**20 // (16 * per_token) == 364
    assert cap.tokens == 5824 and cap.max_concurrency == pytest.approx(364 / 128)
    assert "364 blocks × 16 tokens = 5824 tokens" in cap.describe()


def test_start_fails_with_needed_available_and_largest_fit():
    with pytest.raises(CapacityError) as info:
        plan_capacity(parse_bytes("16MiB"), 16, 46080, 8192)
    message = str(info.value)
    assert "needs 377487360 bytes" in message and "gives 16777216 bytes" in message
    assert "largest max_model_len that fits is 352" in message


def test_budget_smaller_than_one_block():
    with pytest.raises(CapacityError, match=r"smaller than one block.*737280 bytes"):
        plan_capacity(100_000, 16, 46080, 16)


def test_engine_refuses_to_start_when_max_model_len_cannot_fit():
    with pytest.raises(CapacityError, match="largest max_model_len that fits is 352"):
        LLM(EngineConfig(kv_cache_memory="16MiB", max_model_len=8192))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("256MiB", 256 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("500MB", 500_000_000), ("4096", 4096)],
)
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12XB", "-5MiB", ""])
def test_bad_sizes_say_how_to_write_one(bad):
    with pytest.raises(ConfigError, match=r"write e\.g\. 256MiB"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"block_size": 0}, "--block-size"), ({"max_num_seqs": 0}, "--max-num-seqs"),
     ({"eviction_policy": "fifo"}, "--eviction-policy"), ({"dtype": "int3"}, "--dtype"),
     ({"max_model_len": 9000}, "max_position_embeddings 8192")],
)
def test_bad_engine_settings_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(EngineConfig(kv_cache_memory="64MiB", **kwargs))


def test_start_logs_capacity_in_blocks_tokens_and_concurrency():
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        LLM(EngineConfig(kv_cache_memory="64MiB", max_model_len=1024))
    [entry] = [e for e in logs if e["event"].startswith("KV cache:")]
    assert entry["num_blocks"] == 91 and entry["tokens"] == 1456 and entry["bytes_per_token"] == 46080
    assert entry["max_concurrency"] == round(91 / 64, 2)
