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
    # Relative L2 error ||dequantized - full precision|| / ||full precision|| over the context at the last
    # step, K and V. None in profiles from before it was measured.
    k_rel_error: float | None = None
    v_rel_error: float | None = None
    # fp8 only: the layer's K and V scales (dequantized = e4m3 value × scale); None for other dtypes.
    k_scale: float | None = None
    v_scale: float | None = None


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
    # fp8 only: where the layers' scales came from. "serving": the serving pool's calibrated scales;
    # "calibrated": calibrated on the profile's own prompts (the serving pool had none yet, or another
    # dtype serves); "fixed": a fixed scale (`kvops.kernels.kv_cache.fixed_fp8_scale`).
    fp8_scales: str | None = None


class BlockSizeTiming(BaseModel):
    block_size: int
    decode_step_ms: float  # median time of one decode step at the measured batch and context lengths
    relative: float  # decode_step_ms / the best candidate's (1.0 = the best)
    fragmentation: float  # expected share of allocated slots left empty, for the measured lengths
    iqr_ms: float = 0.0  # interquartile range of the timed steps: a gap between candidates below it is noise


class BlockSizeProfile(BaseModel):
    """Decode-step timings of candidate block sizes for the running model and its recent sequence
    lengths: what the block-size rule decides from, instead of a rule of thumb."""

    configured: int
    best: int  # the fastest candidate
    candidates: list[BlockSizeTiming]
    context_lens: list[int]  # the sequence lengths measured (drawn from the recent distribution)
    batch_size: int
    repeats: int
    measured_at: float  # unix seconds
    duration_s: float
    lengths_from: str = "recent"  # recent: the engine's recent prompts | default: nothing served yet, a fixed set
    generated_tokens: int = 0  # added to each prompt length: the mean output length so far (64 when unknown)
