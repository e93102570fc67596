"""`kvops top --demo`: an engine small enough to fill, and a mixed workload that makes every panel move.

Four tenants share one engine with a 128 MiB KV cache: two chat tenants reuse one system prompt,
a support tenant sends the same prompt with whitespace noise (what prompt normalization undoes),
and from `FLOOD_AT_S` a tenant floods the cache with long unique prompts (the audit-log incident)
that evicts the others' cached prefixes. The rules watch shorter windows than in production so
that prompt variance and tenant pollution are diagnosed within about a minute; their fixes are
proposed, not applied: `f` applies them.
"""

from __future__ import annotations

import threading
import time

import httpx

from kvops.loadgen import Lengths, LoadError, LoadRun, LoadSpec, Stream, start_load

FLOOD_AT_S = 20.0

# `kvops run` settings for the demo's engine and rules (--set KEY=VALUE, TOML values).
RUN_ARGS = [
    "--set", "engines.0.name='demo'",
    "--set", "engines.0.args.kv_cache_memory='128MiB'",
    "--set", "engines.0.args.max_model_len=512",
    "--set", "engines.0.args.max_num_seqs=8",
    "--set", "engines.0.args.normalize_prompts='shadow'",
    "--set", "rules.prompt_variance.settings.window_s=15",
    "--set", "rules.prompt_variance.settings.min_queried_tokens=1000",
    "--set", "rules.tenant_pollution.settings.window_s=20",
    "--set", "rules.tenant_pollution.settings.min_evictions_caused=16",
    "--set", "rules.tenant_pollution.settings.min_victim_evictions=8",
    "--set", "rules.tenant_pollution.settings.min_victim_prompt_tokens=128",
]


def demo_load(duration_s: float = 3600.0, seed: int = 0) -> LoadSpec:
    def chat(tenant: str) -> Stream:
        return Stream(tenant=tenant, rate=0.5, shared_prefix_tokens=192, prefix_key="assistant-system-prompt",
                      prompt=Lengths.lognormal(24, 0.5, max=96), output=Lengths.uniform(8, 24))

    return LoadSpec(seed=seed, duration_s=duration_s, streams=[
        chat("chat-a"),
        chat("chat-b"),
        Stream(tenant="support", rate=0.6, shared_prefix_tokens=256, noise=0.7, prompt=Lengths.fixed(16),
               output=Lengths.fixed(8)),
        Stream(tenant="audit-log", rate=1.0, arrival="fixed", unique=True, start_s=FLOOD_AT_S,
               prompt=Lengths.fixed(400), output=Lengths.fixed(4)),
    ])


class DemoLoad:
    """Runs the demo workload against the supervisor's first engine, from when it is up until
    `stop()`; starts it again after the engine restarts (a block-size fix restarts it)."""

    def __init__(self, supervisor_url: str) -> None:
        self.supervisor_url = supervisor_url.rstrip("/")
        self.status = "waiting for the engine"
        self._stop = threading.Event()
        self._load: LoadRun | None = None
        self._thread = threading.Thread(target=self._main, name="kvops-top-demo", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._load is not None:
            self._load.stop()
        self._thread.join(timeout=10)

    def _engine_url(self) -> str | None:
        try:
            engines = httpx.get(f"{self.supervisor_url}/api/engines", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None
        up = [e for e in engines if isinstance(e, dict) and e.get("up") and e.get("snapshot_time")]
        return str(up[0]["url"]) if up else None

    def _main(self) -> None:
        seed = 0
        while not self._stop.is_set():
            url = self._engine_url()
            if url is None:
                self._stop.wait(1.0)
                continue
            try:
                self._load = start_load(url, demo_load(seed=seed))
            except LoadError as exc:
                self.status = f"cannot start the load: {exc}"
                self._stop.wait(2.0)
                continue
            self.status = f"running: 4 tenants, the audit-log flood from +{FLOOD_AT_S:g} s"
            started = time.monotonic()
            while self._load.running and not self._stop.is_set():
                self._stop.wait(0.5)
                if time.monotonic() - started > 5 and self._engine_url() is None:
                    self._load.stop()  # the engine went away (a restart): start again when it is back
            self._load.stop()
            try:
                self._load.join(timeout=30)
            except Exception as exc:  # a failed run is reported, and the load started again
                self.status = f"load stopped: {exc}"
            seed += 1


def measure(seconds: float = 90.0) -> list[tuple[float, str, str, str]]:
    """Run the demo headless for `seconds` after its engine is up; return when each diagnosis first
    appeared: (seconds after the engine's first snapshot, rule, subject, severity)."""
    import tempfile
    from pathlib import Path

    from kvops.top.embedded import EmbeddedSupervisor

    supervisor = EmbeddedSupervisor(RUN_ARGS, state_dir=Path(tempfile.mkdtemp(prefix="kvops-demo-")))
    supervisor.start()
    load = DemoLoad(supervisor.url)
    load.start()
    seen: dict[tuple[str, str, str], float] = {}
    try:
        up_at = None
        while up_at is None or time.monotonic() - up_at < seconds:
            time.sleep(1.0)
            if supervisor.exited():
                raise RuntimeError(supervisor.exited())
            try:
                engines = httpx.get(f"{supervisor.url}/api/engines", timeout=2).json()
                diagnoses = httpx.get(f"{supervisor.url}/api/diagnoses", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                continue
            if up_at is None and engines and engines[0].get("snapshot_time"):
                up_at = time.monotonic()
            for d in diagnoses:
                seen.setdefault((d["rule"], d["subject"], d["severity"]), time.monotonic() - (up_at or 0.0))
    finally:
        load.stop()
        supervisor.stop()
    return sorted((round(at, 1), *key) for key, at in seen.items())


if __name__ == "__main__":
    import sys

    for at, rule, subject, severity in measure(float(sys.argv[1]) if len(sys.argv) > 1 else 90.0):
        print(f"+{at:5.1f} s  {severity:<8} {rule} {subject}")
