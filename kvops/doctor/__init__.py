"""`kvops doctor`: one command pointed at a broken or slow deployment — a kvops engine, vLLM or SGLang, a
config file or a saved scrape — that says what is wrong, the evidence, and what to change.

Sections: environment, configuration, liveness, metrics data, cache health (the rules catalog run over a
few snapshots), traffic; each a validator (kvops.doctor.validator) registered in kvops.doctor.sections, and
one that raises costs only its own lines. What differs by engine kind is in its profile (kvops.kinds). See
docs/doctor.md.
"""

from kvops.doctor.report import Check, Report, Status

__all__ = ["Check", "Report", "Status"]
