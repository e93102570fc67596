"""What a load is: tenant streams (arrivals, lengths, prefixes, noise, window) and the run around them."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, model_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class LoadError(Exception):
    """The run cannot start: a bad workload file, an unreachable engine, a model it does not serve."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceRecord(BaseModel):
    """One line of a trace file. Other keys (ids, timestamps of the source system) are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int = Field(ge=1)
    output_tokens: int | None = Field(default=None, ge=1)
    tenant: str | None = Field(default=None, min_length=1, max_length=256)
    arrival_s: float | None = Field(default=None, ge=0)


def read_trace(path: Path) -> list[TraceRecord]:
    """The records of a JSONL trace; sorted by arrival when every record has one (replay order)."""
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    records: list[TraceRecord] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(TraceRecord.model_validate_json(line))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error.get("loc", ()))
            message = str(error.get("msg", "invalid"))
            raise ValueError(f"trace {path} line {number}: {where + ': ' if where else ''}{message}") from None
    if not records:
        raise ValueError(f"trace {path} has no records: write one JSON object per line with prompt_tokens")
    if all(r.arrival_s is not None for r in records):
        records.sort(key=lambda r: r.arrival_s or 0.0)
    return records


_DIST_PARAMS: dict[str, tuple[str, ...]] = {
    "fixed": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("median", "sigma"),
    "trace": ("trace",),
}
_ALL_PARAMS = {name for names in _DIST_PARAMS.values() for name in names}


class Lengths(_Strict):
    """A token-length distribution. A plain integer stands for ``{dist = "fixed", value = N}``."""

    dist: Literal["fixed", "uniform", "lognormal", "trace"] = "fixed"
    value: int | None = Field(default=None, ge=1)
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    median: float | None = Field(default=None, gt=0)
    sigma: float | None = Field(default=None, ge=0)
    min: int = Field(default=1, ge=1, description="clamp: no sample is shorter")
    max: int | None = Field(default=None, ge=1, description="clamp: no sample is longer")
    trace: str | None = Field(default=None, description="JSONL file; relative paths are read from the spec file's "
                                                        "directory")
    _records: list[TraceRecord] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _plain_number(cls, data: Any) -> Any:
        if isinstance(data, int) and not isinstance(data, bool):
            return {"dist": "fixed", "value": data}
        return data

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Lengths:
        needed = _DIST_PARAMS[self.dist]
        stray = sorted((self.model_fields_set & _ALL_PARAMS) - set(needed))
        if stray:
            raise ValueError(f"{stray[0]} does not apply to dist = {self.dist!r}, which takes "
                             f"{' and '.join(needed)}")
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"dist = {self.dist!r} needs {' and '.join(missing)}")
        if self.dist == "uniform" and self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        if self.trace is not None:
            path = Path(self.trace).expanduser()
            base = (info.context or {}).get("base_dir") if info is not None else None
            if not path.is_absolute() and base is not None:
                path = Path(base) / path
            self.trace = str(path)
            self._records = read_trace(path)
        return self

    @classmethod
    def fixed(cls, value: int) -> Lengths:
        return cls(dist="fixed", value=value)

    @classmethod
    def uniform(cls, low: int, high: int) -> Lengths:
        return cls(dist="uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, *, min: int = 1, max: int | None = None) -> Lengths:
        return cls(dist="lognormal", median=median, sigma=sigma, min=min, max=max)

    @property
    def records(self) -> list[TraceRecord]:
        return self._records

    def sample(self, rng: random.Random, ordinal: int, field_name: str = "prompt_tokens") -> int:
        """The length of request number `ordinal` of a stream; a trace is replayed in order, cyclically."""
        if self.dist == "fixed":
            value = float(self.value or 1)
        elif self.dist == "uniform":
            value = float(rng.randint(self.low or 1, self.high or 1))
        elif self.dist == "lognormal":
            value = (self.median or 1.0) * math.exp((self.sigma or 0.0) * rng.gauss(0.0, 1.0))
        else:
            record = self._records[ordinal % len(self._records)]
            value = float(getattr(record, field_name) or 1)
        n = max(self.min, round(value))
        return n if self.max is None else min(self.max, n)


class Stream(_Strict):
    """One tenant's traffic: how requests arrive, what their prompts look like, when it is active."""

    tenant: str = Field(default="default", min_length=1, max_length=256)
    # An engine with API keys (--api-keys-file / --api-keys-env) takes the tenant from the key, not from `user`:
    # the variable holding this tenant's key, sent as `Authorization: Bearer`.
    api_key_env: str | None = Field(default=None, min_length=1)
    rate: float | None = Field(default=None, gt=0, description="requests/s (open loop)")
    arrival: Literal["poisson", "fixed"] = "poisson"
    concurrency: int | None = Field(default=None, ge=1, description="requests always in flight (closed loop)")
    prompt: Lengths = Field(default_factory=lambda: Lengths.fixed(200), description="tokens of the unique part")
    shared_prefix_tokens: int = Field(default=0, ge=0)
    prefix_groups: int = Field(default=1, ge=1)
    prefix_key: str | None = Field(default=None, min_length=1,
                                   description="streams with the same key send the same prefixes (default: tenant)")
    noise: float = Field(default=0.0, ge=0, le=1, description="probability of whitespace noise on a prompt")
    output: Lengths = Field(default_factory=lambda: Lengths.fixed(32), description="max_tokens (EOS ignored)")
    start_s: float = Field(default=0.0, ge=0)
    stop_s: float | None = Field(default=None, gt=0)
    max_requests: int | None = Field(default=None, ge=1)
    unique: bool = Field(default=False, description="no shared prefix: every prompt is new text (a flood)")

    @model_validator(mode="after")
    def _check(self) -> Stream:
        replays = self.replays_arrivals
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give either rate (requests/s, open loop) or concurrency (requests in flight, closed "
                             "loop), not both")
        if self.rate is None and self.concurrency is None and not replays:
            hint = ": the trace has no arrival_s to replay" if self.prompt.dist == "trace" else ""
            raise ValueError(f"give rate (requests/s, open loop) or concurrency (requests in flight, closed loop)"
                             f"{hint}")
        if "arrival" in self.model_fields_set and self.rate is None:
            raise ValueError("arrival applies to rate streams only")
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise ValueError(f"stop_s ({self.stop_s:g}) must come after start_s ({self.start_s:g})")
        if self.shared_prefix_tokens == 1:
            raise ValueError("shared_prefix_tokens must be 0 or at least 2 (a prefix ends with a line break)")
        if self.unique and (self.shared_prefix_tokens or {"prefix_groups", "prefix_key"} & self.model_fields_set):
            raise ValueError("a unique stream has no shared prefix: drop shared_prefix_tokens, prefix_groups and "
                             "prefix_key, or unique")
        if self.shared_prefix_tokens == 0 and {"prefix_groups", "prefix_key"} & self.model_fields_set:
            raise ValueError("prefix_groups and prefix_key need shared_prefix_tokens > 0")
        if self.output.dist == "trace" and any(r.output_tokens is None for r in self.output.records):
            raise ValueError(f"output: trace {self.output.trace} has a record without output_tokens")
        return self

    @property
    def replays_arrivals(self) -> bool:
        """A trace with arrival times and neither rate nor concurrency: the trace says when requests come."""
        records = self.prompt.records
        return (self.rate is None and self.concurrency is None and bool(records)
                and all(r.arrival_s is not None for r in records))

    @property
    def key(self) -> str:
        return self.prefix_key or self.tenant

    def window(self, duration_s: float) -> tuple[float, float]:
        """When the stream sends: [start_s, end), within the run."""
        return self.start_s, min(duration_s, self.stop_s if self.stop_s is not None else math.inf)


class LoadSpec(_Strict):
    streams: list[Stream] = Field(min_length=1)
    duration_s: float = Field(default=30.0, gt=0, description="no request is sent after this; in-flight ones finish")
    seed: int = 0
    model: str = DEFAULT_MODEL
    timeout_s: float = Field(default=120.0, gt=0, description="per request, first byte to last")
    tokenizer: str | None = Field(default=None, description="a local model directory or .gguf whose tokenizer builds "
                                                            "the prompts (default: the default model's)")


def load_workload(path: str | Path) -> LoadSpec:
    """A TOML workload file as a LoadSpec; LoadError names the file and the key."""
    from kvops.config_files import first_error, read_toml

    data = read_toml(path, "workload file", "benchmarks/workloads/mixed.toml", LoadError)
    try:
        return LoadSpec.model_validate(data, context={"base_dir": Path(path).parent})
    except ValidationError as exc:
        raise LoadError(f"{path}: {first_error(exc)}") from None
