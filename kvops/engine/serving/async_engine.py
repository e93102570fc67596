"""The engine behind a server: one thread runs the step loop, asyncio tasks stream the outputs.

Everything that touches the engine's state (adding, aborting, admin changes, snapshots) runs on
the step-loop thread, submitted through `call`, so the scheduler and the block manager never
see two threads at once. The one exception is `/stats` while someone polls it: the step loop keeps a
snapshot built for it between steps (`snapshot_cache.py`), invalidated by every command and by
every step that finishes a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from kvops.engine.engine import LLMEngine, RequestOutput
from kvops.engine.sampling import SamplingParams
from kvops.engine.serving.metrics import EngineMetrics
from kvops.engine.serving.snapshot_cache import SnapshotCache

log = structlog.get_logger("kvops.engine.loop")

T = TypeVar("T")
IDLE_POLL_S = 0.5  # an idle loop looks for commands (and idle work) this often


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    tenant: str
    arrival: float
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics  # request latencies are observed as outputs are dispatched
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvops-step-loop", daemon=True)
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self.accepting = True
        self.snapshots = SnapshotCache(engine.snapshot)
        self._go: threading.Event | None = None  # set when the loop's thread already runs (`built_on_loop_thread`)

    @classmethod
    def built_on_loop_thread(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine on the thread that will then run its steps; the runner is returned once the engine
        is built (not started), and the build's exception is raised here.

        Why one thread: OpenMP gives each thread that enters a parallel region a pool of its own. An engine
        built on the main thread (loading weights and timing matmuls there) and stepped on another leaves the
        main thread's idle pool beside the step loop's: more OpenMP threads than CPUs, so libgomp stops
        spinning between regions and every parallel op of a step waits for its workers to be woken. One
        stream's decode step measured 12% slower that way (docs/benchmarks.md, "One thread for the engine")."""
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        go = threading.Event()
        holder: list[AsyncEngine] = []  # the runner, once made: the thread steps it after `start`

        def main() -> None:
            try:
                built.set_result(build())
            except BaseException as exc:  # handed to the caller, who reports it
                built.set_exception(exc)
                return
            go.wait()
            holder[0]._run()

        thread = threading.Thread(target=main, name="kvops-step-loop", daemon=True)
        thread.start()
        runner = cls(built.result())
        runner._thread, runner._go = thread, go
        holder.append(runner)
        return runner

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._go is not None:
            self._go.set()
        else:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._go is not None:
            self._go.set()  # a loop never started runs, sees the stop, and ends
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def drain(self, timeout: float) -> bool:
        """Stop accepting requests and wait for the running ones to finish; True when drained."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not await asyncio.wrap_future(self.call(self.engine.has_unfinished)):
                return True
            await asyncio.sleep(0.05)
        return False

    # ------------------------------------------------------------ requests

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the step-loop thread between steps; its result or exception lands in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine's step loop is not running"))
            return future
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        tenant: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them. Leaving early (a client that went
        away, a cancelled task) aborts the request, so its blocks are released."""
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), tenant, time.monotonic())
        self._streams[request_id] = stream
        finished = False
        try:
            await self.run(lambda: self.engine.add_request(prompt, params, request_id=request_id, tenant=tenant))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                self.call(lambda: self.engine.abort_request(request_id))

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._run_commands()
                if self.engine.has_unfinished() or self.engine.block_manager.pending_free:
                    outputs = self.engine.step()  # a step also reclaims aborted blocks
                    if any(out.finished for out in outputs):
                        self.snapshots.invalidate()  # before its client can see it finished
                    self._dispatch(outputs)
                    self.snapshots.refresh_if_polled()
                elif not self.engine.idle():  # idle work runs a slice at a time, requests first
                    self._wakeup.wait(IDLE_POLL_S)
                    self._wakeup.clear()
        except BaseException as exc:  # the loop must never die silently: /health reports it
            self.error = exc
            log.exception("step loop crashed")
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(f"engine failed: {exc}"))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            self.snapshots.invalidate()  # whatever it changes, its caller may read back at once
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                self._observe(stream, out, now)
            stream.last_token = now
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        metrics = self.metrics
        assert metrics is not None
        if stream.last_token is None:
            metrics.observe_time_to_first_token(stream.tenant, now - stream.arrival)
        else:
            metrics.observe_inter_token_latency(stream.tenant, now - stream.last_token)
        if out.finished:
            metrics.observe_e2e_latency(stream.tenant, now - stream.arrival)
            metrics.observe_request_finished(stream.tenant, len(out.prompt_token_ids), len(out.token_ids),
                                             out.finish_reason or "unknown")
