"""Structured logging: human-readable on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

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
