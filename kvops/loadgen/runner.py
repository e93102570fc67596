"""Running a load: requests on an asyncio loop, in the caller's thread or a background one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvops.loadgen.arrivals import arrival_times
from kvops.loadgen.prompts import PromptBuilder, add_noise, load_tokenizer
from kvops.loadgen.report import LoadReport, RequestRecord, build_timeline, summarize
from kvops.loadgen.spec import LoadError, LoadSpec, Stream


@dataclass
class StreamState:
    """A stream's own random generators (so that one stream's draws never shift another's) and count."""

    stream: Stream
    lengths: random.Random
    text: random.Random
    arrivals: random.Random
    issued: int = 0


@dataclass
class PlannedRequest:
    tenant: str
    prompt: str
    max_tokens: int
    api_key: str | None = None


class Runner:
    """One load run on its own asyncio loop; everything it measured can be read from other threads."""

    def __init__(self, url: str, spec: LoadSpec, builder: PromptBuilder, progress: bool,
                 stop: threading.Event | None) -> None:
        self.url = url
        self.spec = spec
        self.builder = builder
        self.progress = progress
        self.stop_flag = stop or threading.Event()
        self._api_keys = {s.api_key_env: _api_key(s.api_key_env) for s in spec.streams if s.api_key_env}
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        self._end: float | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._results: list[RequestRecord] = []
        self._in_flight: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._peak_total = 0
        self._next_index = 0
        self.states = [
            StreamState(s, random.Random(f"{spec.seed}/{i}/lengths"), random.Random(f"{spec.seed}/{i}/text"),
                         random.Random(f"{spec.seed}/{i}/arrivals"))
            for i, s in enumerate(spec.streams)
        ]

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # -- requests

    def plan(self, state: StreamState) -> PlannedRequest | None:
        stream = state.stream
        if stream.max_requests is not None and state.issued >= stream.max_requests:
            return None
        k = state.issued
        state.issued += 1
        rng = state.text
        record = stream.prompt.records[k % len(stream.prompt.records)] if stream.prompt.records else None
        n_prompt = stream.prompt.sample(state.lengths, k)
        if record is not None and record.output_tokens is not None and "output" not in stream.model_fields_set:
            n_output = record.output_tokens
        else:
            n_output = stream.output.sample(state.lengths, k, "output_tokens")
        text = self.builder.unique(self._next_index, n_prompt, rng)
        self._next_index += 1
        if stream.shared_prefix_tokens:
            group = rng.randrange(stream.prefix_groups)
            text = self.builder.prefix(stream.key, group, stream.shared_prefix_tokens) + text
        if stream.noise and rng.random() < stream.noise:
            text = add_noise(text, rng)
        tenant = record.tenant if record is not None and record.tenant else stream.tenant
        return PlannedRequest(tenant, text, n_output, self._api_keys.get(stream.api_key_env or ""))

    async def _send(self, client: httpx.AsyncClient, planned: PlannedRequest) -> None:
        result = RequestRecord(planned.tenant, self.now())
        with self._lock:
            self._results.append(result)
            n = self._in_flight[planned.tenant] = self._in_flight.get(planned.tenant, 0) + 1
            self._peak[planned.tenant] = max(self._peak.get(planned.tenant, 0), n)
            self._peak_total = max(self._peak_total, sum(self._in_flight.values()))
        body = {"model": self.spec.model, "prompt": planned.prompt, "max_tokens": planned.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "temperature": 0.0, "user": planned.tenant}
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                result.error = await self._stream(client, body, result, planned.api_key)
        except asyncio.CancelledError:
            result.cancelled = True
            raise
        except TimeoutError:
            result.error = f"timed out after {self.spec.timeout_s:g} s"
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except (ValueError, KeyError, TypeError) as exc:  # not the OpenAI streaming format
            result.error = f"unexpected answer: {type(exc).__name__}: {exc}"
        finally:
            result.done = self.now()
            with self._lock:
                self._in_flight[planned.tenant] -= 1

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any], result: RequestRecord,
                      api_key: str | None = None) -> str | None:
        """Read one streamed completion into `result`; the error message, if it failed."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code >= 400:
                await response.aread()
                return f"HTTP {response.status_code}: {_error_message(response)}"
            usage = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return f"stream error: {event['error'].get('message', event['error'])}"
                if event.get("choices"):
                    result.chunks.append(self.now())
                usage = event.get("usage") or usage
        if usage is None:
            return "the stream ended without usage"
        result.prompt_tokens = usage["prompt_tokens"]
        result.completion_tokens = usage["completion_tokens"]
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return None

    # -- drivers

    async def _sleep_until(self, t: float, stopping: asyncio.Event) -> bool:
        """Wait until run time `t`; False if the run was stopped meanwhile."""
        delay = t - self.now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
        return not stopping.is_set()

    async def _open_loop(self, state: StreamState, client: httpx.AsyncClient, stopping: asyncio.Event,
                         requests: set[asyncio.Task[None]]) -> None:
        for t in arrival_times(state.stream, self.spec.duration_s, state.arrivals):
            if not await self._sleep_until(t, stopping):
                return
            planned = self.plan(state)
            if planned is None:
                return
            task = asyncio.create_task(self._send(client, planned))
            requests.add(task)
            task.add_done_callback(requests.discard)

    async def _closed_loop(self, state: StreamState, client: httpx.AsyncClient, stopping: asyncio.Event) -> None:
        start, end = state.stream.window(self.spec.duration_s)
        if not await self._sleep_until(start, stopping):
            return
        while self.now() < end and not stopping.is_set():
            planned = self.plan(state)
            if planned is None:
                return
            await self._send(client, planned)

    async def _watch(self, stopping: asyncio.Event) -> None:
        while not self.stop_flag.is_set():
            await asyncio.sleep(0.05)
        stopping.set()

    async def _progress(self) -> None:
        tty = sys.stderr.isatty()
        interval = 1.0 if tty else 5.0
        last_tokens, last_t = 0, 0.0
        try:
            while True:
                await asyncio.sleep(interval)
                now = self.now()
                report = self.report(complete=False)
                tokens = report.total.generated_tokens
                rate = (tokens - last_tokens) / max(now - last_t, 1e-9)
                last_tokens, last_t = tokens, now
                total = report.total
                hit = "-" if total.hit_rate is None else f"{total.hit_rate:.1%}"
                clock = (f"{now:5.1f}/{self.spec.duration_s:g} s" if now <= self.spec.duration_s else
                         f"{self.spec.duration_s:g} s + {now - self.spec.duration_s:.0f} s draining")
                line = (f"[kvops load] {clock}  done {total.requests_finished} "
                        f"(failed {total.requests_failed})  in flight {total.in_flight}  {rate:.0f} tok/s  hit {hit}")
                print(f"\r\x1b[K{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        finally:
            if tty:
                print(file=sys.stderr, flush=True)

    async def run(self) -> LoadReport:
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        stopping = asyncio.Event()
        requests: set[asyncio.Task[None]] = set()
        watcher = asyncio.create_task(self._watch(stopping))
        progress = asyncio.create_task(self._progress()) if self.progress else None
        stop_wait = asyncio.create_task(stopping.wait())
        timeout = httpx.Timeout(self.spec.timeout_s, connect=min(10.0, self.spec.timeout_s))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits, trust_env=False) as client:
            drivers = [asyncio.create_task(self._open_loop(s, client, stopping, requests))
                       for s in self.states if not s.stream.concurrency]
            drivers += [asyncio.create_task(self._closed_loop(s, client, stopping))  # one worker per slot
                        for s in self.states for _ in range(s.stream.concurrency or 0)]
            # Open-loop drivers end after their last arrival, closed-loop ones after their last answer;
            # then the open-loop requests still in flight are drained.
            driving = asyncio.gather(*drivers)
            await asyncio.wait({driving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if driving.done() and not driving.cancelled() and driving.exception() is not None:
                raise driving.exception()  # type: ignore[misc]
            while requests and not stopping.is_set():
                await asyncio.wait({*requests, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            self._stopped = stopping.is_set()
            pending = [t for t in (*drivers, *requests) if not t.done()]
            for task in pending:
                task.cancel()
            driving.cancel()  # its outcome is retrieved here, or asyncio logs a never-retrieved CancelledError
            await asyncio.gather(driving, *pending, return_exceptions=True)
        self._end = self.now()
        for task in (watcher, stop_wait, progress):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (watcher, stop_wait, progress) if t is not None), return_exceptions=True)
        return self.report(complete=not self._stopped)

    def report(self, complete: bool) -> LoadReport:
        elapsed = self._end if self._end is not None else self.now()
        with self._lock:
            results = [replace(r, chunks=list(r.chunks)) for r in self._results]
            peaks, peak_total = dict(self._peak), self._peak_total
        by_tenant: dict[str, list[RequestRecord]] = {}
        for r in results:
            by_tenant.setdefault(r.tenant, []).append(r)
        return LoadReport(
            url=self.url, model=self.spec.model, started_at=self.started_at, elapsed_s=round(elapsed, 3),
            complete=complete, stopped=self._stopped,
            total=summarize("all", results, elapsed, peak_total),
            tenants={t: summarize(t, rs, elapsed, peaks.get(t, 0)) for t, rs in sorted(by_tenant.items())},
            timeline=build_timeline(results, elapsed), spec=self.spec.model_dump(mode="json"),
        )


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def check_engine(url: str, model: str, timeout_s: float = 5.0, api_key: str | None = None) -> None:
    """Fail fast, with a message a person can act on, if `url` is not an engine serving `model` (asked with
    `api_key` where the engine, or a gateway in front of it, wants one)."""
    if not re.match(r"https?://[^/\s]+", url):
        raise LoadError(f"{url!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        response = httpx.get(f"{url}/v1/models", timeout=timeout_s, trust_env=False, headers=headers)
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise LoadError(f"cannot reach the engine at {url} ({reason}): is it running? Start one with "
                        "`kvops engine serve`, or check --url") from None
    if response.status_code != 200:
        raise LoadError(f"{url}/v1/models answered HTTP {response.status_code}: is {url} an OpenAI-compatible "
                        "engine?")
    try:
        served = [card["id"] for card in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise LoadError(f"{url}/v1/models did not answer with a model list: is {url} an OpenAI-compatible "
                        "engine?") from None
    if model not in served:
        raise LoadError(f"the engine at {url} serves {', '.join(map(repr, served))}, not {model!r}: set model in "
                        "the workload (or --model), and tokenizer if it is not the default model")


def _prepare(url: str, spec: LoadSpec, progress: bool, stop: threading.Event | None) -> Runner:
    url = url.rstrip("/")
    key = next((_api_key(stream.api_key_env) for stream in spec.streams if stream.api_key_env), None)
    check_engine(url, spec.model, api_key=key)
    builder = PromptBuilder(load_tokenizer(spec.tokenizer), spec.seed)
    return Runner(url, spec, builder, progress, stop)


def run_load(url: str, spec: LoadSpec, progress: bool = False, stop: threading.Event | None = None) -> LoadReport:
    """Run `spec` against the engine at `url` and return the report; blocks until the run ends (its
    duration, then in-flight requests finish) or `stop` is set (in-flight requests are cancelled).
    Raises LoadError before sending anything if the engine cannot be reached or serves another model."""
    return asyncio.run(_prepare(url, spec, progress, stop).run())


class LoadRun:
    """A load running in a background thread (see `start_load`)."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._report: LoadReport | None = None
        self._error: BaseException | None = None
        # Waited on instead of Thread.join: a join that Ctrl-C interrupts can leave the thread looking
        # finished while it still runs (CPython 3.11), and the CLI joins again after stopping it.
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvops-loadgen", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._report = asyncio.run(self._runner.run())
        except BaseException as exc:  # handed to join(), the caller's thread
            self._error = exc
        finally:
            self._done.set()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def stop(self) -> None:
        """End the run now: no new requests; requests in flight are cancelled (counted as cancelled)."""
        self._runner.stop_flag.set()

    def join(self, timeout: float | None = None) -> LoadReport:
        """Wait for the run to end and return its report. TimeoutError if it is still running after `timeout`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the load is still running after {timeout:g} s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    def snapshot(self) -> LoadReport:
        """The report so far (complete = False while running)."""
        if self._report is not None:
            return self._report
        return self._runner.report(complete=False)


def start_load(url: str, spec: LoadSpec, progress: bool = False) -> LoadRun:
    """Start `spec` against `url` in a background thread. Checks the engine (LoadError) before returning."""
    return LoadRun(_prepare(url, spec, progress, None))


def _api_key(variable: str) -> str:
    """The key in `variable`; a stream that names an unset one stops the run before it starts, not with 401s."""
    key = os.environ.get(variable)
    if not key:
        raise LoadError(f"a stream's api_key_env names {variable!r}, which is not set: export the tenant's API key "
                        "in it")
    return key
