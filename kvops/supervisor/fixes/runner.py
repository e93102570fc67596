"""The threads fix jobs run on: one worker per engine takes that engine's queue one job at a time, so a
restart that takes minutes holds up neither the poll loop nor the other engines.

The runner knows nothing of what a job does: `FixJobs` (kvops.supervisor.fixes.jobs) owns a runner and hands it
the function that runs one job's life, and the one that closes a job whose run raised.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import structlog

from kvops.supervisor.fixes.state import FixJob

log = structlog.get_logger("kvops.supervisor.fixes")


class JobRunner:
    def __init__(self, lock: threading.RLock, run: Callable[[FixJob], None],
                 crashed: Callable[[FixJob, Exception], None]) -> None:
        """`lock` guards the queues together with the jobs their owner tracks (shared with it); `run` runs one
        job until it ends or waits in `reverting`; `crashed` closes a job whose run raised."""
        self.lock = lock
        self.run = run
        self.crashed = crashed
        self.stopping = threading.Event()
        self.queues: dict[str, deque[FixJob]] = {}
        self.workers: dict[str, threading.Thread] = {}
        self.engine_locks: dict[str, threading.Lock] = {}

    def track(self, engine: str) -> None:
        """The engine's lock, held while a job is judged or undone: a revert by request takes it too."""
        self.engine_locks.setdefault(engine, threading.Lock())

    def engine_lock(self, engine: str) -> threading.Lock:
        return self.engine_locks[engine]

    def enqueue(self, job: FixJob) -> None:
        """Behind the engine's other jobs; the caller holds the lock and wakes the engine after."""
        self.queues.setdefault(job.engine, deque()).append(job)

    def dequeue(self, job: FixJob) -> None:
        """A queued job cancelled before it ran (the caller holds the lock)."""
        self.queues.get(job.engine, deque()).remove(job)

    def engines(self) -> list[str]:
        return list(self.queues)

    def wake(self, engine: str) -> None:
        """Start the engine's worker if it is not running (it ends when its queue is empty)."""
        with self.lock:
            worker = self.workers.get(engine)
            if (worker is not None and worker.is_alive()) or self.stopping.is_set():
                return
            worker = threading.Thread(target=self._work, args=(engine,), daemon=True, name=f"kvops-fix-{engine}")
            self.workers[engine] = worker
            worker.start()

    def stop(self, timeout_s: float) -> None:
        """Workers stop at their next tick; a restart in progress finishes first (joined up to the timeout)."""
        self.stopping.set()
        for worker in list(self.workers.values()):
            worker.join(timeout=timeout_s)

    def _work(self, engine: str) -> None:
        while not self.stopping.is_set():
            with self.lock:
                queue = self.queues.get(engine)
                if not queue:
                    self.workers.pop(engine, None)
                    return
                job = queue[0]
            try:
                self.run(job)
            except Exception as exc:  # a bug in one job must not stop the engine's later fixes
                log.exception("fix job failed", engine=engine, job=job.id)
                self.crashed(job, exc)
            with self.lock:
                # A job left `reverting` stays first: the worker retries its undo before any new fix.
                if queue and queue[0] is job and (job.state != "reverting" or self.stopping.is_set()):
                    queue.popleft()
