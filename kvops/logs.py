"""Structured logging: human-readable on a terminal, JSON lines otherwise; transformers kept quiet while kvops
loads its models and tokenizers (the benchmarks and the load generator); and the level of a line of an engine's
plain-text log (vLLM's, uvicorn's, a traceback), which the supervisor gives each line it forwards."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from collections.abc import Iterator

import structlog


def configure_logging(level: str = "info", json_logs: bool | None = None) -> None:
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=lambda *args: structlog.PrintLogger(sys.stderr),  # resolved late: stderr may be swapped
        cache_logger_on_first_use=False,
    )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings, info logs and progress bars off for the block, restored after it."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


# ---------------------------------------------------------------- the level of an engine's log line

LEVELS = ("debug", "info", "warning", "error", "critical")  # lowest first
_ALIASES = {"warn": "warning", "fatal": "critical", "trace": "debug", "exception": "error",
            "d": "debug", "i": "info", "w": "warning", "e": "error", "f": "critical"}
_NAMES = r"DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL|TRACE"
_PREFIXES = (
    # vLLM's logger: `(EngineCore pid=5605) WARNING 12-07 23:57:38 [vllm.py:1703] ...` (the process tag is optional)
    re.compile(rf"^(?:\([^)]*\) )?({_NAMES}) \d"),
    # uvicorn (`INFO:     127.0.0.1:38996 - "GET ..."`) and Python's logging defaults (`WARNING:root:...`)
    re.compile(rf"^({_NAMES}):"),
    # kvops's own console lines (structlog's ConsoleRenderer): `2026-12-08T00:00:38Z [warning  ] event`
    re.compile(r"^\S+ \[(debug|info|warning|error|critical)\s*\] "),
    # torch's C++ (glog) lines: `[W1207 23:57:51.431353848 utils.cpp:68] Warning: ...`
    re.compile(r"^\[?([IWEF])\d{4} \d\d:\d\d:\d\d"),
)
_PY_WARNING = re.compile(r"^\S+:\d+: [A-Z]\w*Warning: ")  # warnings.warn: `/path/x.py:24: DeprecationWarning: ...`
_TRACEBACK_STARTS = ("Traceback (most recent call last):",
                     "During handling of the above exception, another exception occurred:",
                     "The above exception was the direct cause of the following exception:")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?::|$)")  # `RuntimeError: ...` ends a traceback


def level_name(name: str) -> str:
    """A level as kvops names them (LEVELS): `WARNING`, `warn` and glog's `W` are all "warning"; unknown: "info"."""
    lowered = name.strip().lower()
    lowered = _ALIASES.get(lowered, lowered)
    return lowered if lowered in LEVELS else "info"


def level_rank(name: str) -> int:
    """Where a level stands in LEVELS (an unknown one counts as info), for "this level and up"."""
    return LEVELS.index(level_name(name))


class LineLevels:
    """The levels of one output stream's plain-text lines, read in order: a line's own level prefix (vLLM's,
    uvicorn's, Python logging's, kvops's console, torch's C++), a Python warning, a traceback (every line of it an
    error, up to and with its exception line), and an indented line continuing the one before it (a traceback's
    frames, a warning's source line, a message over several lines) at that line's level. A line with none of these
    is info. State is kept across lines, so each stream needs its own."""

    def __init__(self) -> None:
        self._previous = "info"
        self._traceback = False

    def level(self, line: str) -> str:
        level = self._level(line)
        self._previous = level
        return level

    def _level(self, line: str) -> str:
        for prefix in _PREFIXES:
            found = prefix.match(line)
            if found:
                self._traceback = False
                return level_name(found.group(1))
        if line.startswith(_TRACEBACK_STARTS):
            self._traceback = True
            return "error"
        if line[:1].isspace():
            return self._previous
        if self._traceback:
            self._traceback = False
            if _EXCEPTION_LINE.match(line):
                return "error"
        if _PY_WARNING.match(line):
            return "warning"
        return "info"
