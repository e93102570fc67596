"""Doctor's sections as validators, and the runner that keeps one broken section from costing the report.

A section is anything with a `name` (the heading its lines go under, one of report.SECTIONS) and
`check(examined) -> lines`: it reads what doctor has found out about the target (`Examined`) and says nothing
when what it checks is not there (no snapshot, no config). kvops.doctor.sections lists them in the order
they run. A section that raises becomes one "could not check: <error>" line under its heading, marked `[!]`
(so the exit code is 1: part of the target went unchecked, which a script must not read as clean), and the
sections after it run as usual: flutter doctor's crash isolation. Never a traceback, never a lost report.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvops.doctor.report import Check, Report, Status

if TYPE_CHECKING:
    from kvops.adapters.prometheus import Scrape
    from kvops.doctor.listening import Listening
    from kvops.schema.diagnosis import Diagnosis
    from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
    from kvops.schema.snapshot import Snapshot
    from kvops.supervisor.config import KvopsConfig

CRASHED_REMEDY = "a bug in kvops doctor: please report it with this output (-v shows where it raised); the other " \
                 "sections were checked as usual"
FRAMES_SHOWN = 4  # the innermost frames of a section that raised, shown with -v
ROOT = Path(__file__).resolve().parents[2]  # where kvops's sources sit: frames are named from there


@dataclass
class Examined:
    """What doctor knows about its target: what was asked for, then what reading it found (the liveness
    section fills in the snapshots, kind and profiles of an engine it reaches)."""

    machine: bool = False  # this machine is part of the target: its Python stack and GPU are checked
    config: KvopsConfig | None = None  # a `kvops run` config to check statically
    url: str | None = None  # an engine to reach
    local: bool = False  # the engine is this machine's (a plain `kvops doctor`)
    metrics_file: Path | None = None  # an offline scrape, read into `scrape` and `snaps`
    timeout_s: float = 5.0
    admin_token: str | None = None
    kv_quant: bool = False  # also take the KV quantization error profile
    slo: dict[str, dict[str, float]] = field(default_factory=dict)  # rule settings by rule id (latency SLOs)
    events: Listening | None = None  # the engine's KV event stream doctor listens to (--events)
    # What reading the target found.
    kind: str | None = None
    scrape: Scrape | None = None
    snaps: list[Snapshot] = field(default_factory=list)
    kv_profile: KVQuantProfile | None = None
    kv_why: str = ""  # why there is no KV quantization profile
    block_profile: BlockSizeProfile | None = None
    block_why: str = ""  # why there is no block-size profile

    @cached_property
    def diagnoses(self) -> list[Diagnosis]:
        """The rules over the snapshots, once: Cache health and Traffic both report them."""
        from kvops.doctor.cache import evaluate

        found, _ = evaluate(self.snaps, self.kv_profile, self.slo)
        return found


class Section(Protocol):
    name: str  # the heading its lines go under (report.SECTIONS)

    def check(self, examined: Examined) -> list[Check]: ...


def run_sections(report: Report, examined: Examined, sections: tuple[Section, ...]) -> None:
    """Each section's lines into the report, in order; one that raises leaves a "could not check" line."""
    for section in sections:
        try:
            lines = section.check(examined)
        except Exception as exc:  # any bug in one section: the report must still come out whole
            lines = [crashed(section.name, exc)]
        for line in lines:
            report.add(line)


def crashed(name: str, exc: BaseException) -> Check:
    """The line of a section that raised: what raised, and where (the innermost frame in the evidence, a few
    more with -v)."""
    frames = traceback.extract_tb(exc.__traceback__)[-FRAMES_SHOWN:]
    where = f" (in {_frame(frames[-1])})" if frames else ""
    return Check(section=name, title=name, status=Status.WARN,
                 evidence=f"could not check: {_error(exc)}{where}", remedy=CRASHED_REMEDY,
                 detail=[f"raised in {_frame(frame)}" for frame in reversed(frames)])


def _error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _frame(frame: Any) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return f"{shown}:{frame.lineno} {frame.name}"
