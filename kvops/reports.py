"""On-demand reports an engine produces (the snapshot's siblings): one schema, shared by the engine,
`kvops doctor` and anything else that asks for them over HTTP."""

from __future__ import annotations

from pydantic import BaseModel


class LayerKVError(BaseModel):
    layer: int
    kv_dtype: str  # this layer's KV storage: int8 | fp8 | int4, or the model dtype when kept in full precision
    k_cosine: dict[int, float]  # decode step -> mean cosine similarity of dequantized K against full precision
    v_cosine: dict[int, float]
    min_cosine: float  # the worst of the above
    below_threshold: bool


class KVQuantProfile(BaseModel):
    kv_cache_dtype: str
    group_size: int | None  # int4 only
    skip_layers: list[int]
    threshold: float
    steps: list[int]  # decode steps at which the cache was compared
    prompts: int
    tokens_compared: int  # context tokens × sequences at the last step, per layer
    duration_s: float
    layers: list[LayerKVError]
    flagged: list[int]  # layers below the threshold: candidates for --kv-cache-dtype-skip-layers
