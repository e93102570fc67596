"""`kvops bench load`: traffic for an engine over its OpenAI API, from a spec of tenant streams.

Scenarios use it from Python (`run_load`, `start_load`), people from the command line. A spec is
a set of streams; each stream is one tenant's traffic: open loop (a request rate, Poisson or
evenly spaced) or closed loop (N requests always in flight), with prompt and output length
distributions, shared prefixes (system prompts, RAG documents), whitespace noise and an active
window. Prompts are text, built from prose with the default model's tokenizer so that every
part has exactly the asked number of tokens; requests are streamed, so the report has time to
first token and inter-token latency next to hit rates (from ``usage.prompt_tokens_details``).
See docs/loadgen.md.

Modules: `spec` (what a load is), `arrivals`, `prompts`, `runner` (sending, `run_load`,
`start_load`), `report` (what was measured), `cli`.
"""

from kvops.loadgen.arrivals import arrival_times
from kvops.loadgen.cli import main
from kvops.loadgen.prompts import PromptBuilder, add_noise, load_tokenizer
from kvops.loadgen.report import Latency, LoadReport, TenantStats, TimelinePoint
from kvops.loadgen.runner import LoadRun, check_engine, run_load, start_load
from kvops.loadgen.spec import DEFAULT_MODEL, Lengths, LoadError, LoadSpec, Stream, TraceRecord, load_workload

__all__ = [
    "DEFAULT_MODEL",
    "Latency",
    "Lengths",
    "LoadError",
    "LoadReport",
    "LoadRun",
    "LoadSpec",
    "PromptBuilder",
    "Stream",
    "TenantStats",
    "TimelinePoint",
    "TraceRecord",
    "add_noise",
    "arrival_times",
    "check_engine",
    "load_tokenizer",
    "load_workload",
    "main",
    "run_load",
    "start_load",
]
