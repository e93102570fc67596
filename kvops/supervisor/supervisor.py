"""`kvops run`: the supervisor loop.

Every poll interval it checks each managed engine's process (restarting it when it died), reads
each engine's snapshot into its history, evaluates the rules, hands the diagnoses to the
alerter, and proposes, applies and judges fixes by policy. A diagnosis clears only after its rule
has stayed quiet for a while (kvops.supervisor.hysteresis). Profiles that take an engine a few
seconds run in a side thread on their own schedule (kvops.supervisor.probes), so polling never
waits for them. kvops's own faults (rules that raise, alerts that cannot be delivered) are
counted for /metrics and raised as diagnoses of their own (kvops.alerting's self diagnoses). The KV cache
events of the engines that publish them are read all along (kvops.supervisor.event_feeds) and added to each
poll's snapshot. With `fix_lease` set, two supervisors watch one engine and only the lease's holder applies fixes
(kvops.supervisor.fixes.lease): each evaluation renews it, and a standby proposes what the holder would apply.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import structlog

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.adapters.plausibility import backwards, snapshot_problems
from kvops.alerting import Alerter
from kvops.events.endpoint import EventSource
from kvops.history import EngineHistory, HealthSample, at_start
from kvops.kinds import Capability, profile_of
from kvops.rules import evaluate_all
from kvops.schema.diagnosis import Diagnosis, Severity
from kvops.schema.engines import GatewayLink
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.collection import Collection
from kvops.supervisor.config import KvopsConfig
from kvops.supervisor.engine_spec import EngineSpec
from kvops.supervisor.event_feeds import EventFeeds
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.gateway import GatewayAdmin
from kvops.supervisor.fixes.jobs import Target, real_judge
from kvops.supervisor.fixes.lease import FixLease
from kvops.supervisor.fixes.manager import FixManager
from kvops.supervisor.gateway_tenants import GatewayTenants
from kvops.supervisor.hysteresis import Hysteresis
from kvops.supervisor.managed_engine import ManagedEngine
from kvops.supervisor.managed_gateway import GatewayHandle
from kvops.supervisor.poll_timing import PollTiming
from kvops.supervisor.probes import ProbeRefused, Probes
from kvops.tenancy.labels import TenantLabels
from kvops.watching import WatchedEngineClient

log = structlog.get_logger("kvops.supervisor")

DATA_WINDOW_S = 60.0  # implausible data is judged over the last minute's snapshots


@dataclass
class EngineState:
    spec: EngineSpec
    history: EngineHistory
    client: EngineClient
    probes: Probes
    managed: ManagedEngine | None = None
    last_error: str = ""
    ready: bool = False  # answered since its last (re)start
    diagnoses: list[Diagnosis] = field(default_factory=list)
    process_seen: object = None  # the managed process last polled: a different one means a (re)start
    data_problems: list[str] = field(default_factory=list)  # kvops.adapters.plausibility's, latest poll
    counters_backwards: dict[str, tuple[float, str]] = field(default_factory=dict)  # counter -> (seen at, problem)
    gateway: GatewayHandle | None = None  # the `kvops gateway` in front of it ([engines.gateway])
    gateway_admin: GatewayAdmin | None = None  # fixes of kind gateway go through it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.managed.url if self.managed else str(self.spec.url)


class Supervisor:
    def __init__(self, config: KvopsConfig, admin_token: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.admin_token = admin_token
        self.clock = clock
        self.started_at = clock()
        state_dir = config.state_path
        state_dir.mkdir(parents=True, exist_ok=True)
        settings = config.supervisor
        self.external_url = settings.external_url or f"http://{settings.listen}"
        # High availability: with a lease configured, fixes are applied only while this supervisor holds it. First: a
        # lease it cannot keep is a start error (ConfigError), before anything is opened or started.
        lease_path = settings.fix_lease_path
        self.fix_lease = None if lease_path is None else FixLease(lease_path, settings.fix_lease_ttl_s,
                                                                  self.external_url, clock=clock)
        self.alerter = Alerter(config.alerting, state_dir, self.external_url, clock=clock)
        self.rule_settings = config.rule_settings()
        self.engines: dict[str, EngineState] = {}
        # Rules run on every n-th poll: evaluation_interval_s in polls, counted rather than timed so that a
        # late poll does not skip an evaluation. Polled faster than that, the history keeps one snapshot per
        # evaluation interval (otherwise every one: thinning a 0.4 s poll to 0.5 s would keep one in two).
        self.evaluate_every = max(1, round(settings.evaluation_interval_s / settings.poll_interval_s))
        resolution_s = settings.evaluation_interval_s if self.evaluate_every > 1 else 0.0
        for spec in config.engines:
            history = EngineHistory(spec.name, managed=spec.managed, resolution_s=resolution_s)
            probes = Probes(spec.name, history, settings.block_size_profile, clock=clock)
            if spec.managed:
                managed = ManagedEngine(spec, history, clock=clock)
                state = EngineState(spec, history, managed.client(), probes, managed)
            else:
                token = _env(spec.admin_token_env)
                # Any server: kvops engines through /stats, the other kinds through /metrics (kvops.kinds).
                state = EngineState(spec, history, WatchedEngineClient(str(spec.url), spec.kind, token), probes)
            if spec.gateway is not None:
                state.gateway = GatewayHandle(spec.name, spec.gateway, state_dir, clock=clock, history=history)
                state.gateway_admin = GatewayAdmin(state.gateway.url, state.gateway.admin_token)
            self.engines[spec.name] = state
        self.event_feeds = EventFeeds({name: found for name, state in self.engines.items()
                                       if (found := _event_source(state.spec, state.managed)) is not None},
                                      clock=clock)
        self.gateway_tenants = GatewayTenants({name: state.gateway.url for name, state in self.engines.items()
                                               if state.gateway is not None})
        # The `tenant` labels of each engine's series on the supervisor's /metrics, kept across scrapes.
        self.tenant_labels: defaultdict[str, TenantLabels] = defaultdict(TenantLabels)
        self.hysteresis = Hysteresis(config.clear_for_s)
        self.rule_errors: Counter[tuple[str, str]] = Counter()  # (rule, engine) -> evaluations that raised
        self.fixes = FixManager(AuditLog(state_dir / "audit.jsonl"), self._target, settings.verify_after_s,
                                state_path=state_dir / "fix_jobs.json", cooldown_s=settings.fix_cooldown_s,
                                inconclusive=settings.inconclusive, revert_retry_s=settings.revert_retry_s,
                                judge=partial(real_judge, settings=settings.judge), clock=clock)
        # Before the managed engines start: they start on their last good settings, and pending jobs resume.
        self.fixes.resume({name: (dict(s.spec.args), partial(_set_args, s.managed))
                           for name, s in self.engines.items() if s.managed is not None})
        self.fixes.standby = self.standby_reason
        self.diagnoses: list[Diagnosis] = []
        self.polls_total = 0
        self.poll_errors: dict[str, int] = {name: 0 for name in self.engines}
        self.last_poll_s = 0.0
        self.timing = PollTiming(settings.poll_interval_s)
        self.collection = Collection()  # the garbage collector, between poll cycles
        self._stop = threading.Event()
        # Engines are read side by side: one that hangs until its timeout must not delay the others' snapshots.
        self._readers = ThreadPoolExecutor(max_workers=min(16, len(self.engines)), thread_name_prefix="kvops-poll")
        self._thread = threading.Thread(target=self._run, name="kvops-supervisor", daemon=True)
        self._lock = threading.RLock()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.event_feeds.start()  # before the engines: a feed that connects waits for its publisher to bind
        for state in self.engines.values():
            if state.managed is not None:
                state.managed.start()
            if state.gateway is not None:
                state.gateway.start(state.url)  # it may come up before its engine: it answers 502 meanwhile
        self.alerter.start()
        if self.fix_lease is not None:
            self.fix_lease.renew()  # before the API answers: a role from the first request on
        self.fixes.start()
        self._thread.start()
        log.info("supervisor started", engines={s.name: s.url for s in self.engines.values()},
                 listen=self.config.supervisor.listen)

    def stop(self) -> None:
        """Stop polling, drain and stop managed engines, deliver pending alerts."""
        self._stop.set()
        for state in self.engines.values():
            if state.managed is not None:
                state.managed.close()  # a fix job's restart or rollback must not start it behind our back
            if state.gateway is not None:
                state.gateway.stop()  # first: its clients are told the engine is going, not left waiting
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.fixes.stop()
        if self.fix_lease is not None:
            # After the poll loop (which renews it) and the fix workers: the standby takes it at its next evaluation.
            self.fix_lease.release()
        self._readers.shutdown(wait=True)
        for state in self.engines.values():
            if state.managed is not None:
                state.managed.stop()
            state.client.close()
            if state.gateway_admin is not None:
                state.gateway_admin.close()
        self.event_feeds.close()
        self.gateway_tenants.close()
        self.alerter.stop(flush_timeout_s=10.0)
        log.info("supervisor stopped")

    def _run(self) -> None:
        interval = self.config.supervisor.poll_interval_s
        due = time.monotonic()
        self.collection.start()
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.poll_once()
                except Exception:  # one bad cycle must not end supervision
                    log.exception("poll cycle failed")
                self.collection.after_cycle()
                took = time.monotonic() - started
                self.timing.cycle(took, started - due)
                due = started + interval
                self._stop.wait(max(0.0, interval - took))
        finally:
            self.collection.stop()

    # ----------------------------------------------------------------- poll

    def poll_once(self) -> list[Diagnosis]:
        started = time.perf_counter()
        with self._lock:
            now = self.clock()
            list(self._readers.map(lambda state: self._read_engine(state, now), self.engines.values()))
            if self.polls_total % self.evaluate_every:
                self.polls_total += 1
                self.last_poll_s = time.perf_counter() - started
                return self.diagnoses
            raised: list[Diagnosis] = []
            evaluating = time.perf_counter()
            for state in self.engines.values():
                errors: Counter[str] = Counter()
                raised.extend(evaluate_all(state.history, self.rule_settings, now, errors))
                for rule, count in errors.items():
                    self.rule_errors[(rule, state.name)] += count
            self.timing.evaluated(time.perf_counter() - evaluating)
            held = self.hysteresis.update(raised, now)
            by_engine: defaultdict[str, list[Diagnosis]] = defaultdict(list)
            for diagnosis in held:  # grouped once: filtering all of them per engine grew with the fleet squared
                by_engine[diagnosis.engine].append(diagnosis)
            for state in self.engines.values():
                state.diagnoses = by_engine.get(state.name, [])
            diagnoses = held + self.alerter.self_diagnoses(now)
            self.diagnoses = diagnoses
            # Alerts start once the rules have had time to see data: evaluating earlier would resolve
            # the alerts restored from the outbox only to fire them again a minute later.
            if now - self.started_at >= self.config.supervisor.alert_warmup_s:
                self.alerter.evaluate([d for d in diagnoses if d.severity is not Severity.INFO], now)
            # Fixes act on what the rules see now, not on what hysteresis still holds. A standby only proposes them.
            self.fixes.consider(raised, self.config.policy,  # only enqueues: jobs run on their own threads
                                standby=self.standby_reason(renew=True))
            self.polls_total += 1
            self.last_poll_s = time.perf_counter() - started
            return diagnoses

    def _read_engine(self, state: EngineState, now: float) -> None:
        try:
            self._poll_engine(state, now)
        except Exception as exc:  # a bug reading one engine must not stop the others' polls
            self.poll_errors[state.name] += 1
            state.last_error = f"poll failed in kvops: {type(exc).__name__}: {exc}"
            log.exception("poll failed", engine=state.name)

    def _poll_engine(self, state: EngineState, now: float) -> None:
        if state.gateway is not None:
            state.gateway.check()  # a gateway that exited starts again, whatever its engine is doing
        managed = state.managed
        if managed is not None and managed.restarting:
            state.last_error = "restarting for a fix"  # the fix's job watches it; the poll loop does not wait for it
            return
        if managed is not None:
            running = managed.check()
            if managed.process is not state.process_seen:
                state.process_seen = managed.process
                # A new process (maybe with new settings): wait for it to answer before judging it, and
                # measure it afresh.
                state.ready = False
                state.probes.reset()
                self.event_feeds.engine_restarted(state.name, now)
            if not running:
                why = "crash loop: not restarting" if state.history.crash_loop else "engine process exited"
                why = f"{why}; its last lines: {managed.output_tail()}"
                state.history.record_health(HealthSample(now, False, why))
                self.event_feeds.engine_down(state.name, now)
                state.last_error = why
                return
        try:
            snap = state.client.snapshot()
        except EngineUnreachable as exc:
            self.poll_errors[state.name] += 1
            state.last_error = str(exc)
            if state.probes.busy:  # serving pauses while a profile runs: busy, not down
                state.last_error = f"profiling ({state.probes.running.replace('_', '-')}): {exc}"
                return
            # A managed engine still loading its model is not down, until its health timeout passes.
            loading = managed is not None and not state.ready
            if not loading or now - managed.started_at >= state.spec.health_timeout_s:  # type: ignore[union-attr]
                state.history.record_health(HealthSample(now, False, str(exc)))
                self.event_feeds.engine_down(state.name, now)
            return
        state.ready = True
        state.last_error = ""
        snap = self.event_feeds.enrich(state.name, snap, state.history, now)
        snap = self.gateway_tenants.enrich(state.name, snap)
        state.history.record_health(HealthSample(now, True))
        if managed is None and state.history.latest is None and snap.knows("uptime_s"):
            # Joining a server that was already running: its counters were zero when it started, so the
            # rules see what it did since then, as doctor does (rules ignore a start outside their window).
            state.history.add(at_start(snap))
        previous = state.history.latest
        state.history.add(snap)
        self._check_data(state, previous, now)
        if not profile_of(snap).can(Capability.PROFILES):
            return  # the profiles are kvops admin endpoints
        self._schedule_probes(state, snap.engine.kv_cache_dtype != snap.engine.dtype,
                              snap.requests.finished_total, now)

    def _check_data(self, state: EngineState, previous: Snapshot | None, now: float) -> None:
        """Values that cannot be right, over the last minute: kept for the API and /metrics, logged when new. Each
        pair of snapshots is compared once, as it arrives (comparing the minute's every pair again each poll grew
        with the history and was a third of a fleet supervisor's reading)."""
        latest = state.history.latest
        if latest is None:
            return
        if previous is not None:
            for counter, problem in backwards(previous, latest).items():
                state.counters_backwards.setdefault(counter, (now, problem))
        state.counters_backwards = {k: v for k, v in state.counters_backwards.items() if now - v[0] <= DATA_WINDOW_S}
        found = snapshot_problems(latest) + [problem for _, problem in state.counters_backwards.values()]
        for problem in sorted(set(found) - set(state.data_problems)):
            log.warning("implausible metrics data", engine=state.name, problem=problem)
        state.data_problems = found

    def standby_reason(self, renew: bool = False) -> str:
        """Why this supervisor applies no fix now ("" when it does): another supervisor holds the fix lease, named
        with its URL. `renew`: acquire or renew the lease first (each evaluation does)."""
        lease = self.fix_lease
        if lease is None or (lease.renew() if renew else lease.held()):
            return ""
        view = lease.view()
        holder = (f"the fix lease holder {view.holder} at {view.holder_url}" if view.holder else
                  f"whichever supervisor takes the fix lease next (none holds it now: {view.path})")
        return f"this supervisor is the standby: fixes are applied by {holder}"

    def _target(self, engine: str) -> Target:
        state = self.engines[engine]
        return Target(state.client, state.managed, state.history, state.gateway_admin)

    def gateway_status(self, name: str) -> GatewayLink | None:
        """For GET /api/engines: the gateway's reads, and a managed one's process."""
        link = self.gateway_tenants.status(name)
        handle = self.engines[name].gateway
        if link is None or handle is None:
            return link
        return link.model_copy(update=handle.view())

    # --------------------------------------------------------------- probes

    def _schedule_probes(self, state: EngineState, quantized: bool, finished: int, now: float) -> None:
        token = state.client.admin_token
        if state.probes.busy or token is None:
            return
        kv, block_size = state.probes.due(quantized, finished, now)
        if kv or block_size:
            state.probes.start(state.url, token, kv, block_size)

    def profile_block_size(self, engine: str) -> None:
        """On demand: measure the engine's decode step at other block sizes now. ProbeRefused says why not."""
        state = self.engines[engine]
        latest = state.history.latest
        if latest is None or not profile_of(latest).can(Capability.PROFILES):
            raise ProbeRefused(f"{engine}: the block-size profile is a kvops engine's admin call "
                               f"({'no snapshot yet' if latest is None else f'this is {latest.source}'})")
        state.probes.request_block_size(state.url, state.client.admin_token)


def _event_source(spec: EngineSpec, managed: ManagedEngine | None) -> tuple[EventSource, str] | None:
    """Where the engine's KV events come from, and the host a wildcard endpoint is reached at; None: it has none
    kvops reads. A managed engine's launcher knows whether its engine publishes them (a vLLM older than the
    events does not); a watched engine's entry says where."""
    try:
        if managed is not None:
            source = managed.event_source()
            return None if source is None else (source, spec.host)
        source = spec.event_source()
        return None if source is None else (source, urlsplit(str(spec.url)).hostname or "127.0.0.1")
    except Exception:  # the engine is supervised without its events rather than not at all
        log.exception("KV event source not resolved", engine=spec.name)
        return None


def _set_args(managed: ManagedEngine, args: dict[str, Any]) -> None:
    managed.args = args


def _env(name: str | None) -> str | None:
    return os.environ.get(name) if name else None
