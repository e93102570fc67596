"""Choose, per call, between the Triton kernels and the torch reference; both share one signature.

Default ("auto"): Triton for CUDA tensors when triton is installed, the torch reference otherwise (CPU,
and machines without triton). `KVOPS_KERNELS=triton|torch|auto`, or `use_backend(...)` in code, forces
a choice. Forcing Triton on CPU tensors only works in triton's interpreter (TRITON_INTERPRET=1 set
before the kernels are first imported): that is how the kernels are tested on machines with no GPU.

The Triton modules are imported lazily, on the first call that picks them, so CPU-only processes never
import triton at all.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

import torch

from kvops.kernels import reference
from kvops.kernels.attention_metadata import AttentionMetadata
from kvops.kernels.kv_cache import KVCacheLayer

ENV_VAR = "KVOPS_KERNELS"
BACKENDS = ("auto", "triton", "torch")
_override: str | None = None


def requested_backend() -> str:
    """What was asked for: `use_backend`'s value, else $KVOPS_KERNELS, else auto."""
    value = _override or os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside the block (takes precedence over the environment variable)."""
    global _override
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    previous, _override = _override, name
    try:
        yield
    finally:
        _override = previous


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_ops() -> tuple[ModuleType, ModuleType]:
    """The Triton kernel modules (cache, attention), imported on first use."""
    from kvops.kernels import triton_attention, triton_cache

    return triton_cache, triton_attention


def backend_for(device: torch.device) -> str:
    """"triton" or "torch" for tensors on `device`, or an error saying why a forced Triton cannot run."""
    requested = requested_backend()
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed (pip install triton)")
    if device.type != "cuda":
        from kvops.kernels.triton_common import INTERPRETED

        if not INTERPRETED:
            raise RuntimeError(f"{ENV_VAR}=triton on {device.type} tensors needs triton's interpreter: set "
                               "TRITON_INTERPRET=1 before kvops.kernels' Triton modules are first imported")
    return "triton"


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, layer: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Quantize new K/V [tokens, kv_heads, head_dim] into one layer's cache at `slot_mapping`;
    negative slots are skipped."""
    if backend_for(layer.data.device) == "triton":
        triton_ops()[0].write_kv_cache(k, v, layer, slot_mapping)
    else:
        reference.write_kv_cache(k, v, layer, slot_mapping)


def paged_decode_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_decodes, heads, head_dim] attends over each sequence's whole context in the paged cache."""
    if backend_for(q.device) == "triton":
        return triton_ops()[1].paged_decode_attention(q, layer, meta, scale)
    return reference.paged_decode_attention(q, layer, meta, scale)


def paged_prefill_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """q [prefill_tokens, heads, head_dim] of each span attends causally over its cached prefix and itself."""
    if backend_for(q.device) == "triton":
        return triton_ops()[1].paged_prefill_attention(q, layer, meta, scale)
    return reference.paged_prefill_attention(q, layer, meta, scale)
