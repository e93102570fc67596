"""Engine configuration: one dataclass, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvops.engine.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_bytes(value: str | int) -> int:
    """'256MiB', '1.5GiB', '500MB', '1048576' -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a size: write e.g. 256MiB, 2GiB or 500MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    model: str | None = None  # a local HF directory or .gguf file; None = the default SmolLM2-135M-Instruct
    dtype: str = "auto"  # model dtype; auto = float32 on CPU
    block_size: int = 16
    kv_cache_memory: int | str = "512MiB"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    normalize_prompts: str = "off"  # off | shadow | on
    seed: int = 0

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be at least 1 (got {self.block_size})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be at least 1 (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1 (got {self.max_model_len})")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be positive (got {self.kv_cache_memory})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.normalize_prompts not in ("off", "shadow", "on"):
            raise ConfigError(f"--normalize-prompts {self.normalize_prompts!r} is not one of off, shadow, on")
        if self.eviction_policy not in ("lru", "lfu"):
            raise ConfigError(f"--eviction-policy {self.eviction_policy!r} is not one of lru, lfu")
