"""Fault scenarios: one per diagnosis, each reproducing the fault on the real engine under the
supervisor and checking the whole loop (see docs/scenarios.md). `kvops scenario run NAME`; those that also run on
the real vLLM behind the gateway have a module of their own for it (`ENGINE = "vllm"`):
`kvops scenario run NAME --engine vllm`. A module's `SESSION` (a context manager) is what its scenario shares with
the others that name the same one: the scenarios named in one command run in one such session, opened for the first
(the vLLM ones: one vLLM start for all of them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from kvops.scenarios.runner import ScenarioResult

MODULES = (
    "s01_capacity", "s02_oom_runtime", "s03_block_size", "s04_tenant_pollution", "s05_prompt_variance",
    "s06_prefix_caching_off", "s07_swap_storm", "s08_kv_quant_error", "s09_crash_loop", "s10_clean",
    "s04_tenant_pollution_vllm", "s05_prompt_variance_vllm",
)
ENGINES = ("kvops", "vllm")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[..., ScenarioResult]  # run() alone, or run(session) in an open `session`
    engine: str = "kvops"
    session: Callable[[], AbstractContextManager[Any]] | None = None


def scenarios(engine: str = "kvops") -> dict[str, Scenario]:
    """The scenarios that run on `engine` (kvops's own, or vllm), by name."""
    found: dict[str, Scenario] = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(f"kvops.scenarios.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvops.scenarios.{module_name}":
                raise
            continue
        runs_on = getattr(module, "ENGINE", "kvops")
        if runs_on == engine:
            found[module.NAME] = Scenario(module.NAME, module.TITLE, module.run, runs_on,
                                          getattr(module, "SESSION", None))
    return found
