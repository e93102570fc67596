"""What the scenarios on the real vLLM share (`kvops scenario run NAME --engine vllm`): vLLM's CPU build from
`kvops vllm setup`, managed by the scenario's supervisor, with its KV cache events on and a `kvops gateway` in front
of it ([engines.gateway]) that owns the tenants; each tenant's API key, and the load sent through the gateway.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

VLLM_MODEL = "smollm2"  # the name a managed vLLM serves the shipped model under (kvops.vllm.flags)
# vLLM's CPU attention takes block sizes that are multiples of 32; 32 keeps blocks as small as it allows.
BLOCK_SIZE = 32


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
