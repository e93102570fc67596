"""Metrics data: values the server reported that cannot be right. Shown apart from the diagnoses, because
every diagnosis below reads these numbers; the checks are kvops.adapters.plausibility's, which `kvops run`
uses too."""

from __future__ import annotations

from kvops.adapters.plausibility import problems
from kvops.doctor.report import Check, Status
from kvops.kinds import Capability, profile_of
from kvops.schema.snapshot import Snapshot

SECTION = "Metrics data"
REMEDY = ("check what answers at this address (one server, not a proxy mixing several) and its metrics exporter; "
          "diagnoses that read these values are unreliable")


def data_checks(snaps: list[Snapshot]) -> list[Check]:
    latest = snaps[-1]
    found = problems(snaps)
    if found:
        return [Check(section=SECTION, title="Implausible data", status=Status.WARN, evidence=problem, remedy=REMEDY)
                for problem in found]
    if profile_of(latest).can(Capability.STATS):
        return []  # a kind that serves its whole snapshot (a kvops engine) checks it by the snapshot's invariants
    return [Check(section=SECTION, title="Plausible data", status=Status.OK,
                  evidence="ratios within 0..1, histograms spread over their buckets, counters not going backwards")]
