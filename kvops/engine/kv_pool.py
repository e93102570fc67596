"""The KV pools: the device pool every layer reads and writes, and the host pool swapped blocks wait in.

Each layer stores K/V in its own KV dtype (the configured one, or the model dtype for layers kept
in full precision), so bytes per token is the sum over layers, and the pool's capacity in tokens
follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvops import kernels
from kvops.engine.capacity import Capacity, plan_capacity
from kvops.engine.config import EngineConfig, format_bytes
from kvops.kernels import KVCacheLayer
from kvops.schema.errors import ConfigError


def layer_kv_dtypes(config: EngineConfig, num_layers: int, head_dim: int) -> list[str]:
    """The KV dtype of each layer: the configured one, except layers kept in the model dtype."""
    skip = tuple(config.kv_cache_dtype_skip_layers)
    outside = [i for i in skip if not 0 <= i < num_layers]
    if outside:
        raise ConfigError(f"--kv-cache-dtype-skip-layers names layer {outside[0]}, but the model has "
                          f"{num_layers} layers (0..{num_layers - 1})")
    if config.kv_cache_dtype == "int4" and head_dim % config.kv_cache_group_size:
        raise ConfigError(f"int4 groups of {config.kv_cache_group_size} channels do not divide head_dim {head_dim}: "
                          "use --kv-cache-group-size 32, or another --kv-cache-dtype")
    return ["auto" if i in skip else config.kv_cache_dtype for i in range(num_layers)]


@dataclass
class KVPool:
    layer_dtypes: list[str]
    bytes_per_token: int  # K and V of one token, all layers, scales included
    capacity: Capacity
    device: list[KVCacheLayer]
    host: list[KVCacheLayer]  # empty without --swap-space

    @property
    def num_host_blocks(self) -> int:
        return self.host[0].num_blocks if self.host else 0

    @property
    def host_pool_bytes(self) -> int:
        """What the host pool holds, by the same per-token measure as the device pool's capacity."""
        return self.num_host_blocks * self.capacity.block_size * self.bytes_per_token

    @property
    def allocated_bytes(self) -> int:
        """Bytes actually allocated for the device pool: data, scales and zero points of every layer."""
        return sum(layer.nbytes for layer in self.device)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) copies."""
        if not pairs:
            return
        for device, host in zip(self.device, self.host, strict=True):
            kernels.swap_blocks(device, host, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) copies."""
        if not pairs:
            return
        for device, host in zip(self.device, self.host, strict=True):
            kernels.swap_blocks(host, device, pairs)


def allocate_kv_pool(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, max_model_len: int, device: torch.device | None = None,
                     budget_bytes: int | None = None) -> KVPool:
    """The device pool on `device` (default CPU) from `budget_bytes` (default --kv-cache-memory), and the
    host pool from --swap-space, page-locked when the device is CUDA."""
    device = device or torch.device("cpu")
    kinds = layer_kv_dtypes(config, num_layers, head_dim)
    group = config.kv_cache_group_size
    bytes_per_token = sum(kernels.layer_bytes_per_token(kind, num_kv_heads, head_dim, dtype, group) for kind in kinds)
    budget = int(config.kv_cache_memory) if budget_bytes is None else budget_bytes
    source = "--kv-cache-memory" if budget_bytes is None else "the device memory budget"
    capacity = plan_capacity(budget, config.block_size, bytes_per_token, max_model_len, source)
    block_bytes = config.block_size * bytes_per_token
    num_host_blocks = int(config.swap_space) // block_bytes
    if config.swap_space and num_host_blocks < 1:
        raise ConfigError(f"--swap-space {format_bytes(int(config.swap_space))} is smaller than one block "
                          f"({block_bytes} bytes): give at least {format_bytes(block_bytes)}, or 0 for no swap")

    def pool(num_blocks: int, where: torch.device, pinned: bool = False) -> list[KVCacheLayer]:
        return [kernels.allocate_kv_cache_layer(kind, num_blocks, config.block_size, num_kv_heads, head_dim,
                                                dtype, group, where, pinned, config.fixed_kv_scale) for kind in kinds]

    host = pool(num_host_blocks, torch.device("cpu"), device.type == "cuda") if num_host_blocks else []
    return KVPool(kinds, bytes_per_token, capacity, pool(capacity.num_blocks, device), host)
