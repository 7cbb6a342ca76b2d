"""Structured logging for every cleave process: one `configure_logging` call at start-up.

Log lines are JSON (one object per line) when stderr is not a terminal, and coloured
key=value text otherwise. Values bound with `structlog.contextvars` (the rpc interceptor binds
`request_id` and `rpc`) appear on every line logged while they are bound.

Logs never carry a request's body: values under the keys in `REQUEST_BODY_KEYS` (prompt text,
token ids, chat messages) are replaced by their size, tracebacks are plain (no frame locals,
where a request's prompt would sit) and each traceback line is cut at
`MAX_TRACEBACK_LINE_CHARS` (an exception's message may quote what it was given). A request is
found in the logs by its request id.
"""

from __future__ import annotations

import io
import logging
import sys
from typing import Any, TextIO

import structlog

REQUEST_BODY_KEYS = frozenset(
    {"prompt", "prompt_text", "prompt_token_ids", "token_ids", "messages", "body", "request_body", "text"}
)
MAX_TRACEBACK_LINE_CHARS = 240


def _size_of(value: Any) -> str:
    if isinstance(value, (str, bytes)):
        return f"<omitted: {len(value)} chars>" if isinstance(value, str) else f"<omitted: {len(value)} bytes>"
    try:
        return f"<omitted: {len(value)} items>"
    except TypeError:
        return "<omitted>"


def _cut_lines(text: str) -> str:
    return "\n".join(
        line if len(line) <= MAX_TRACEBACK_LINE_CHARS
        else f"{line[:MAX_TRACEBACK_LINE_CHARS]}... [{len(line) - MAX_TRACEBACK_LINE_CHARS} chars omitted]"
        for line in text.split("\n")
    )


def omit_request_bodies(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: request bodies out, long traceback lines cut (module docstring)."""
    for key in REQUEST_BODY_KEYS & event_dict.keys():
        event_dict[key] = _size_of(event_dict[key])
    if isinstance(event_dict.get("exception"), str):
        event_dict["exception"] = _cut_lines(event_dict["exception"])
    return event_dict


def _plain_traceback(sio: TextIO, exc_info: Any) -> None:
    """The console's traceback: no frame locals, long lines cut."""
    buffer = io.StringIO()
    structlog.dev.plain_traceback(buffer, exc_info)
    sio.write(_cut_lines(buffer.getvalue()))


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
        else structlog.dev.ConsoleRenderer(colors=stream.isatty(), exception_formatter=_plain_traceback)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, omit_request_bodies, renderer]
        if json
        else [*shared, omit_request_bodies, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=stream, force=True)
    # grpc's and asyncio's debug lines (one per poll) drown everything else.
    for noisy in ("grpc._cython", "asyncio"):
        logging.getLogger(noisy).setLevel(max(numeric_level, logging.INFO))
