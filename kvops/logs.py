"""Structured logging: human-readable on a terminal, JSON lines otherwise; and transformers kept quiet while
kvops loads its models and tokenizers (the benchmarks and the load generator)."""

from __future__ import annotations

import contextlib
import logging
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
