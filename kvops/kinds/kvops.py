"""A kvops engine (`kvops engine serve`): read whole from `/stats` when live, from its `/metrics` in a saved
scrape (kvops.adapters.kvops_metrics); kvops starts (kvops.supervisor.launchers), reconfigures live and drains
it, and it measures what other servers do not (a shadow prefix cache, prompt normalization, tenants, per-step
timings)."""

from __future__ import annotations

from kvops.adapters.kvops_metrics import snapshot_from_kvops_metrics
from kvops.kinds.profile import Capability, EngineProfile, Recognition, Remedy

KIND = "kvops"
# The block sizes a kvops engine takes: any; its block-size profile measures these powers of two.
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)

PROFILE = EngineProfile(
    kind=KIND,
    title="kvops",
    recognition=Recognition(metric_prefixes=("kvops_",), owned_by=("kvops",)),
    read_scrape=snapshot_from_kvops_metrics,
    remedies={
        Remedy.QUEUEING: "raise max_num_seqs (--max-num-seqs)",
        Remedy.LONG_PROMPTS: "cap them (--max-model-len), give the tenant sending them a quota (PUT /admin/tenants/"
                             "NAME {\"quota_blocks\": N}), or route long prompts to their own engine",
        Remedy.PREFIX_CACHING_ON: "PUT /admin/prefix-caching {\"enabled\": true} (live), or restart with "
                                  "--enable-prefix-caching",
        Remedy.START: "kvops engine serve --port {port}",
        Remedy.CAPACITY: "restart with a lower --max-num-seqs or a larger --kv-cache-memory (kvops run sizes it: "
                         "kv_oom_runtime)",
    },
    capabilities=frozenset({Capability.ADMIN_API, Capability.PROFILES, Capability.STATS, Capability.SHADOW_CACHE,
                            Capability.LIVE_NORMALIZATION, Capability.MANAGED, Capability.KV_QUANTIZATION}),
    block_sizes=BLOCK_SIZES,
)
