"""The KV cache dtypes by name: the engine's settings offer them, the kernels lay each out, and the
snapshot reports the one an engine runs (`Snapshot.kv_cache_dtype`). Names only, so that the settings,
which `kvops run`, `kvops top` and `kvops doctor` import, stay free of torch."""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "int4")  # kvops.kernels.kv_cache lays out each
INT4_GROUP_SIZES = (32, 64)  # int4 KV: channels per scale and zero point
