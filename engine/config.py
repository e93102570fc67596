"""Engine configuration: one dataclass, validated once."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvops.engine.errors import ConfigError
from kvops.kernels.kv_cache import KV_CACHE_DTYPES
from kvops.kernels.quantization import INT4_GROUP_SIZES

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
PREEMPTION_MODES = ("swap", "recompute")


def parse_layers(value: str | Sequence[int | str]) -> tuple[int, ...]:
    """'0,5' or 'model.layers.0,model.layers.5' or [0, 5] -> (0, 5)."""
    items = [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else list(value)
    layers = []
    for item in items:
        match = re.fullmatch(r"(?:model\.)?(?:layers\.)?(\d+)", str(item).strip())
        if not match:
            raise ConfigError(f"cannot read {item!r} as a layer: write layer indices like 0,5 or names like "
                              "model.layers.5")
        layers.append(int(match.group(1)))
    return tuple(sorted(set(layers)))


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
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 | fp8 | int4
    kv_cache_group_size: int = 32  # int4 only: channels sharing one scale and zero point
    kv_cache_dtype_skip_layers: str | Sequence[int | str] = ()  # layers kept in the model dtype
    swap_space: int | str = 0  # host KV pool for swapped-out sequences, bytes
    preemption_mode: str | None = None  # swap | recompute; None = swap when swap_space is set
    debug_scale_k: str = ""  # testing aid, "LAYER:FACTOR": one layer's keys scaled, as in a model with outlier keys

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.swap_space = parse_bytes(self.swap_space)
        self.kv_cache_dtype_skip_layers = parse_layers(self.kv_cache_dtype_skip_layers)
        if self.preemption_mode is None:
            self.preemption_mode = "swap" if self.swap_space else "recompute"
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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(
                f"--kv-cache-group-size must be one of {INT4_GROUP_SIZES} (got {self.kv_cache_group_size})")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must not be negative (got {self.swap_space})")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode {self.preemption_mode!r} is not one of swap, recompute")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ConfigError("--preemption-mode swap needs a host pool: give --swap-space, e.g. 1GiB")
        if self.debug_scale_k and not re.fullmatch(r"\d+:[0-9.eE+-]+", self.debug_scale_k):
            raise ConfigError(f"--debug-scale-k {self.debug_scale_k!r}: write LAYER:FACTOR, e.g. 3:1000")
        if self.eviction_policy not in ("lru", "lfu"):
            raise ConfigError(f"--eviction-policy {self.eviction_policy!r} is not one of lru, lfu")
