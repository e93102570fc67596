"""One layer's slice of the paged KV pool, in any KV dtype.

Every tensor is indexed [2 (K, V), block, offset in block, kv_head, ...], so a slot
(block * block_size + offset) addresses one token's K/V and its scales alike, and a block
copy or swap moves data and scales together.

fp8 is the exception: its scales are per layer (one for K, one for V), calibrated from the first K/V
written to the layer and then fixed for the life of the pool (`calibrate_fp8_scales`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvops.kernels.quantization import fp8_scales

# Names only, shared with the engine's torch-free settings; re-exported as kvops.kernels.KV_CACHE_DTYPES.
from kvops.schema.kv_dtypes import KV_CACHE_DTYPES


@dataclass
class KVCacheLayer:
    kind: str  # one of KV_CACHE_DTYPES; auto = stored in the model dtype
    dtype: torch.dtype  # the model dtype K/V are written from and read back as
    head_dim: int
    data: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim] (int4: head_dim / 2 bytes)
    scale: torch.Tensor | None = None  # int8: [2, blocks, bs, heads]; int4: [.., heads, groups]; fp8: [2] per layer
    zero: torch.Tensor | None = None  # int4 only: [2, blocks, bs, heads, groups]
    group_size: int = 0  # int4 only
    # fp8 only: True once `scale` holds the layer's final K/V scales. A host-side flag, so the write path
    # never reads device memory to learn whether it still has to calibrate.
    scale_fixed: bool = False

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this layer: data, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)

    def per_slot(self) -> list[torch.Tensor]:
        """The tensors that hold one entry per slot (what a block copy must move)."""
        tensors = [self.data]
        if self.kind in ("int8", "int4"):
            tensors.append(self.scale)  # type: ignore[arg-type]
        if self.kind == "int4":
            tensors.append(self.zero)  # type: ignore[arg-type]
        return tensors


_fixed_fp8_scale: float | None = None


@contextmanager
def fixed_fp8_scale(value: float = 1.0) -> Iterator[None]:
    """fp8 layers allocated inside the block keep `value` as their K and V scale instead of calibrating:
    the behaviour before calibration (1.0, vLLM's default without checkpoint scales), for comparisons."""
    global _fixed_fp8_scale
    previous, _fixed_fp8_scale = _fixed_fp8_scale, value
    try:
        yield
    finally:
        _fixed_fp8_scale = previous


def calibrate_fp8_scales(layer: KVCacheLayer, k: torch.Tensor, v: torch.Tensor,
                         keep: torch.Tensor | None = None) -> None:
    """On an fp8 layer's first write, set its K and V scales from that write's amax (`fp8_scales`);
    `keep` [tokens] marks the tokens actually written (padding would otherwise count).

    The scales never change afterwards: every block already written holds bytes encoded with them, and
    rescaling would silently change what those blocks decode to (and what a swapped-out copy decodes to
    when it comes back). A later token beyond ±448 × scale saturates instead; FP8_SCALE_MARGIN is the
    headroom against that."""
    if layer.kind != "fp8" or layer.scale_fixed or k.shape[0] == 0:
        return
    assert layer.scale is not None
    if keep is not None:
        k = torch.where(keep[:, None, None], k, 0)
        v = torch.where(keep[:, None, None], v, 0)
    layer.scale.copy_(fp8_scales(k, v))
    layer.scale_fixed = True


def layer_bytes_per_token(kind: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          group_size: int = 32) -> int:
    """K and V bytes of one token in one layer, scales included (fp8's per-layer scale is not per token)."""
    heads = 2 * num_kv_heads
    if kind == "auto":
        return heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    if kind == "int8":
        return heads * (head_dim + 4)
    if kind == "fp8":
        return heads * head_dim
    if kind == "int4":
        return heads * (head_dim // 2 + 2 * 2 * (head_dim // group_size))
    raise ValueError(f"unknown KV cache dtype {kind!r}: use one of {', '.join(KV_CACHE_DTYPES)}")


def allocate_kv_cache_layer(kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, group_size: int = 32, device: torch.device | str | None = None,
                            pin_memory: bool = False, fp8_scale: float | None = None) -> KVCacheLayer:
    """One layer's zeroed cache on `device` (default: the CPU). `pin_memory` is for a host swap pool beside a
    CUDA pool: copies from page-locked memory run at full bus speed and without a staging copy. `fp8_scale`:
    a fixed K/V scale for an fp8 layer (--kv-cache-scale); None calibrates on the first write."""
    shape = (2, num_blocks, block_size, num_kv_heads)

    def zeros(*size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device, pin_memory=pin_memory)

    if kind == "auto":
        return KVCacheLayer(kind, dtype, head_dim, zeros(*shape, head_dim, dtype=dtype))
    if kind == "int8":
        return KVCacheLayer(kind, dtype, head_dim, zeros(*shape, head_dim, dtype=torch.int8),
                            scale=zeros(*shape, dtype=torch.float32))
    if kind == "fp8":
        # 1.0 until the first write calibrates it, unless a fixed scale is asked for (here or `fixed_fp8_scale`).
        fixed = fp8_scale if fp8_scale is not None else _fixed_fp8_scale
        scale = torch.full((2,), fixed or 1.0, dtype=torch.float32, device=device, pin_memory=pin_memory)
        return KVCacheLayer(kind, dtype, head_dim, zeros(*shape, head_dim, dtype=torch.float8_e4m3fn),
                            scale=scale, scale_fixed=fixed is not None)
    if kind == "int4":
        groups = head_dim // group_size
        return KVCacheLayer(kind, dtype, head_dim, zeros(*shape, head_dim // 2, dtype=torch.uint8),
                            scale=zeros(*shape, groups, dtype=torch.bfloat16),
                            zero=zeros(*shape, groups, dtype=torch.bfloat16), group_size=group_size)
    raise ValueError(f"unknown KV cache dtype {kind!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
