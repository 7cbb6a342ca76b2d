"""Structured logging for every cleave process: one `configure_logging` call at start-up.

Log lines are JSON (one object per line) when stderr is not a terminal, and coloured
key=value text otherwise. Values bound with `structlog.contextvars` (the rpc interceptor binds
`request_id` and `rpc`) appear on every line logged while they are bound.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(
    level: str | int = "INFO", json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog and the standard library's logging (grpc, asyncio) together.

    Args:
        level: minimum level, a name ("DEBUG", "info") or a `logging` constant.
        json: force JSON (True) or console (False) output; None picks JSON unless the stream
            is a terminal.
        stream: where log lines go; stderr by default.
    """
    stream = stream if stream is not None else sys.stderr
    numeric_level = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer]
        if json
        else [*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=stream, force=True)
    # grpc's and asyncio's debug lines (one per poll) drown everything else.
    for noisy in ("grpc._cython", "asyncio"):
        logging.getLogger(noisy).setLevel(max(numeric_level, logging.INFO))
