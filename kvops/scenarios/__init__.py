"""Fault scenarios: one per diagnosis, each reproducing the fault on the real engine under the
supervisor and checking the whole loop (see docs/scenarios.md). `kvops scenario run NAME`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from kvops.scenarios.runner import ScenarioResult

MODULES = (
    "s01_capacity", "s02_oom_runtime", "s03_block_size", "s04_tenant_pollution", "s05_prompt_variance",
    "s06_prefix_caching_off", "s07_swap_storm", "s08_kv_quant_error", "s09_crash_loop", "s10_clean",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[], ScenarioResult]


def scenarios() -> dict[str, Scenario]:
    found: dict[str, Scenario] = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(f"kvops.scenarios.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvops.scenarios.{module_name}":
                raise
            continue
        found[module.NAME] = Scenario(module.NAME, module.TITLE, module.run)
    return found
