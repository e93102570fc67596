"""How many blocks a KV budget buys, and whether one max-length request fits."""

from __future__ import annotations

from dataclasses import dataclass

from kvops.engine.config import format_bytes
from kvops.engine.errors import CapacityError


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: float) -> int:
    """K and V, every layer, one token."""
    return int(2 * num_layers * num_kv_heads * head_dim * element_bytes)


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len fit at once."""
        per_request = -(-self.max_model_len // self.block_size)
        return self.num_blocks / per_request

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.tokens} tokens, "
            f"{self.bytes_per_token} bytes/token ({format_bytes(self.pool_bytes)}); "
            f"maximum concurrency at max_model_len {self.max_model_len}: {self.max_concurrency:.2f}×"
        )


def plan_capacity(budget_bytes: int, block_size: int, bytes_per_token: int, max_model_len: int,
                  source: str = "--kv-cache-memory") -> Capacity:
    """`source` names where the budget came from in the errors: the flag on CPU; on CUDA the budget is
    derived from --gpu-memory-utilization, so the advice names both knobs."""
    raise_to = (f"raise {source} to" if source.startswith("--")
                else "raise --gpu-memory-utilization or --kv-cache-memory to give")
    block_bytes = block_size * bytes_per_token
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise CapacityError(
            f"{source} {format_bytes(budget_bytes)} ({budget_bytes} bytes) is smaller than one block: "
            f"a block of {block_size} tokens needs {block_bytes} bytes ({bytes_per_token} bytes/token); "
            f"{raise_to} at least {format_bytes(block_bytes)}"
        )
    needed_blocks = -(-max_model_len // block_size)
    if needed_blocks > num_blocks:
        needed = needed_blocks * block_bytes
        raise CapacityError(
            f"one request of max_model_len {max_model_len} tokens needs {needed} bytes ({format_bytes(needed)}) "
            f"of KV cache but {source} gives {budget_bytes} bytes ({format_bytes(budget_bytes)}), "
            f"{num_blocks} blocks of {block_size} tokens; the largest max_model_len that fits is "
            f"{num_blocks * block_size}: lower --max-model-len to {num_blocks * block_size} or {raise_to} "
            f"{format_bytes(needed)}"
        )
    return Capacity(num_blocks, block_size, bytes_per_token, max_model_len)
