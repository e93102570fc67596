"""The kinds of inference server kvops knows, one module each, and the registry that finds them.

Each module of this package defines one `EngineProfile` as `PROFILE` (kvops.kinds.profile says what one
holds). Adding a kind is adding its module and naming it in `MODULES` below: detection, the snapshot reader,
the rules' and doctor's remedies and the supervisor's config check all ask the registry. A kind kvops manages
(Capability.MANAGED) also has a launcher, in kvops.supervisor.launchers' registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvops.adapters.prometheus import Scrape
from kvops.kinds import kvops, llamacpp, sglang, tensorrt_llm, tgi, vllm
from kvops.kinds.profile import Capability, EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

# What a watched engine is configured as when kvops should recognise it at the first poll; a managed `auto`
# engine is a kvops engine.
AUTO = "auto"

PROFILES: dict[str, EngineProfile] = {}


def register(profile: EngineProfile) -> EngineProfile:
    PROFILES[profile.kind] = profile
    return profile


def unregister(kind: str) -> None:
    PROFILES.pop(kind, None)


# The kinds, in the order detection breaks ties and lists them.
MODULES = (kvops, vllm, sglang, llamacpp, tgi, tensorrt_llm)
for _module in MODULES:
    register(_module.PROFILE)


def kinds() -> tuple[str, ...]:
    return tuple(PROFILES)


def profile(kind: str) -> EngineProfile:
    """The profile of `kind`; a kind kvops does not know gets a neutral one: no capabilities, no flags, no
    remedies, so nothing is claimed or advised for it."""
    found = PROFILES.get(kind)
    return found if found is not None else EngineProfile(kind=kind, title=kind, recognition=Recognition(()),
                                                         read_scrape=None)


def profile_of(snapshot: Snapshot) -> EngineProfile:
    return profile(snapshot.source)


def managed_profile(kind: str) -> EngineProfile:
    """The profile of a managed engine configured as `kind`."""
    return kvops.PROFILE if kind == AUTO else profile(kind)


def managed_kinds() -> tuple[str, ...]:
    """What a managed engine's `kind` may be."""
    return (AUTO, *(kind for kind, found in PROFILES.items() if found.can(Capability.MANAGED)))


def _listed(words: list[str], last: str) -> str:
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)


# A profile's note naming the flag without which its server exports no /metrics.
ENABLE_METRICS = "enable_metrics"


def metrics_switches() -> list[EngineProfile]:
    """The kinds whose /metrics is off unless started with a flag (their note ENABLE_METRICS names it)."""
    return [p for p in PROFILES.values() if ENABLE_METRICS in p.notes]


def unrecognised(url: str) -> str:
    """Why a server that answers is not one kvops reads: the kinds it knows, and what some need turned on."""
    titles = [p.title for p in PROFILES.values()]
    switched = metrics_switches()
    flags = "; ".join(f"{p.title}'s {p.notes[ENABLE_METRICS]}" for p in switched)
    needs = (f" ({_listed([p.title for p in switched], 'and')} need{'s' if len(switched) == 1 else ''} metrics "
             f"enabled: {flags})") if switched else ""
    return f"{url} answers, but neither /metrics nor /v1/models looks like a {_listed(titles, 'or')} server{needs}"


def detect(scrape: Scrape | None, models: dict[str, Any] | None = None) -> EngineProfile | None:
    """From the metric names (the kind with the most series wins: a proxy may add a few of another's; a kind
    whose own marker names are there wins over the kind whose names it borrows), else from `/v1/models`'
    `owned_by`. None: not an inference server kvops knows."""
    if scrape is not None:
        names = scrape.names
        borrowers = [p for p in PROFILES.values() if any(name in names for name in p.recognition.borrowed_markers)]
        counts = {p.kind: sum(1 for name in names if name.startswith(p.recognition.metric_prefixes))
                  for p in (borrowers or PROFILES.values())}
        best = max(counts, key=lambda kind: counts[kind], default=None)
        if best is not None and (counts[best] > 0 or borrowers):
            return PROFILES[best]
    owner = str(model_card(models).get("owned_by", "")).lower()
    return next((p for p in PROFILES.values() if any(word in owner for word in p.recognition.owned_by)), None)


def metrics_paths(kind: str | None = None) -> tuple[str, ...]:
    """Where a server's Prometheus text may be, in the order to try: its kind's paths; for a server not recognised
    yet, `/metrics` and then every other path a kind serves it at."""
    if kind is not None and kind in PROFILES:
        return PROFILES[kind].metrics_paths
    paths = ["/metrics"]
    for found in PROFILES.values():
        paths.extend(path for path in found.metrics_paths if path not in paths)
    return tuple(paths)


def first_scrape(get: Callable[[str], str | None], kind: str | None = None) -> tuple[str, Scrape] | None:
    """The first of `metrics_paths(kind)` whose answer is Prometheus text with samples, and that path; else the first
    answer there was (a server with no sample yet); None when no path answered. `get(path)` is the answer's text,
    None for none (an error status, no connection). A JSON answer (trtllm-serve's `/metrics`) parses to no sample,
    so the next path is tried."""
    answered: tuple[str, Scrape] | None = None
    for path in metrics_paths(kind):
        text = get(path)
        if text is None:
            continue
        scrape = Scrape.parse(text)
        if scrape.names:
            return path, scrape
        answered = answered or (path, scrape)
    return answered


def model_card(models: dict[str, Any] | None) -> dict[str, Any]:
    """The first model of a `/v1/models` answer ({} when there is none)."""
    data = (models or {}).get("data") if isinstance(models, dict) else None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}


def snapshot_from_scrape(kind: str, scrape: Scrape, t: float, models: dict[str, Any] | None = None,
                         started_at: float | None = None) -> Snapshot:
    """A `kind` server's scrape (and `/v1/models` answer) read into a snapshot."""
    read = profile(kind).read_scrape
    if read is None:
        raise ValueError(f"kvops reads no /metrics of a {kind} server")
    return read(scrape, t, model_card(models), started_at)


__all__ = ["AUTO", "ENABLE_METRICS", "MODULES", "PROFILES", "Capability", "EngineProfile", "Recognition", "Remedy",
           "detect", "first_scrape", "kinds", "managed_kinds", "managed_profile", "metrics_paths", "metrics_switches",
           "model_card", "profile", "profile_of", "register", "snapshot_from_scrape", "unrecognised", "unregister"]
