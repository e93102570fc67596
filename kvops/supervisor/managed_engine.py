"""A managed engine: `kvops engine serve` or vLLM's server as a child process, kept alive.

The manager starts the engine, waits for `/health`, forwards its log lines (each with its level; the access-log
lines of the supervisor's own polls left out, kvops.supervisor.own_polls), and when it exits
records how (exit code, signal, the last lines of its output) and restarts it with capped
exponential backoff. Too many exits in a window is a crash loop: it stops restarting and says
so, rather than spinning. The child dies with the supervisor (PR_SET_PDEATHSIG on Linux), so a
killed supervisor leaves no orphan engine behind; it runs in a process group of its own, which is
killed whole once the engine has exited, so helpers it forked (vLLM's engine core) go with it. What differs by kind (the
command, the names of settings, whether it publishes KV events) is its launcher (kvops.supervisor.launchers).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import structlog

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.events.endpoint import EventSource
from kvops.history import EngineHistory
from kvops.logs import LineLevels, level_name
from kvops.processes import die_with_parent, reserve_port, start_in_own_session
from kvops.schema.engines import EngineExit, LogLine
from kvops.schema.errors import ConfigError
from kvops.supervisor.engine_spec import EngineSpec
from kvops.supervisor.launchers import client_for, launcher_for
from kvops.supervisor.own_polls import OWN_POLL_PATHS, OwnPolls

log = structlog.get_logger("kvops.supervisor.engine")

STDERR_TAIL_LINES = 40
LOG_TAIL_LINES = 500


class ManagedEngine:
    def __init__(self, spec: EngineSpec, history: EngineHistory, clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.history = history
        self.clock = clock
        self.launcher = launcher_for(spec.kind, spec.start())
        self.args: dict[str, Any] = dict(spec.args)  # current settings; a restart fix changes them
        self.admin_token = secrets.token_urlsafe(24)  # only the supervisor knows it
        try:  # held from now until the supervisor closes: every start and restart binds it
            self._port_hold = reserve_port(spec.host, spec.port or 0)
        except OSError as exc:
            raise ConfigError(f"engine {spec.name!r}: cannot hold port {spec.port} on {spec.host} for it ({exc}): "
                              "another process has it; stop that process or set another `port`") from None
        self.port = int(self._port_hold.getsockname()[1])
        self.url = f"http://{spec.host}:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.log_tail: deque[LogLine] = deque(maxlen=LOG_TAIL_LINES)
        self.own_polls = OwnPolls(self.port)  # counts the access-log lines of our polls it left out
        self._polls_noted = False  # whether this start's log says that they are left out
        self.backoff_s = spec.restart.initial_backoff_s
        self.next_start_at: float | None = None  # when a restart is due
        self.stopping = False
        # A fix's restart in progress (drain, start, health): the poll loop leaves the engine to it, so it never
        # waits on this engine's lock and does not count the planned downtime as the engine being down.
        self.restarting = False
        self.closed = False  # set when the supervisor shuts down: nothing starts the engine again
        self._readers: list[threading.Thread] = []
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvops-spawn-{spec.name}")
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process and self.process.poll() is None else None

    def client(self) -> EngineClient:
        """Reads the engine's snapshot (and, for a kvops engine, drives its admin API)."""
        return client_for(self.spec.kind, self.url, self.admin_token)

    def event_source(self) -> EventSource | None:
        """Where kvops reads this engine's KV events: its config entry's, where its launcher says the engine
        publishes them (a vLLM older than the events does not); None: it reads none."""
        source = self.spec.event_source()
        return source if source is not None and self.launcher.publishes_kv_events() else None

    def settings_with(self, params: dict[str, Any]) -> dict[str, Any]:
        """The current args with a restart fix's settings (kvops names) applied; ValueError when this kind
        of engine has no such setting."""
        return self.launcher.with_settings(self.args, params)

    def output_tail(self, lines: int = 5) -> str:
        """The engine's last output lines, for an error message."""
        return " | ".join(list(self.stderr_tail)[-lines:]) or "(no output)"

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """The supervisor is shutting down: from now on nothing starts this engine again (a fix job's restart
        or rollback still running on its worker thread included)."""
        self.closed = True

    def start(self) -> None:
        with self._lock:
            if self.closed:
                raise EngineUnreachable(f"engine {self.spec.name}: not started, the supervisor is shutting down")
            launch = self.launcher.launch(self.spec.host, self.port, self.args, self.spec.drain_timeout_s,
                                          self.admin_token)
            self.stderr_tail.clear()
            self._polls_noted = False
            # Forked from one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
            # ends, and fix jobs (re)start engines from worker threads that come and go.
            self.process = self._spawner.submit(
                start_in_own_session, launch.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, env=launch.env, cwd=launch.cwd, preexec_fn=die_with_parent).result()
            self.started_at = self.clock()
            self.next_start_at = None
            log.info("engine started", engine=self.spec.name, pid=self.process.pid, url=self.url,
                     args=self.args)
            self._note("info", f"started pid {self.process.pid}: {' '.join(launch.argv[launch.shown_from:])}")
            self._readers = [threading.Thread(target=self._forward, args=(stream, name), daemon=True,
                                              name=f"kvops-engine-{self.spec.name}-{name}")
                             for stream, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))]
            for reader in self._readers:
                reader.start()

    def _read_to_end(self, timeout_s: float = 1.0) -> None:
        """After an exit: let the readers take the engine's last lines (they end at EOF)."""
        for reader in self._readers:
            reader.join(timeout=timeout_s)

    def _forward(self, stream: IO[bytes] | None, name: str) -> None:
        """Engine log lines into the supervisor's log, each with its level (JSON lines are re-emitted field by
        field); the access-log lines of the supervisor's own polls are left out, and counted."""
        if stream is None:
            return
        levels = LineLevels()  # this stream's: a traceback's lines are errors up to its last
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            if self.own_polls.is_own_poll(line):
                self._left_out_poll()
                continue
            if name in self.launcher.tail_streams:
                self.stderr_tail.append(line)
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                event = record.pop("event", "")
                record.pop("timestamp", None)
                level = level_name(str(record.pop("level", "info")))
                fields = " ".join(f"{key}={value}" for key, value in record.items() if key != "logger")
                self.log_tail.append(
                    LogLine(time=time.time(), stream=name, level=level, text=f"{event} {fields}".rstrip()))
                # The supervisor's name for the engine wins over a field of the record's own of that name.
                getattr(log, level)(f"engine: {event}", **{**record, "engine": self.spec.name})
            else:
                level = levels.level(line)
                self.log_tail.append(LogLine(time=time.time(), stream=name, level=level, text=line))
                getattr(log, level)(f"engine: {line}", engine=self.spec.name, stream=name)

    def _left_out_poll(self) -> None:
        """Said once a start, so a log without them does not look like an engine nobody asked anything."""
        if self._polls_noted:
            return
        self._polls_noted = True
        paths = ", ".join(sorted(OWN_POLL_PATHS))
        self._note("info", f"the access-log lines of kvops's own requests ({paths}) are left out of this log")
        log.info("engine: the access-log lines of kvops's own requests are left out of its log", engine=self.spec.name,
                 paths=paths)

    def _note(self, level: str, text: str) -> None:
        self.log_tail.append(LogLine(time=time.time(), stream="kvops", level=level, text=text))

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Block until /health answers; raise EngineUnreachable naming what was waited for."""
        timeout_s = timeout_s or self.spec.health_timeout_s
        deadline = time.monotonic() + timeout_s
        client = client_for(self.spec.kind, self.url, None)
        last_error = "no answer yet"
        try:
            while time.monotonic() < deadline:
                process = self.process
                if process is None or process.poll() is not None:
                    self._read_to_end()
                    raise EngineUnreachable(
                        f"engine {self.spec.name!r} exited with code {process.returncode if process else None} "
                        f"before {self.url}/health answered; its last lines: {self.output_tail()}")
                try:
                    client.health()
                    self.own_polls.learn()  # its connection, before it closes: its line may come after
                    return
                except EngineUnreachable as exc:
                    last_error = str(exc)
                time.sleep(0.2)
        finally:
            client.close()
        raise EngineUnreachable(f"engine {self.spec.name!r} did not answer {self.url}/health within "
                                f"{timeout_s:.0f} s (health_timeout_s); last error: {last_error}")

    def check(self) -> bool:
        """Called every poll: notices an exit, records it, and (re)starts when due. Returns True
        when the process is running."""
        with self._lock:
            now = self.clock()
            process = self.process
            if process is not None and process.poll() is not None:
                self._on_exit(process, now)
            due = self.next_start_at is not None and now >= self.next_start_at
            if self.process is None and due and not self.stopping and not self.closed and not self.history.crash_loop:
                self.history.restarts_total += 1
                self.start()
            if self.process is not None and now - self.started_at >= self.spec.restart.stable_after_s:
                self.backoff_s = self.spec.restart.initial_backoff_s
            return self.process is not None

    def _on_exit(self, process: subprocess.Popen[bytes], now: float) -> None:
        code = process.returncode
        _kill_group(process)  # what the engine forked and left behind
        self._read_to_end()
        event = EngineExit.of(now, code, tuple(self.stderr_tail))
        self.history.record_exit(event)
        self.process = None
        if self.stopping:
            return
        policy = self.spec.restart
        recent = self.history.exits_within(policy.crash_loop_window_s, now)
        how = f"signal {signal.Signals(event.signal).name}" if event.signal else f"exit code {event.exit_code}"
        if len(recent) >= policy.crash_loop_exits:
            self.history.crash_loop = True
            log.error("engine crash loop: not restarting", engine=self.spec.name, exits=len(recent),
                      window_s=policy.crash_loop_window_s, last=how, stderr_tail=list(event.stderr_tail)[-5:])
            self._note("error", f"exited ({how}); crash loop: {len(recent)} exits in "
                                f"{policy.crash_loop_window_s:g} s, not restarting")
            return
        self.next_start_at = now + self.backoff_s
        log.warning("engine exited; restarting", engine=self.spec.name, how=how, in_s=self.backoff_s,
                    stderr_tail=list(event.stderr_tail)[-5:])
        self._note("warning", f"exited ({how}); restarting in {self.backoff_s:g} s")
        self.backoff_s = min(self.backoff_s * 2, policy.max_backoff_s)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM (the engine drains in-flight requests), then SIGKILL after the timeout. After `close()`,
        the spawner thread ends too: nothing will be forked from it again."""
        with self._lock:
            self.stopping = True
            try:
                self._stop_process(timeout_s)
            finally:
                if self.closed:
                    self._spawner.shutdown(wait=False)
                    self._port_hold.close()

    def _stop_process(self, timeout_s: float | None) -> None:
        """The body of `stop`, under its lock."""
        process = self.process
        if process is None or process.poll() is not None:
            self.process = None
            return
        process.send_signal(signal.SIGTERM)  # the server alone: it drains, then stops what it forked
        try:
            process.wait(timeout=(timeout_s or self.spec.drain_timeout_s) + 5)
        except subprocess.TimeoutExpired:
            log.warning("engine did not stop in time; killing it", engine=self.spec.name, pid=process.pid)
            process.kill()
            process.wait()
        _kill_group(process)
        log.info("engine stopped", engine=self.spec.name, exit_code=process.returncode)
        self.process = None

    def restart_with(self, args: dict[str, Any]) -> None:
        """Drain and stop, then start with new settings and wait until healthy (a restart fix). When the
        engine does not come up with them, it is started again with the previous settings and
        EngineUnreachable says why (with the engine's last lines)."""
        previous = dict(self.args)
        self.restarting = True
        try:
            self._restart(args)
            try:
                self.wait_healthy()
            except EngineUnreachable as exc:
                self._note("error", f"did not come up with the new settings; restoring {previous}: {exc}")
                self._restart(previous)
                raise EngineUnreachable(f"{exc}; restarted with the previous settings") from None
        finally:
            self.restarting = False

    def _restart(self, args: dict[str, Any]) -> None:
        with self._lock:
            changed = {k: v for k, v in args.items() if self.args.get(k) != v}
            self._note("info", f"restarting with {changed or 'the same settings'}")
            self.stop()
            self.args = dict(args)
            self.stopping = False
            self.history.crash_loop = False
            self.history.restarts_total += 1
            self.start()

    def resume_after_crash_loop(self) -> None:
        """A person (or a config change) says try again."""
        with self._lock:
            self.history.crash_loop = False
            self.backoff_s = self.spec.restart.initial_backoff_s
            self.next_start_at = self.clock()


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to what is left of the engine's process group (its own session: the group id is its pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
