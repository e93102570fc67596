"""The fix lease: two supervisors watch one engine (high availability), both diagnose and alert, only the one that
holds the lease applies fixes (docs/deployment.md, "Two supervisors, one engine").

The lease is a small JSON file both supervisors reach (`[supervisor] fix_lease`, on a shared volume when they run on
different hosts): who holds it, how to reach the holder, when it was renewed and when it expires. Every read and
write of it happens under `fcntl.flock` of a sibling lock file, so two supervisors never both find it free and both
take it. The holder renews it every evaluation; the other supervisor (the standby) takes it once it has expired,
which is how a holder that died (`kill -9`, a lost host) is replaced within the lease's TTL. A holder that stops
cleanly releases it, and the standby takes it at its next evaluation.

Times are wall-clock (`time.time`): the file crosses processes and hosts, and a monotonic clock means nothing in
another process. Hosts sharing a lease therefore need synchronized clocks (NTP); an offset shortens or lengthens
the lease by as much.

A lease file that cannot be read or parsed is logged and taken as expired, then rewritten (by its holder at once, by
another supervisor a TTL after it found it so, in case the holder is alive): a torn or hand-edited file must neither
leave the engine with no supervisor applying fixes, nor make two apply them, nor stop the supervisor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.supervisor.fix_lease")

LOCK_WAIT_S = 1.0  # the other supervisor holds the lock for one read and one write: milliseconds, unless its disk hangs
Role = Literal["holder", "standby", "alone"]


class LeaseRecord(BaseModel):
    """The lease file's JSON, written by whichever supervisor holds the lease."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    holder: str  # host:pid:random, unique per supervisor process
    url: str  # the holder's external URL: where a person applies or reverts fixes
    renewed_at: float  # unix seconds
    expires_at: float  # unix seconds; after it, any supervisor may take the lease


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What GET /api/fix-lease and /health show."""

    role: Role
    this_supervisor: str | None = None
    holder: str | None = None  # the holder as last read (None: nobody holds it, or it could not be read)
    holder_url: str | None = None
    expires_at: float | None = None
    path: str | None = None
    ttl_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ALONE = LeaseView(role="alone")  # no lease configured: this supervisor applies fixes by itself, as before HA


def new_holder_id() -> str:
    # The random part tells apart two supervisors that share a host and a recycled pid (containers often run as pid 1).
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def lease_problem(path: Path) -> str:
    """Why a supervisor could not keep its lease at `path` ("" when it can), checked without creating anything, for
    the config's validation: the nearest folder that exists must be writable, and neither the lease nor its lock
    may be a folder."""
    for taken in (path, lock_path(path)):
        if taken.is_dir():
            return f"{taken} is a folder: give the path of a file"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder, so {path} cannot be created in it"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user, so the lease cannot be written there"
    return ""


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


class LeaseBusy(Exception):
    """The lock stayed taken for LOCK_WAIT_S: this evaluation goes without reading the lease."""


class FixLease:
    """One supervisor's side of the lease: `renew` every evaluation (acquires it when free or expired), `held` before
    anything that applies a fix, `release` on a clean stop."""

    def __init__(self, path: Path, ttl_s: float, url: str, holder: str | None = None,
                 clock: Callable[[], float] = time.time, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self.url = url
        self.holder = holder or new_holder_id()
        self.clock = clock
        self.lock_wait_s = lock_wait_s
        self.seen: LeaseRecord | None = None  # the lease as last read or written: ours, or the other holder's
        self._held_until = 0.0  # held while the clock is before this: the expiry we last wrote
        self._was_held: bool | None = None  # for logging the switches (None: before the first renewal)
        self._last_problem = ""  # the last read/write problem logged, so a lasting one is logged once
        self._damaged_since: float | None = None  # when this supervisor first found the lease file unreadable
        try:  # at start, not at the first renewal: a lease that cannot be kept is a start error, said at once
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as exc:
            raise ConfigError(f"supervisor.fix_lease: cannot create {lock_path(path)} beside the lease: "
                              f"{exc.strerror or exc}") from None

    # ------------------------------------------------------------------ state

    def held(self) -> bool:
        """This supervisor holds the lease now. Read from what it last wrote, not from the file: a holder that
        cannot renew (its disk hangs) stops applying fixes when its lease expires, as the standby starts."""
        return self.clock() < self._held_until

    def view(self) -> LeaseView:
        seen = self.seen if self.seen is not None and self.seen.expires_at > self.clock() else None
        return LeaseView(role="holder" if self.held() else "standby", this_supervisor=self.holder,
                         holder=seen.holder if seen else None, holder_url=seen.url if seen else None,
                         expires_at=seen.expires_at if seen else None, path=str(self.path), ttl_s=self.ttl_s)

    # -------------------------------------------------------------- renewing

    def renew(self) -> bool:
        """Acquire the lease when nobody holds it (or its holder's has expired), renew it when this supervisor
        does; True when held afterwards. Never raises: a lease that cannot be read or written this time is
        logged, and this supervisor keeps what it held until that expires."""
        now = self.clock()
        try:
            with self._locked():
                current, damage = self._read()
                if damage and not self._may_replace_damaged(damage, now):
                    self.seen, self._held_until = None, 0.0
                elif current is None or current.holder == self.holder or current.expires_at <= now:
                    self._write(LeaseRecord(holder=self.holder, url=self.url, renewed_at=now,
                                            expires_at=now + self.ttl_s))
                    if current is not None and current.holder != self.holder:
                        log.warning("fix lease taken over: its holder did not renew it", previous_holder=current.holder,
                                    previous_url=current.url, expired_s_ago=round(now - current.expires_at, 2))
                else:
                    self.seen, self._held_until = current, 0.0
            self._problem("")
        except (OSError, LeaseBusy) as exc:
            self._problem(f"fix lease not renewed ({self.path}): {exc}; this supervisor keeps what it held until it "
                          "expires")
        held = self.held()
        self._note_switch(held)
        return held

    def release(self) -> None:
        """On a clean stop: remove the lease if this supervisor holds it, so the standby takes it at its next
        evaluation instead of after the TTL."""
        try:
            with self._locked():
                current, _ = self._read()
                if current is not None and current.holder == self.holder:
                    self.path.unlink(missing_ok=True)
                    log.info("fix lease released", holder=self.holder)
        except (OSError, LeaseBusy) as exc:  # the standby then takes it when it expires
            log.warning("fix lease not released; the standby takes it when it expires", path=str(self.path),
                        error=str(exc))
        self._held_until = 0.0

    # ---------------------------------------------------------------- the file

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(lock_path(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Not a blocking flock: a lock holder stuck on a hung volume must not stall this supervisor's poll loop.
            deadline = time.monotonic() + self.lock_wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise LeaseBusy(f"the lock {lock_path(self.path)} stayed taken for {self.lock_wait_s:g} s"
                                        ) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing the descriptor lets go of the lock

    def _read(self) -> tuple[LeaseRecord | None, str]:
        """The lease in the file (None when there is none), and what is wrong with the file when it cannot be read
        or parsed ("" when nothing is)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None, ""
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"unreadable ({exc})"
        try:
            record = LeaseRecord.model_validate_json(text)
        except ValidationError as exc:
            return None, f"corrupt ({exc.errors()[0].get('msg', 'invalid')}; it holds {text[:120]!r})"
        self._damaged_since = None
        return record, ""

    def _may_replace_damaged(self, damage: str, now: float) -> bool:
        """A lease file that cannot be read is taken as expired: its holder rewrites it at once; another supervisor
        gives it one TTL from when it first found it so, since a live holder rewrites it at its next renewal and two
        supervisors must never both hold the lease. Logged, never raised."""
        if self.held():
            log.warning(f"fix lease file {damage}: rewritten by its holder", path=str(self.path))
            return True
        if self._damaged_since is None:
            self._damaged_since = now
            log.warning(f"fix lease file {damage}: taken as expired, and rewritten in {self.ttl_s:g} s unless its "
                        "holder rewrites it first", path=str(self.path))
        if now - self._damaged_since < self.ttl_s:
            return False
        log.warning(f"fix lease file {damage}: nobody rewrote it for {self.ttl_s:g} s; taken and rewritten",
                    path=str(self.path))
        self._damaged_since = None
        return True

    def _write(self, record: LeaseRecord) -> None:
        # A temp file renamed over the lease: a reader never sees half of it. No fsync: after a crash of the host the
        # lease is the dead holder's anyway, and a file the crash tore is read as expired.
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(record.model_dump_json())
        os.replace(tmp, self.path)
        self.seen, self._held_until = record, record.expires_at

    # ---------------------------------------------------------------- logging

    def _problem(self, problem: str) -> None:
        if problem and problem != self._last_problem:
            log.warning(problem)
        elif not problem and self._last_problem:
            log.info("fix lease readable again", path=str(self.path))
        self._last_problem = problem

    def _note_switch(self, held: bool) -> None:
        """Log each switch between holder and standby (a lost lease as a warning: fixes stop being applied here)."""
        was, self._was_held = self._was_held, held
        if held == was:
            return
        if held:
            log.info("fix lease acquired: this supervisor applies fixes", holder=self.holder, url=self.url,
                     ttl_s=self.ttl_s, path=str(self.path))
            return
        seen = self.seen if self.seen is not None and self.seen.holder != self.holder else None
        (log.warning if was else log.info)(
            "fix lease lost: standby, fixes are only proposed here" if was else
            "fix lease held by another supervisor: standby, fixes are only proposed here",
            holder=seen.holder if seen else None, holder_url=seen.url if seen else None, path=str(self.path))
