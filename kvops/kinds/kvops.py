"""A kvops engine (`kvops engine serve`): read whole from `/stats` when live, from its `/metrics` in a saved
scrape (kvops.adapters.kvops_metrics); kvops starts, reconfigures live and drains it, and it measures what
other servers do not (a shadow prefix cache, prompt normalization, tenants, per-step timings)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvops.adapters.kvops_metrics import snapshot_from_kvops_metrics
from kvops.kinds.launch import Launch
from kvops.kinds.profile import Capability, EngineProfile, Recognition, Remedy

if TYPE_CHECKING:
    from kvops.adapters.engine_client import EngineClient
    from kvops.supervisor.config import EngineSpec

KIND = "kvops"
# The block sizes a kvops engine takes: any; its block-size profile measures these powers of two.
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


class KvopsLauncher:
    """`python -m kvops engine serve`, read from /stats, with the supervisor's admin token."""

    kind = KIND
    tail_streams = ("stderr",)  # stdout holds the JSON log; a crash's traceback is on stderr

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    def launch(self, spec: EngineSpec, port: int, args: Mapping[str, Any], admin_token: str) -> Launch:
        from kvops.engine.args import engine_flags

        argv = [sys.executable, "-m", "kvops", "engine", "serve", "--host", spec.host, "--port", str(port),
                "--drain-timeout", str(spec.drain_timeout_s), *engine_flags(args)]
        return Launch(argv, {**os.environ, "KVOPS_ADMIN_TOKEN": admin_token, "PYTHONUNBUFFERED": "1"})

    def client(self, url: str, admin_token: str | None) -> EngineClient:
        from kvops.adapters.engine_client import EngineClient

        return EngineClient(url, admin_token)

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**args, **params}


def check_args(value: dict[str, Any]) -> dict[str, Any]:
    """[engines.args]: EngineConfig's settings, checked the way `kvops engine serve` would take them."""
    from kvops.engine.args import ENGINE_SETTINGS
    from kvops.engine.config import EngineConfig
    from kvops.schema.errors import ConfigError

    unknown = sorted(set(value) - set(ENGINE_SETTINGS))
    if unknown:
        raise ValueError(f"unknown engine setting {unknown[0]!r}; allowed: {', '.join(ENGINE_SETTINGS)}")
    try:
        EngineConfig(**value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    except TypeError as exc:
        raise ValueError(f"bad engine setting: {exc}") from None
    return value


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
    launcher=KvopsLauncher,
    check_args=check_args,
)
