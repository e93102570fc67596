"""`kvops doctor`: one command pointed at a broken or slow deployment — a kvops engine, vLLM or SGLang, a
config file or a saved scrape — that says what is wrong, the evidence, and what to change.

Sections: environment, configuration, liveness, cache health (the rules catalog run over a few
snapshots). See docs/doctor.md.
"""

from kvops.doctor.report import Check, Report, Status

__all__ = ["Check", "Report", "Status"]
