"""Doctor's sections, registered in the order they run (`SECTIONS`); kvops.doctor.validator runs them.

The order is the order of the report's lines in `--json` (the text groups them under report.SECTIONS'
headings whatever the order): this machine, the config, then the engine — reached (liveness, which reads its
snapshots for the sections after it), its device, its data, its configuration, its cache and its traffic.
Configuration and Environment each have two sections: one about the machine and its config file, checked
before any engine is reached, and one about the engine that was read.
"""

from __future__ import annotations

from kvops.doctor import cache, configuration, data_quality, environment, liveness, traffic
from kvops.doctor.cache import cache_checks
from kvops.doctor.data_quality import data_checks
from kvops.doctor.events import KvEvents
from kvops.doctor.metrics_read import attach_metrics
from kvops.doctor.report import Check, Status
from kvops.doctor.traffic import traffic_checks
from kvops.doctor.validator import Examined, Section
from kvops.kinds import Capability, profile


class MachineEnvironment:
    """The Python stack and the GPU of the machine doctor runs on, when it is the target's."""

    name = environment.SECTION

    def check(self, examined: Examined) -> list[Check]:
        if not examined.machine:
            return []
        return [*environment.python_stack(), environment.accelerator()]


class StaticConfiguration:
    """A `kvops run` config's engines, checked without starting them."""

    name = configuration.SECTION

    def check(self, examined: Examined) -> list[Check]:
        from kvops.engine.config import EngineConfig
        from kvops.schema.errors import ConfigError

        if examined.config is None:
            return []
        checks = []
        for spec in examined.config.engines:
            if not spec.managed:
                checks.append(Check(section=self.name, title=f"[{spec.name}]", status=Status.SKIPPED,
                                    evidence=f"watched engine at {spec.url}: nothing to check statically",
                                    remedy=f"kvops doctor --url {spec.url}"))
                continue
            try:
                engine_config = EngineConfig(**spec.args)
            except ConfigError as exc:
                checks.append(Check(section=self.name, title=f"[{spec.name}] engine settings", status=Status.FAIL,
                                    evidence=str(exc)))
                continue
            checks.extend(configuration.static_checks(spec.name, engine_config))
        return checks


class Liveness:
    """Whether the engine answers, and reading it: the snapshots (and profiles) the sections after it check."""

    name = liveness.SECTION

    def check(self, examined: Examined) -> list[Check]:
        if examined.metrics_file is not None:
            return liveness.offline(examined)
        if examined.url is None and not examined.local:
            return []
        return liveness.reach(examined)


class EngineDevice:
    """The device and GPU of an engine elsewhere (this machine's say nothing about it)."""

    name = environment.SECTION

    def check(self, examined: Examined) -> list[Check]:
        if examined.local or examined.metrics_file is not None or not examined.snaps:
            return []
        return [environment.engine_device(examined.snaps[-1])]


def _read(checks: list[Check], examined: Examined) -> list[Check]:
    """The lines with the server metrics each one read (for -v)."""
    attach_metrics(checks, examined.snaps[-1])
    return checks


class MetricsData:
    name = data_quality.SECTION

    def check(self, examined: Examined) -> list[Check]:
        return _read(data_checks(examined.snaps), examined) if examined.snaps else []


class EngineConfiguration:
    """The configuration the engine reports, and its block size against the alternatives where it can be
    measured (a kind with kvops's profiles)."""

    name = configuration.SECTION

    def check(self, examined: Examined) -> list[Check]:
        if not examined.snaps:
            return []
        latest = examined.snaps[-1]
        checks = configuration.snapshot_checks(latest)
        if profile(latest.source).can(Capability.PROFILES) or examined.block_profile is not None:
            checks.append(configuration.block_size_check(latest, examined.block_profile, examined.block_why))
        return _read(checks, examined)


class CacheHealth:
    name = cache.SECTION

    def check(self, examined: Examined) -> list[Check]:
        if not examined.snaps:
            return []
        return _read(cache_checks(examined.snaps, examined.kv_profile, examined.kv_why, examined.diagnoses),
                     examined)


class Traffic:
    name = traffic.SECTION

    def check(self, examined: Examined) -> list[Check]:
        return _read(traffic_checks(examined.snaps, examined.diagnoses), examined) if examined.snaps else []


# KvEvents runs last: it waits out the window it listens for (--events), which the sections before it overlap.
SECTIONS: tuple[Section, ...] = (MachineEnvironment(), StaticConfiguration(), Liveness(), EngineDevice(),
                                 MetricsData(), EngineConfiguration(), CacheHealth(), Traffic(), KvEvents())
