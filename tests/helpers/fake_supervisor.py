"""A stand-in for the supervisor's HTTP API in `kvops top` tests: the `SupervisorClient` interface
over synthetic snapshots (tests/helpers/synthetic.py). The real API is covered end to end by
test_supervisor.py and test_top_embedded.py; this keeps the app tests fast and their screens fixed."""

from __future__ import annotations

from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.engines import EngineEntry, LogLine
from kvops.schema.snapshot import Snapshot
from kvops.top.client import SupervisorRefused, SupervisorUnreachable
from tests.helpers.synthetic import T0, snapshot

TENANTS = {
    "alice": {"blocks_held": 300, "blocks_owned": 320, "quota_blocks": 400, "hit_rate": 0.9,
              "evictions_caused": 1, "evictions_suffered": 50},
    "bob": {"blocks_held": 100, "blocks_owned": 100, "quota_blocks": None, "hit_rate": 0.2,
            "evictions_caused": 70, "evictions_suffered": 0},
    "carol": {"blocks_held": 200, "blocks_owned": 210, "quota_blocks": 250, "hit_rate": 0.5,
              "evictions_caused": 5, "evictions_suffered": 5},
}


class FakeSupervisor:
    """The SupervisorClient interface over synthetic snapshots; `down` makes every call fail."""

    url = "http://fake-supervisor"

    def __init__(self, admin_token: str | None = "secret") -> None:
        self.admin_token = admin_token
        self.down = False
        self.applied: list[tuple[str, str, str]] = []
        self.reverted: list[int] = []
        self.log_requests: list[str] = []
        self.jobs: list[dict[str, object]] = []  # GET /api/fixes: none running unless a test adds one
        self.log_lines = [("info", "engine started"), ("warning", "preempted 2 sequences"),
                          ("error", "request failed: prompt too long")]
        self.snaps = {
            "gpu-a": [snapshot(T0 - 10 + i, tenants=TENANTS,
                               requests={"generation_tokens_total": 64_000 + 100 * i}) for i in range(11)],
            "gpu-b": [snapshot(T0 - 10 + i, engine={"model": "Other-Model", "block_size": 32}) for i in range(11)],
        }
        fix = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": "bob", "blocks": 200},
                  description="cap bob at 200 blocks")
        self.diags = [
            Diagnosis(rule="noisy_tenant", engine="gpu-a", subject="bob", severity=Severity.WARNING,
                      title="A tenant evicts the others",
                      summary=("bob caused 70 evictions of other tenants' blocks in 60 s with a 20% hit rate of its "
                               "own; victims (alice, carol) lost 35% hit rate"),
                      evidence={"evictions_caused": 70}, fix=fix),
            Diagnosis(rule="low_hit_rate", engine="gpu-b", severity=Severity.INFO, title="Low hit rate",
                      summary="hit rate 20%", evidence={"hit_rate": 0.2}),
        ]
        # With the `suggest` policy the supervisor records "proposed" again each time a diagnosis
        # resolves and comes back: the same proposal three times, then the fix applied.
        proposed = [AuditEntry(id=4 + i, time=T0 - 40 + 10 * i, engine="gpu-a", rule="noisy_tenant", subject="bob",
                               action="proposed", fix=fix) for i in range(3)]
        self.entries = [*proposed, AuditEntry(id=7, time=T0 - 5, engine="gpu-a", rule="noisy_tenant", subject="bob",
                                              action="applied", fix=fix, message="quota set")]

    def _check(self) -> None:
        if self.down:
            raise SupervisorUnreachable(f"supervisor at {self.url} unreachable: ConnectError: refused")

    def engines(self) -> list[EngineEntry]:
        self._check()
        return [EngineEntry(name=name, url=f"http://{name}", up=True, pid=1) for name in self.snaps]

    def snapshot(self, name: str) -> Snapshot:
        self._check()
        if name not in self.snaps:
            raise SupervisorRefused(f"GET /api/engines/{name}/snapshot: HTTP 404: no engine", 404)
        return self.snaps[name][-1]

    def history(self, name: str, seconds: float = 60.0) -> list[Snapshot]:
        self._check()
        return list(self.snaps.get(name, [])[:-1])

    def diagnoses(self) -> list[Diagnosis]:
        self._check()
        return list(self.diags)

    def audit(self) -> list[AuditEntry]:
        self._check()
        return list(self.entries)

    def fixes(self) -> list[dict[str, object]]:
        self._check()
        return list(self.jobs)

    def logs(self, name: str, lines: int = 100) -> list[LogLine]:
        self._check()
        self.log_requests.append(name)
        return [LogLine(time=T0 - 3 + i, stream="stderr", level=level, text=f"{name}: {text}")
                for i, (level, text) in enumerate(self.log_lines)][-lines:]

    def apply_fix(self, engine: str, rule: str, subject: str = "") -> AuditEntry:
        self._check()
        self.applied.append((engine, rule, subject))
        return AuditEntry(id=8, time=T0, engine=engine, rule=rule, subject=subject, action="applied")

    def revert_fix(self, entry_id: int) -> AuditEntry:
        self._check()
        self.reverted.append(entry_id)
        return AuditEntry(id=9, time=T0, engine="gpu-a", rule="noisy_tenant", action="reverted")
